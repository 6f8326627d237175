"""Notices that end by the clock: the expiry loop clears a notice once its deadline passed by its grace (none
while its source still speaks for it), and drills are the notices an operator asks for, which linger
``drill_linger_s`` after their deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Mapping
from datetime import datetime, timedelta
from typing import Any, Protocol

from agent.core.board import Change, NoticeBoard
from agent.core.notice import Kind, Notice, Observation, Severity

DRILL_SOURCE = "drill"
# The shortest wait between two passes: a deadline a few microseconds away must not spin the loop.
MIN_WAIT_S = 0.05


class ExpirySettings(Protocol):
    """The two graces, read on every pass (a reload may change them); ``agent.config.Config`` has both."""

    @property
    def expire_grace_s(self) -> float: ...

    @property
    def drill_linger_s(self) -> float: ...


class Expiry:
    """Clears the notices whose time is up, sleeping until the next one is due or the board changes.

    ``speaks_for(source)``: whether ``source`` runs and so clears its own notices (its notices never expire
    here). Register :meth:`wake` as a listener of the board, and run :meth:`run` as an owned task.
    """

    def __init__(
        self,
        board: NoticeBoard,
        clock: Callable[[], datetime],
        settings: Callable[[], ExpirySettings],
        speaks_for: Callable[[str], bool],
    ) -> None:
        self._board = board
        self._now = clock
        self._settings = settings
        self._speaks_for = speaks_for
        self._changed = asyncio.Event()

    def grace_for(self, notice: Notice) -> timedelta | None:
        """How long a notice outlives its deadline: none while its source still speaks for it."""
        settings = self._settings()
        if notice.drill:
            return timedelta(seconds=settings.drill_linger_s)
        if self._speaks_for(notice.source):
            return None
        return timedelta(seconds=settings.expire_grace_s)

    def wake(self, changes: list[Change], now: datetime) -> None:
        """The board changed: a new deadline may come sooner than the one waited for."""
        self._changed.set()

    async def run(self) -> None:
        while True:
            self._board.expire(self._now(), self.grace_for)
            next_at = self._board.next_expiry(self.grace_for)
            wait = None if next_at is None else max(MIN_WAIT_S, (next_at - self._now()).total_seconds())
            self._changed.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._changed.wait(), timeout=wait)


class Drills:
    """Drills: notices raised on request (``POST /v1/drill``, ``preemptd drill``), each with its own key."""

    def __init__(
        self,
        boot_id: str,
        inject: Callable[[str, Observation], Notice | None],
        clock: Callable[[], datetime],
        log: Any,
    ) -> None:
        self._boot_id = boot_id
        self._inject = inject
        self._now = clock
        self._log = log
        self._count = 0

    def drill(
        self, kind: Kind, in_s: float, severity: Severity | None, reason: str, peer: Mapping[str, Any]
    ) -> Notice:
        self._count += 1
        obs = Observation(
            key=f"drill-{self._boot_id}-{self._count}",
            kind=kind,
            reason=reason,
            deadline=self._now() + timedelta(seconds=in_s),
            severity=severity,
            detail={"requested_by": dict(peer), "in_s": in_s},
            drill=True,
        )
        notice = self._inject(DRILL_SOURCE, obs)
        assert notice is not None  # a new key always raises a notice
        self._log.info("drill_injected", notice_id=notice.id, kind=kind.value, in_s=in_s, peer=dict(peer))
        return notice
