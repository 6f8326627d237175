"""The notice model and board: pure, table-driven."""

from __future__ import annotations

import itertools
from datetime import datetime, timedelta, timezone

import pytest

from agent.core.board import NoticeBoard
from agent.core.errors import NoticeError
from agent.core.notice import Event, EventType, Kind, Notice, Observation, Severity, format_time, parse_time

T0 = datetime(2026, 12, 2, 12, 0, 0, tzinfo=timezone.utc)


def board() -> NoticeBoard:
    counter = itertools.count(1)
    return NoticeBoard(id_factory=lambda source: f"{source}-{next(counter)}")


def obs(
    key: str = "spot",
    kind: Kind = Kind.TERMINATION,
    deadline_s: float | None = 120,
    reason: str = "spot terminate",
    **kw: object,
) -> Observation:
    deadline = T0 + timedelta(seconds=deadline_s) if deadline_s is not None else None
    return Observation(key=key, kind=kind, reason=reason, deadline=deadline, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kind", "severity"),
    [
        (Kind.TERMINATION, Severity.CRITICAL),
        (Kind.REBALANCE, Severity.WARNING),
        (Kind.MAINTENANCE, Severity.WARNING),
        (Kind.GPU_FAULT, Severity.CRITICAL),
        (Kind.GPU_DEGRADED, Severity.WARNING),
        (Kind.HOST_DEGRADED, Severity.WARNING),
    ],
)
def test_each_kind_has_its_default_severity(kind: Kind, severity: Severity) -> None:
    change = board().observe("aws", obs(kind=kind), T0)
    assert change is not None
    assert severity == change.notice.severity


def test_first_observation_is_a_new_notice_with_identity_and_deadline() -> None:
    change = board().observe("aws", obs(), T0)
    assert change is not None
    assert (EventType.NOTICE, "aws-1", T0 + timedelta(seconds=120), T0) == (
        change.type,
        change.notice.id,
        change.notice.deadline,
        change.notice.detected_at,
    )


@pytest.mark.parametrize(
    ("second", "expected_type", "expected_deadline_s"),
    [
        # the same observation again: clients hear nothing
        (obs(), None, 120),
        # a deadline that drifts later by a few seconds (mocks answer now + 2 min on every poll): kept earlier
        (obs(deadline_s=125), None, 120),
        # a deadline moved earlier: always an update
        (obs(deadline_s=60), EventType.UPDATE, 60),
        # a deadline moved much later (rescheduled): an update
        (obs(deadline_s=600), EventType.UPDATE, 600),
        # a new reason or severity: an update
        (obs(reason="spot stop"), EventType.UPDATE, 120),
        (obs(severity=Severity.WARNING), EventType.UPDATE, 120),
        # payload detail alone changing: no event
        (obs(detail={"time": "x"}), None, 120),
    ],
)
def test_repeated_observation_keeps_identity(
    second: Observation, expected_type: EventType | None, expected_deadline_s: float
) -> None:
    b = board()
    b.observe("aws", obs(), T0)
    change = b.observe("aws", second, T0 + timedelta(seconds=1))
    assert expected_type == (change.type if change else None)
    (notice,) = b.active()
    assert ("aws-1", T0 + timedelta(seconds=expected_deadline_s)) == (notice.id, notice.deadline)


def test_replace_source_clears_what_is_no_longer_reported_and_only_for_that_source() -> None:
    b = board()
    b.replace_source("aws", [obs("a"), obs("b", kind=Kind.REBALANCE)], T0)
    b.observe("gcp", obs("a"), T0)
    changes = b.replace_source("aws", [obs("a")], T0 + timedelta(seconds=1))
    assert [(EventType.CLEARED, "b")] == [(c.type, c.notice.key) for c in changes]
    assert changes[0].notice.cleared_at == T0 + timedelta(seconds=1)
    assert {("aws", "a"), ("gcp", "a")} == {(n.source, n.key) for n in b.active()}


def test_a_cleared_condition_that_returns_is_a_new_notice_with_a_new_identity() -> None:
    b = board()
    first = b.observe("aws", obs(), T0)
    b.clear("aws", "spot", T0)
    again = b.observe("aws", obs(), T0)
    assert first is not None and again is not None
    assert (EventType.NOTICE, "aws-2") == (again.type, again.notice.id)


def test_clear_of_an_unknown_key_is_no_change() -> None:
    assert board().clear("aws", "nothing", T0) is None


def test_active_is_ordered_most_urgent_first() -> None:
    b = board()
    b.observe("x", obs("late", deadline_s=500), T0)
    b.observe("x", obs("info", kind=Kind.REBALANCE, deadline_s=10), T0)
    b.observe("x", obs("soon", deadline_s=50), T0)
    assert ["soon", "late", "info"] == [n.key for n in b.active()]


def test_restored_notice_keeps_identity_and_deadline_when_the_source_reports_it_again() -> None:
    b = board()
    b.observe("aws", obs(), T0)
    (saved,) = b.active()
    restarted = board()
    restarted.restore([Notice.from_json(saved.to_json(T0))])
    change = restarted.observe("aws", obs(deadline_s=121), T0 + timedelta(seconds=30))
    assert change is None
    (notice,) = restarted.active()
    assert (saved.id, saved.deadline) == (notice.id, notice.deadline)


