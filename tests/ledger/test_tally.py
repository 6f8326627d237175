"""The ledger's counting rules on small tables of facts (pure: agent/ledger/tally.py, docs/ledger.md "How the
report counts"). Times are hours from 0."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from agent.ledger.facts import NoticeFact, ReportFact
from agent.ledger.tally import Rules, Tally, goodput, tally_job

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


# ----- the orders that happen in life ---------------------------------------------------------------------
# Each row: the facts of one job, and (announced, unannounced, in time, late, lost, redone h, restart h, steps
# redone). pid 1 is the first generation of processes, pid 2 the resumed one, pid 3 the next.


def registered(hours: float, pid: int) -> ReportFact:
    return rep(hours, pid=pid, kind="participant", phase="registered", duration_s=None, bytes=None)


def flush(hours: float, step: int, nid: str | None = "n1", pid: int = 1, **fields: Any) -> ReportFact:
    return rep(hours, pid=pid, step=step, emergency=True, notice_id=nid, duration_s=36.0, **fields)


def drill(detected_h: float, deadline_h: float) -> NoticeFact:
    return replace(notice(detected_h, deadline_h), drill=True, source="drill")


def summary(t: Tally) -> tuple[int, int, int, int, int, float, float, int]:
    return (
        t.announced,
        t.unannounced,
        t.in_time,
        t.late,
        t.lost,
        round(t.redone_gpu_hours, 4),
        round(t.restart_gpu_hours, 4),
        t.steps_redone,
    )


# The demo: a flush at 1.01 h, the job restarted at once (1.02 h) before the deadline (1.1 h).
DEMO = [rep(0, step=1), flush(1.01, 5), registered(1.02, 2), rep(2, pid=2, step=10)]

ORDERS: list[tuple[str, list[ReportFact], list[NoticeFact], dict[str, Any], tuple[Any, ...]]] = [
    ("resume before the deadline", DEMO, [notice(1.0, 1.1)], {}, (1, 0, 1, 0, 0, 0.0, 0.01, 0)),
    ("resume before the deadline, made out early", DEMO, [notice(1.0, 1.1)], {"now_h": 1.05},
     (1, 0, 1, 0, 0, 0.0, 0.01, 0)),
    ("a drill's resume before its deadline", DEMO, [drill(1.0, 1.1)], {}, (0, 0, 0, 0, 0, 0.0, 0.0, 0)),
    ("a drill's resume, drills counted", DEMO, [drill(1.0, 1.1)], {"drills": True},
     (1, 0, 1, 0, 0, 0.0, 0.01, 0)),
    ("resume after the deadline, on another host", [rep(0, step=1), flush(1.05, 5)], [notice(1.0, 1.1)], {},
     (1, 0, 1, 0, 0, 0.0, 0.0, 0)),
    ("resume after the deadline, on this host",
     [rep(0, step=1), flush(1.05, 5), registered(1.5, 2)], [notice(1.0, 1.1)], {},
     (1, 0, 1, 0, 0, 0.0, 0.45, 0)),
    ("no resume, the flush failed", [rep(0, step=1), rep(0.5, step=3), flush(1.05, 5, phase="failed")],
     [notice(1.0, 1.1)], {}, (1, 0, 0, 0, 1, 0.6, 0.0, 2)),
    ("a crash, then the host taken before the resume", [rep(0, step=1), rep(1, step=2), registered(2, 2)],
     [notice(1.4, 1.5)], {}, (1, 0, 0, 0, 1, 0.5, 0.5, 0)),
    ("two notices, one after the other",
     [*DEMO, flush(3.01, 12, "n2", pid=2), registered(3.5, 3)],
     [notice(1.0, 1.1), notice(3.0, 3.1, nid="n2")], {}, (2, 0, 2, 0, 0, 0.0, 0.01 + 0.49, 0)),
    ("two notices at once, one end",
     DEMO, [notice(1.0, 1.1), replace(notice(0.9, 1.5, nid="n2"), kind="maintenance")], {},
     (1, 0, 1, 0, 0, 0.0, 0.01, 0)),
    ("a SIGTERM without a notice", [rep(0, step=1), flush(1.0, 4, None), registered(1.1, 2), rep(2, pid=2)],
     [], {}, (0, 1, 0, 0, 0, 0.1, 0.0, 0)),
    ("a crash", [rep(0, step=1), rep(1, step=2), registered(1.5, 2), rep(2, pid=2, step=3)], [], {},
     (0, 1, 0, 0, 0, 0.5, 0.0, 0)),
]  # fmt: skip


@pytest.mark.parametrize(
    ("reports", "notices", "options", "expected"),
    [pytest.param(*row[1:], id=row[0]) for row in ORDERS],
)
def test_the_orders_that_happen_in_life(
    reports: list[ReportFact], notices: list[NoticeFact], options: dict[str, Any], expected: tuple[Any, ...]
) -> None:
    assert expected == summary(tally(reports, notices, **options))


def test_a_resume_before_the_deadline_is_listed_as_announced() -> None:
    """The demo's order: the resume names the notice that stopped the job and the step of its flush."""
    resumes = tally(DEMO, [notice(1.0, 1.1)]).resumes
    assert [("n1", True, 5, 0, False)] == [
        (r["notice_id"], r["announced"], r["from_step"], r["steps_redone"], r["drill"]) for r in resumes
    ]


