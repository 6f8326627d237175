"""Owned background tasks: every task the agent or one of its parts starts is tracked by one :class:`TaskSet`
until it ends, and closing the set stops what is left within a bound."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

import structlog

log = structlog.get_logger("preemptd.tasks")


class TaskSet:
    """Owns background tasks: each is tracked until done, and :meth:`close` cancels and awaits the rest."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closed = False

    def __len__(self) -> int:
        return len(self._tasks)

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any] | None:
        if self._closed:
            coro.close()
            return None
        task = asyncio.get_running_loop().create_task(coro, name=f"{self._name}:{name}")
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            exc = task.exception()
            log.error("action_task_failed", task=task.get_name(), error=f"{type(exc).__name__}: {exc}")

    async def close(self, timeout: float) -> None:
        """Stop accepting, let running tasks finish for up to ``timeout`` seconds, then cancel the rest."""
        self._closed = True
        if not self._tasks:
            return
        pending = set(self._tasks)
        _, still = await asyncio.wait(pending, timeout=timeout)
        for task in still:
            task.cancel(f"{self._name} stopping")
        if still:
            await asyncio.wait(still, timeout=timeout)

    async def drain(self) -> None:
        """Wait until every task spawned so far (and any they spawn) has finished. For tests."""
        while self._tasks:
            await asyncio.wait(set(self._tasks))
