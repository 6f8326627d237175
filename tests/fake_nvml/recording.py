"""A Sink that records what a source reports, for unit tests of the GPU and host monitors without an agent.

It applies ``replace``/``observe``/``clear`` to a real :class:`~agent.core.notice.NoticeBoard`, so the events it
records are the ones the agent would broadcast. Waiting is by condition with a deadline, never by sleeping.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from agent.core.board import Change, NoticeBoard
from agent.core.notice import EventType, Observation, utcnow


class RecordingSink:
    def __init__(self, source: str) -> None:
        self.source = source
        self.board = NoticeBoard()
        self.changes: list[Change] = []
        self.health: str = "starting"
        self.detail: Mapping[str, Any] = {}
        self.errors: list[str] = []
        self.disabled: str | None = None
        self.replaces = 0
        self._changed = asyncio.Event()

    # -- the Sink protocol -----------------------------------------------------------------------------

    def replace(self, observations: Iterable[Observation]) -> None:
        self.replaces += 1
        self._record(self.board.replace_source(self.source, list(observations), utcnow()))

    def observe(self, obs: Observation) -> None:
        change = self.board.observe(self.source, obs, utcnow())
        self._record([change] if change else [])

    def clear(self, key: str, reason: str | None = None) -> None:
        change = self.board.clear(self.source, key, utcnow(), reason)
        self._record([change] if change else [])

    def ok(self, **detail: Any) -> None:
        self.health, self.detail = "ok", detail
        self._changed.set()

    def error(self, message: str, **fields: Any) -> None:
        self.health = "degraded"
        self.errors.append(message)
        self._changed.set()

    def identify(self, cloud: str, instance: Mapping[str, Any]) -> None:
        self._changed.set()

    def disable(self, why: str) -> None:
        self.health, self.disabled = "disabled", why
        self._changed.set()

    # -- for tests -------------------------------------------------------------------------------------

    def _record(self, changes: list[Change]) -> None:
        self.changes.extend(changes)
        self._changed.set()

    def active(self) -> dict[str, Any]:
        """Active notices by key."""
        return {n.key: n for n in self.board.active()}

    def events(self, key: str) -> list[EventType]:
        return [c.type for c in self.changes if c.notice.key == key]

    async def wait_for(self, predicate: Callable[[], bool], timeout: float = 10.0, what: str = "") -> None:
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while not predicate():
            left = end - loop.time()
            if left <= 0:
                raise AssertionError(
                    f"timed out waiting for {what or 'a condition'}; active={sorted(self.active())}, "
                    f"health={self.health}, disabled={self.disabled!r}, errors={self.errors[-3:]}"
                )
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), left)
            except asyncio.TimeoutError:
                continue

    async def wait_active(self, key: str, timeout: float = 10.0) -> Any:
        await self.wait_for(lambda: key in self.active(), timeout, f"{key} to be active")
        return self.active()[key]

    async def wait_cleared(self, key: str, timeout: float = 10.0) -> None:
        await self.wait_for(
            lambda: key not in self.active() and EventType.CLEARED in self.events(key),
            timeout,
            f"{key} to clear",
        )
