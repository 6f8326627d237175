"""The ledger's counting rules on small tables of facts (pure: agent/ledger/tally.py, docs/ledger.md "How the
report counts"). Times are hours from 0."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from agent.ledger.facts import NoticeFact, ReportFact
from agent.ledger.tally import Rules, Tally, tally_job

H = 3600.0
BASE = ReportFact(0.0, "A", 1, 0, None, "checkpoint", "finished", None, 60.0, 100, False, None, None, None)


def rep(hours: float, **fields: Any) -> ReportFact:
    return replace(BASE, time=hours * H, **fields)


def notice(
    detected_h: float, deadline_h: float, cleared_h: float | None = None, nid: str = "n1"
) -> NoticeFact:
    cleared = cleared_h * H if cleared_h is not None else None
    return NoticeFact(
        nid, "termination", "aws", "critical", False, detected_h * H, deadline_h * H, cleared, 0.0
    )


def tally(reports: list[ReportFact], notices: list[NoticeFact], now_h: float = 100.0, **rules: Any) -> Tally:
    return tally_job("A", reports, notices, now_h * H, Rules(**rules))


def test_a_job_that_kept_reporting_after_the_deadline_redid_nothing() -> None:
    """A lost flush, but the same process checkpoints after the deadline: no redone work, no restart."""
    t = tally(
        [rep(0, step=1), rep(1.5, step=2, phase="failed", emergency=True, notice_id="n1"), rep(3, step=3)],
        [notice(1.4, 2.0)],
    )
    assert (1, 1, 0.0, 0.0) == (t.announced, t.lost, t.redone_gpu_hours, t.restart_gpu_hours)


def test_a_later_unannounced_resume_is_not_charged_to_an_earlier_notice() -> None:
    """In-time flush at 1.5 h, the job keeps going, then comes back in a new process at 10 h: the notice has
    no restart; the resume is an unannounced interruption (10 h - the 9 h checkpoint = 1 h redone)."""
    reports = [
        rep(0, step=1),
        rep(1.5, step=2, emergency=True, notice_id="n1"),
        rep(3, step=3),
        rep(9, step=4),
        rep(10, pid=2, kind="participant", phase="registered", duration_s=None, bytes=None),
    ]
    t = tally(reports, [notice(1.4, 2.0)])
    assert (1, 1, 1, 0.0, 1.0) == (
        t.announced,
        t.in_time,
        t.unannounced,
        t.restart_gpu_hours,
        t.redone_gpu_hours,
    )


def test_a_notice_withdrawn_before_its_deadline_is_no_interruption() -> None:
    t = tally([rep(0, step=1), rep(5, step=2)], [notice(1.0, 2.0, cleared_h=1.5)])
    assert (0, 0) == (t.announced, t.unannounced)


def test_a_job_idle_longer_than_active_s_at_the_deadline_was_not_there() -> None:
    t = tally([rep(0, step=1)], [notice(30.0, 30.1)], active_s=86400.0)
    assert 0 == t.announced


def test_a_flush_naming_no_notice_counts_for_the_notice_it_came_in_and_late_is_late() -> None:
    """Finished 2 minutes after the deadline, no notice id: the notice's flush, late."""
    t = tally([rep(0, step=1), rep(2 + 2 / 60, step=2, emergency=True)], [notice(1.9, 2.0)])
    assert (1, 1, 0) == (t.announced, t.late, t.lost)


def test_a_rank_that_said_its_gpus_once_keeps_them() -> None:
    """The registration says gpus=4; the checkpoints of the same rank do not repeat it."""
    t = tally([rep(0, kind="participant", phase="registered", gpus=4), rep(1, step=1)], [])
    assert (4, 4.0) == (t.gpus, t.gpu_hours)


def test_drills_count_only_when_asked() -> None:
    drill = replace(notice(1.0, 1.1), drill=True)
    reports = [rep(0, step=1), rep(1.05, step=2, emergency=True, notice_id="n1"), rep(2, pid=2, step=3)]
    assert ((0, 0), (1, 0)) == (
        (tally(reports, [drill]).announced, tally(reports, [drill]).unannounced),
        (tally(reports, [drill], drills=True).announced, tally(reports, [drill], drills=True).unannounced),
    )


def test_a_notice_whose_deadline_is_still_ahead_is_not_counted_yet() -> None:
    t = tally([rep(0, step=1)], [notice(1.0, 5.0)], now_h=2.0)
    assert 0 == t.announced


def test_a_job_begins_when_its_first_checkpoint_began() -> None:
    """The first report is a checkpoint finished at 1 h that took 30 minutes: the job was there from 0.5 h."""
    t = tally([rep(1, step=1, duration_s=1800.0), rep(2, step=2, duration_s=1800.0)], [])
    assert (1.5, 1.0) == (t.job_hours, t.checkpoint_gpu_hours)
