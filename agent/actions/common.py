"""Pieces every action shares: which events a rule applies to, owned background tasks, a bounded record."""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable, Coroutine, Iterable, Mapping
from typing import Any

import structlog

from agent.notice import Event, EventType, Notice, Severity, format_time, utcnow

log = structlog.get_logger("preemptd.actions")

# Config trigger names for the event types that carry one notice.
TRIGGERS: Mapping[EventType, str] = {
    EventType.NOTICE: "notice",
    EventType.UPDATE: "update",
    EventType.CLEARED: "cleared",
    EventType.READY: "ready",
}


def applies(notice: Notice | None, kinds: Iterable[str], min_severity: str, drills: bool) -> bool:
    """Whether a rule with these filters applies to ``notice`` (an empty ``kinds`` means every kind)."""
    if notice is None:
        return False
    wanted = tuple(kinds)
    if wanted and notice.kind.value not in wanted:
        return False
    if notice.severity.rank < Severity(min_severity).rank:
        return False
    return drills or not notice.drill


def trigger_of(event: Event) -> str | None:
    return TRIGGERS.get(event.type)


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


class Recent:
    """The last ``size`` records of one kind of action, newest last, for ``/v1/status``."""

    def __init__(self, size: int) -> None:
        self._items: collections.deque[dict[str, Any]] = collections.deque(maxlen=max(1, size))

    def add(self, record: dict[str, Any]) -> None:
        self._items.append(record)

    def to_json(self) -> list[dict[str, Any]]:
        return list(self._items)


def record_outcome(
    recent: Recent,
    count: Callable[[str], None],
    context: Mapping[str, Any],
    outcome: str,
    started: float,
    event_ok: str,
    event_prefix: str,
    **fields: Any,
) -> None:
    """Keep one finished action (hook run, webhook delivery) in ``recent``, count it and log it: ``event_ok``
    for success, ``event_prefix + outcome`` as a warning otherwise. Fields that are None are left out."""
    record = {
        "at": format_time(utcnow()),
        **context,
        "outcome": outcome,
        "duration_s": round(time.monotonic() - started, 3),
        **{k: v for k, v in fields.items() if v is not None},
    }
    recent.add(record)
    count(outcome)
    logged = {k: v for k, v in record.items() if k != "at"}
    if outcome == "ok":
        log.info(event_ok, **logged)
    else:
        log.warning(event_prefix + outcome, **logged)