def test_a_source_replacement_reaches_the_listeners_once_after_the_board_holds_all_of_it() -> None:
    """Listeners hear a replace_source as one list, with the caller's now, and see the board already changed
    (a listener that reads the board finds every change applied)."""
    b = board()
    b.observe("aws", obs("old"), T0)
    heard: list[tuple[list[tuple[EventType, str]], datetime, list[str]]] = []
    b.on_change(
        lambda changes, now: heard.append(
            ([(c.type, c.notice.key) for c in changes], now, [n.key for n in b.active()])
        )
    )
    later = T0 + timedelta(seconds=5)
    b.replace_source("aws", [obs("new")], later)
    assert [([(EventType.NOTICE, "new"), (EventType.CLEARED, "old")], later, ["new"])] == heard


def test_the_listeners_hear_nothing_when_an_observation_changes_nothing() -> None:
    b = board()
    b.observe("aws", obs(), T0)
    heard: list[object] = []
    b.on_change(lambda changes, now: heard.append(changes))
    b.observe("aws", obs(), T0 + timedelta(seconds=1))
    b.clear("aws", "nothing", T0)
    b.replace_source("aws", [obs()], T0)
    assert [] == heard


def test_the_listeners_are_called_in_the_order_they_were_added() -> None:
    b = board()
    order: list[str] = []
    b.on_change(lambda changes, now: order.append("fan-out"))
    b.on_change(lambda changes, now: order.append("state"))
    b.observe("aws", obs(), T0)
    b.clear("aws", "spot", T0)
    assert ["fan-out", "state", "fan-out", "state"] == order


@pytest.mark.parametrize(
    ("grace", "now_s", "expected_cleared"),
    [
        (timedelta(seconds=10), 125, 0),
        (timedelta(seconds=10), 130, 1),
        (None, 10_000, 0),
    ],
)
def test_expire_clears_after_deadline_plus_grace(
    grace: timedelta | None, now_s: float, expected_cleared: int
) -> None:
    b = board()
    b.observe("drill", obs(), T0)
    changes = b.expire(T0 + timedelta(seconds=now_s), lambda n: grace)
    assert expected_cleared == len(changes)


def test_next_expiry_is_the_earliest_deadline_plus_grace() -> None:
    b = board()
    b.observe("drill", obs("a", deadline_s=50), T0)
    b.observe("drill", obs("b", deadline_s=20), T0)
    assert T0 + timedelta(seconds=25) == b.next_expiry(lambda n: timedelta(seconds=5))


@pytest.mark.parametrize(
    ("now_s", "expected"),
    [(0, 120.0), (119.5, 0.5), (200, 0.0)],
)
def test_seconds_left_counts_down_to_zero(now_s: float, expected: float) -> None:
    change = board().observe("aws", obs(), T0)
    assert change is not None
    assert expected == change.notice.seconds_left(T0 + timedelta(seconds=now_s))


def test_notice_without_deadline_has_no_seconds_left() -> None:
    change = board().observe("nvml", obs(kind=Kind.GPU_FAULT, deadline_s=None), T0)
    assert change is not None
    assert (None, None) == (change.notice.seconds_left(T0), change.notice.to_json(T0)["deadline"])


def test_notice_json_round_trip_is_lossless() -> None:
    change = board().observe("aws", obs(detail={"action": "terminate"}, drill=True), T0)
    assert change is not None
    assert change.notice == Notice.from_json(change.notice.to_json(T0))


def test_event_json_round_trip_with_schema_version() -> None:
    change = board().observe("aws", obs(), T0)
    assert change is not None
    event = Event(seq=7, type=EventType.NOTICE, time=T0, notice=change.notice)
    doc = event.to_json()
    assert (1, "notice", 7) == (doc["schema"], doc["type"], doc["seq"])
    assert event == Event.from_json(doc)


def test_unknown_fields_are_ignored_on_decode() -> None:
    change = board().observe("aws", obs(), T0)
    assert change is not None
    doc = {**change.notice.to_json(T0), "future_field": [1, 2]}
    assert change.notice == Notice.from_json(doc)


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        (
            {"schema": 2, "seq": 1, "type": "notice", "time": "2026-01-01T00:00:00Z"},
            "unsupported event schema",
        ),
        ({"schema": 1, "seq": -1, "type": "notice", "time": "2026-01-01T00:00:00Z"}, "non-negative"),
        ({"schema": 1, "seq": 1, "type": "bogus", "time": "2026-01-01T00:00:00Z"}, "invalid value"),
        ({"schema": 1, "seq": 1, "type": "notice"}, "missing the field 'time'"),
        ([], "must be a JSON object"),
    ],
)
def test_malformed_events_are_rejected_with_a_specific_message(doc: object, message: str) -> None:
    with pytest.raises(NoticeError, match=message):
        Event.from_json(doc)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2017-09-18T08:22:00Z", datetime(2017, 9, 18, 8, 22, tzinfo=timezone.utc)),
        ("2017-09-18T10:22:00+02:00", datetime(2017, 9, 18, 8, 22, tzinfo=timezone.utc)),
        ("2017-09-18T08:22:00.5z", datetime(2017, 9, 18, 8, 22, 0, 500000, tzinfo=timezone.utc)),
    ],
)
def test_parse_time_accepts_rfc3339_variants(text: str, expected: datetime) -> None:
    assert expected == parse_time(text)


@pytest.mark.parametrize("text", ["", "yesterday", "2017-09-18T08:22:00"])
def test_parse_time_rejects_zoneless_or_garbage(text: str) -> None:
    with pytest.raises(NoticeError):
        parse_time(text)


def test_format_time_is_utc_with_z() -> None:
    assert "2026-12-02T12:00:00.000Z" == format_time(T0)
