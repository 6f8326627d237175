"""The client's pure view of the event stream: notices, triggers, acknowledgement."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any

from agent.client.events import NoticeState, TriggerPolicy, parse_notice, parse_time

NOW = datetime(2026, 1, 1, 12, 0, tzinfo=timezone.utc)


def notice(nid: str = "aws-1", kind: str = "termination", deadline: str | None = "2026-01-01T12:02:00Z",
           **extra: Any) -> dict[str, Any]:  # fmt: skip
    return {"id": nid, "kind": kind, "severity": extra.pop("severity", "critical"), "source": "aws",
            "reason": "spot", "deadline": deadline, **extra}  # fmt: skip


def test_parse_time_accepts_z_suffix() -> None:
    assert datetime(2026, 1, 1, 12, 2, tzinfo=timezone.utc) == parse_time("2026-01-01T12:02:00.000Z")


def test_parse_notice_keeps_unknown_kinds_and_ignores_unknown_fields() -> None:
    parsed = parse_notice(notice(kind="meteor_strike", novel_field=1))
    assert parsed is not None
    assert "meteor_strike" == parsed.kind


def test_parse_notice_without_id_is_none() -> None:
    assert parse_notice({"kind": "termination"}) is None


def test_notice_event_raises_one_trigger() -> None:
    state = NoticeState()
    state.apply("notice", {"notice": notice()}, NOW)
    trigger = state.first_trigger()
    assert trigger is not None
    assert ("notice", "aws-1") == (trigger.reason, trigger.notice_id)


def test_update_after_acknowledge_does_not_trigger_again() -> None:
    state = NoticeState()
    state.apply("notice", {"notice": notice()}, NOW)
    state.acknowledge()
    state.apply("update", {"notice": notice(deadline="2026-01-01T12:01:00Z")}, NOW)
    assert state.first_trigger() is None


def test_update_before_acknowledge_refreshes_the_trigger_deadline() -> None:
    state = NoticeState()
    state.apply("notice", {"notice": notice()}, NOW)
    state.apply("update", {"notice": notice(deadline="2026-01-01T12:01:00Z")}, NOW)
    trigger = state.first_trigger()
    assert trigger is not None
    assert NOW + timedelta(minutes=1) == trigger.deadline


def test_snapshot_clears_notices_it_does_not_list() -> None:
    state = NoticeState()
    state.apply("notice", {"notice": notice("a")}, NOW)
    changes = state.apply("snapshot", {"notices": [notice("b")]}, NOW)
    assert [("cleared", "a"), ("notice", "b")] == [(c.type, c.notice.id) for c in changes]


def test_cleared_notice_drops_its_pending_trigger() -> None:
    state = NoticeState()
    state.apply("notice", {"notice": notice()}, NOW)
    state.apply("cleared", {"notice": notice()}, NOW)
    assert (None, {}) == (state.first_trigger(), state.notices)


def test_policy_ignores_kinds_it_does_not_list() -> None:
    state = NoticeState()
    state.apply("notice", {"notice": notice(kind="gpu_degraded", severity="warning")}, NOW)
    assert state.first_trigger() is None


def test_policy_can_exclude_drills() -> None:
    state = NoticeState(TriggerPolicy(drills=False))
    state.apply("notice", {"notice": notice(drill=True)}, NOW)
    assert state.first_trigger() is None


def test_first_trigger_is_the_earliest_deadline() -> None:
    state = NoticeState()
    state.apply("notice", {"notice": notice("late", deadline="2026-01-01T12:05:00Z")}, NOW)
    state.apply("notice", {"notice": notice("soon", deadline="2026-01-01T12:00:30Z")}, NOW)
    trigger = state.first_trigger()
    assert trigger is not None
    assert "soon" == trigger.notice_id


def test_most_urgent_prefers_severity_over_deadline() -> None:
    state = NoticeState()
    state.apply("notice", {"notice": notice("warn", kind="rebalance", severity="warning",
                                            deadline="2026-01-01T12:00:10Z")}, NOW)  # fmt: skip
    state.apply("notice", {"notice": notice("crit", deadline=None)}, NOW)
    urgent = state.most_urgent()
    assert urgent is not None
    assert "crit" == urgent.id


def test_marked_handled_notice_does_not_trigger_when_it_arrives() -> None:
    state = NoticeState()
    state.mark_handled(["aws-1"])
    state.apply("snapshot", {"notices": [notice()]}, NOW)
    assert (None, True) == (state.first_trigger(), "aws-1" in state.notices)


def test_notice_whose_deadline_passed_before_the_job_started_does_not_trigger() -> None:
    state = NoticeState(started_at=NOW)
    state.apply("snapshot", {"notices": [notice(deadline="2026-01-01T11:59:58Z", drill=True)]}, NOW)
    assert (None, ["aws-1"]) == (state.first_trigger(), list(state.notices))


def test_notice_whose_deadline_is_after_the_job_started_triggers() -> None:
    state = NoticeState(started_at=NOW)
    state.apply("snapshot", {"notices": [notice(deadline="2026-01-01T12:00:01Z")]}, NOW)
    assert state.first_trigger() is not None


def test_passed_notice_triggers_once_its_deadline_moves_after_the_start() -> None:
    state = NoticeState(started_at=NOW)
    state.apply("snapshot", {"notices": [notice(deadline="2026-01-01T11:59:00Z")]}, NOW)
    state.apply("update", {"notice": notice(deadline="2026-01-01T12:30:00Z")}, NOW)
    trigger = state.first_trigger()
    assert trigger is not None and "aws-1" == trigger.notice_id
