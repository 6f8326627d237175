"""Owned background tasks, written once: every task the agent or one of its parts starts belongs to one
:class:`TaskSet` until it ends, a failure is logged, and closing the set stops what is left within a bound."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Iterator
from typing import Any

import structlog

log = structlog.get_logger("preemptd.tasks")


class TaskSet:
    """Owns background tasks: each is tracked until done, and :meth:`close` cancels and awaits the rest.

    ``failure_event`` names the log event of a task that raised (``action_task_failed`` for actions,
    ``task_failed`` for the agent's own loops)."""

    def __init__(self, name: str, failure_event: str = "action_task_failed") -> None:
        self._name = name
        self._failure_event = failure_event
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closed = False

    def __len__(self) -> int:
        return len(self._tasks)

    def __iter__(self) -> Iterator[asyncio.Task[Any]]:
        """The tasks running now (a copy: tasks may end while the caller iterates)."""
        return iter(list(self._tasks))

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any] | None:
        """Start ``coro`` as a task named ``<set>:<name>``; None (and the coroutine closed) once closing."""
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
            log.error(self._failure_event, task=task.get_name(), error=f"{type(exc).__name__}: {exc}")

    async def cancel(self, task: asyncio.Task[Any], timeout: float) -> None:
        """Cancel one task and wait for it, at most ``timeout`` seconds."""
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=timeout)
        if not done:
            log.warning("task_stuck", task=task.get_name(), waited_s=timeout)

    async def close(self, timeout: float, grace: float | None = None) -> None:
        """Stop accepting, let running tasks finish for ``grace`` seconds (default: ``timeout``; 0 for
        loops that never finish by themselves), then cancel the rest and wait up to ``timeout``."""
        self._closed = True
        if not self._tasks:
            return
        pending = set(self._tasks)
        wait_s = timeout if grace is None else grace
        still = pending
        if wait_s > 0:
            _, still = await asyncio.wait(pending, timeout=wait_s)
        for task in still:
            task.cancel(f"{self._name} stopping")
        if still:
            _, stuck = await asyncio.wait(still, timeout=timeout)
            for task in stuck if timeout > 0 else ():  # 0: cancel and move on, by design
                log.warning("task_stuck", task=task.get_name(), waited_s=timeout)

    async def drain(self) -> None:
        """Wait until every task spawned so far (and any they spawn) has finished. For tests."""
        while self._tasks:
            await asyncio.wait(set(self._tasks))


async def wait_for_any(*events: asyncio.Event, timeout: float | None = None) -> None:
    """Return when any of ``events`` is set or ``timeout`` seconds have passed (None: no limit); the waiters
    it starts are cancelled and awaited before it returns, whatever happens."""
    waiters = [asyncio.ensure_future(event.wait()) for event in events]
    try:
        await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()
        await asyncio.gather(*waiters, return_exceptions=True)