def test_a_drills_resume_is_listed_as_the_drills_even_when_drills_do_not_count() -> None:
    resumes = tally(DEMO, [drill(1.0, 1.1)]).resumes
    assert [(True, True, "n1")] == [(r["announced"], r["drill"], r["notice_id"]) for r in resumes]


def test_the_resumed_process_sigterm_save_is_not_added_to_the_flush() -> None:
    """After a drill flushed in time and the job came back, the new process saves again on SIGTERM (no
    notice, after the deadline): the flush is still the first process's save alone, in time."""
    reports = [*DEMO, flush(1.2, 11, None, pid=2, bytes=500)]
    flushes = tally(reports, [drill(1.0, 1.1)], drills=True).flushes
    assert [("in_time", 5, 100, round(0.09 * H, 3))] == [
        (f["outcome"], f["step"], f["bytes"], f["slack_s"]) for f in flushes
    ]


def test_an_uncounted_drill_costs_nothing_and_a_counted_one_its_flush_and_restart() -> None:
    """Goodput without --drills: only the periodic checkpoints (two of 60 s); with: also the 36 s flush
    and the 36 s restart."""
    without, counted = tally(DEMO, [drill(1.0, 1.1)]), tally(DEMO, [drill(1.0, 1.1)], drills=True)
    hours = (2 * H + 60.0) / H
    assert (round(1 - 120 / 3600 / hours, 6), round(1 - (120 + 36 + 36) / 3600 / hours, 6)) == (
        round(goodput(without) or 0.0, 6),
        round(goodput(counted) or 0.0, 6),
    )


def test_a_late_report_of_an_earlier_process_starts_no_generation() -> None:
    """The first process's last report arrives after the new one registered: still one resume."""
    reports = [rep(0, step=1), flush(1.01, 5), registered(1.02, 2), rep(1.03, pid=1, kind="participant",
               phase="closed", duration_s=None, bytes=None), rep(2, pid=2, step=6)]  # fmt: skip
    t = tally(reports, [notice(1.0, 1.1)])
    assert (1, 0, 1) == (t.announced, t.unannounced, len(t.resumes))


def test_goodput_is_the_useful_share_of_the_gpu_hours() -> None:
    """Two GPUs for an hour, one 6-minute checkpoint: 1.8 useful GPU-hours of 2, goodput 0.9."""
    t = tally([replace(registered(0, 1), gpus=2), rep(1, step=2, duration_s=360.0)], [])
    assert (2.0, 1.8, 0.9) == (t.gpu_hours, round(t.useful_gpu_hours, 6), round(goodput(t) or 0.0, 6))
