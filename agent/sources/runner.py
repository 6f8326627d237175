"""Runs the agent's sources: one owned task per source, restarted with backoff when it crashes, and the sink
each one reports through (notices onto the board, health into the health book). Also answers for the sources
as a group: their capabilities, their status, client reports handed to them, and replacing them all when the
configuration is reloaded.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Iterable, Mapping
from datetime import datetime
from typing import Any

import structlog

from agent.core.board import NoticeBoard
from agent.core.notice import Observation
from agent.core.ports import Tasks
from agent.core.reports import Report
from agent.core.source_health import HealthBook, HealthState, SourceHealth
from agent.sources.base import Source

ERROR_LOG_INTERVAL_S = 60.0


class SourceSink:
    """The Sink handed to one source (see agent.sources.base.Sink)."""

    def __init__(self, runner: SourceRunner, name: str) -> None:
        self._runner = runner
        self._name = name
        self.log = runner.log.bind(source=name)
        self._last_error: str | None = None
        self._last_logged = 0.0
        self._suppressed = 0

    # The board hands what changed to its listeners (the fan-out first): nothing to pass on here.
    def replace(self, observations: Iterable[Observation]) -> None:
        self._runner.board.replace_source(self._name, observations, self._runner.now())

    def observe(self, obs: Observation) -> None:
        self._runner.board.observe(self._name, obs, self._runner.now())

    def clear(self, key: str, reason: str | None = None) -> None:
        self._runner.board.clear(self._name, key, self._runner.now(), reason)

    def ok(self, **detail: Any) -> None:
        self._last_error = None
        self._runner.health.mark(self._name, HealthState.OK, detail=detail)

    def error(self, message: str, **fields: Any) -> None:
        # A hung or broken metadata server fails every poll: log the first failure, each new kind of
        # failure, and then at most once a minute, with a count of what was not logged.
        now = time.monotonic()
        if message != self._last_error or now - self._last_logged >= ERROR_LOG_INTERVAL_S:
            self.log.warning("source_error", error=message, repeats=self._suppressed, **fields)
            self._last_error, self._last_logged, self._suppressed = message, now, 0
        else:
            self._suppressed += 1
        self._runner.health.mark(self._name, HealthState.DEGRADED, error=message)

    def identify(self, cloud: str, instance: Mapping[str, Any]) -> None:
        self._runner.identify(cloud, instance)
        self.log.info("cloud_identified", cloud=cloud, instance=dict(instance))

    def disable(self, why: str) -> None:
        self.log.info("source_disabled", why=why)
        self._runner.health.mark(self._name, HealthState.DISABLED, detail={"why": why})


class SourceRunner:
    def __init__(
        self,
        board: NoticeBoard,
        now: Callable[[], datetime],
        health: HealthBook,
        tasks: Tasks,
        log: Any,
        identify: Callable[[str, Mapping[str, Any]], None],
    ) -> None:
        self.board = board
        self.now = now
        self.health = health
        self.tasks = tasks
        self.log = log
        self.identify = identify
        self.sources: dict[str, Source] = {}
        self._tasks: dict[str, asyncio.Task[Any]] = {}
        self.started = False  # start() ran and stop() did not since

    def start(self) -> None:
        self.started = True
        for source in self.sources.values():
            self.health.mark(source.name, HealthState.STARTING)
            task = self.tasks.spawn(self._run(source), f"source:{source.name}")
            if task is not None:
                self._tasks[source.name] = task

    async def stop(self, timeout: float) -> None:
        self.started = False
        for name, task in list(self._tasks.items()):
            await self.tasks.cancel(task, timeout=timeout)
            self._tasks.pop(name, None)

    async def replace(self, sources: Iterable[Source]) -> None:
        """A reload: stop every source, then run the new set (a source keeps no state worth carrying)."""
        await self.stop(timeout=2.0)
        self.sources = {s.name: s for s in sources}
        self.health.keep_only(self.sources)
        self.start()

    async def _run(self, source: Source) -> None:
        sink = SourceSink(self, source.name)
        delay = 1.0
        structlog.contextvars.bind_contextvars(source=source.name)
        while True:
            try:
                await source.run(sink)
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                sink.log.error("source_crashed", error=repr(exc), restart_in_s=round(delay, 2), exc_info=True)
                self.health.mark(source.name, HealthState.DEGRADED, error=f"crashed: {exc!r}")
                await asyncio.sleep(delay * random.uniform(0.8, 1.2))
                delay = min(delay * 2, 30.0)

    def capability(self, name: str) -> Any | None:
        for source in self.sources.values():
            offered = source.capabilities().get(name)
            if offered is not None:
                return offered
        return None

    def on_report(self, report: Report) -> None:
        for source in self.sources.values():
            try:
                source.on_report(report)
            except Exception as exc:
                self.log.error("report_listener_failed", source=source.name, error=repr(exc))

    def status(self, started_at: datetime) -> tuple[dict[str, Any], list[Any]]:
        """Each source's status with its health (the health fields win), and every source's GPUs."""
        sources: dict[str, Any] = {}
        gpus: list[Any] = []
        for name, source in self.sources.items():
            health = self.health.get(name) or SourceHealth(HealthState.STARTING, started_at)
            extra: Mapping[str, Any] = {}
            try:
                extra = source.status()
            except Exception as exc:
                extra = {"status_error": repr(exc)}
            # The health fields (state, since, last_error, …) are reserved: a source's extras never hide them.
            sources[name] = {**extra, **health.to_json()}
            gpus.extend(extra.get("gpus", []) or [])
        return sources, gpus
