"""Expiry and drills (agent/core/expiry.py) on a real board, with the clock and settings given."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

import structlog
from structlog.testing import capture_logs

from agent.core.board import Change, NoticeBoard
from agent.core.expiry import DRILL_SOURCE, Drills, Expiry
from agent.core.notice import EventType, Kind, Notice, Observation

T0 = datetime(2026, 12, 3, 12, 0, 0, tzinfo=timezone.utc)


@dataclass(frozen=True)
class Settings:
    expire_grace_s: float = 30.0
    drill_linger_s: float = 10.0


def notice_of(board: NoticeBoard, source: str, obs: Observation) -> Notice:
    change = board.observe(source, obs, T0)
    assert change is not None
    return change.notice


def past(key: str, seconds_ago: float, drill: bool = False) -> Observation:
    return Observation(
        key, Kind.TERMINATION, "spot", deadline=T0 - timedelta(seconds=seconds_ago), drill=drill
    )


def test_grace_is_the_drill_linger_for_a_drill_and_the_expire_grace_otherwise() -> None:
    board = NoticeBoard()
    expiry = Expiry(board, lambda: T0, Settings, lambda source: False)
    drill = notice_of(board, DRILL_SOURCE, past("d", 0, drill=True))
    spot = notice_of(board, "aws", past("s", 0))
    assert (timedelta(seconds=10), timedelta(seconds=30)) == (expiry.grace_for(drill), expiry.grace_for(spot))


def test_a_notice_of_a_source_that_speaks_for_it_never_expires_here() -> None:
    board = NoticeBoard()
    expiry = Expiry(board, lambda: T0, Settings, lambda source: source == "aws")
    assert expiry.grace_for(notice_of(board, "aws", past("s", 3600))) is None


def test_the_settings_are_read_on_every_pass() -> None:
    """A reload that changes expire_grace_s applies to the notices already on the board."""
    board = NoticeBoard()
    settings = [Settings()]
    expiry = Expiry(board, lambda: T0, lambda: settings[0], lambda source: False)
    spot = notice_of(board, "aws", past("s", 0))
    settings[0] = Settings(expire_grace_s=5.0)
    assert timedelta(seconds=5) == expiry.grace_for(spot)


async def test_a_board_change_wakes_the_loop_and_a_passed_notice_is_cleared() -> None:
    """The loop waits with nothing due; a notice whose deadline passed more than its grace ago arrives; the
    change wakes the loop and it clears the notice ("deadline passed")."""
    board = NoticeBoard()
    expiry = Expiry(board, lambda: T0, Settings, lambda source: False)
    cleared: list[Change] = []
    done = asyncio.Event()

    def listen(changes: list[Change], now: datetime) -> None:
        cleared.extend(c for c in changes if c.type is EventType.CLEARED)
        if cleared:
            done.set()

    board.on_change(expiry.wake)
    board.on_change(listen)
    task = asyncio.create_task(expiry.run())
    try:
        await asyncio.sleep(0)  # the first pass: nothing to do, nothing due
        board.observe("aws", past("s", 60), T0)
        await asyncio.wait_for(done.wait(), timeout=10)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert [("s", "deadline passed")] == [(c.notice.key, c.notice.detail["cleared_reason"]) for c in cleared]


def test_each_drill_is_a_new_notice_with_its_own_key_and_the_deadline_asked_for() -> None:
    board = NoticeBoard()

    def inject(source: str, obs: Observation) -> Notice | None:
        board.observe(source, obs, T0)
        return next(n for n in board.active() if n.key == obs.key)

    drills = Drills("boot1", inject, lambda: T0, structlog.get_logger())
    with capture_logs() as logs:
        first = drills.drill(Kind.TERMINATION, 120, None, "drill", {"pid": 7})
        second = drills.drill(Kind.TERMINATION, 60, None, "drill", {"pid": 7})
    assert (
        ["drill-boot1-1", "drill-boot1-2"],
        [T0 + timedelta(seconds=120), T0 + timedelta(seconds=60)],
        [True, True],
        [DRILL_SOURCE, DRILL_SOURCE],
        ["drill_injected", "drill_injected"],
    ) == (
        [first.key, second.key],
        [first.deadline, second.deadline],
        [first.drill, second.drill],
        [first.source, second.source],
        [e["event"] for e in logs],
    )
