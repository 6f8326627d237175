"""``GET /healthz`` and ``GET /readyz`` on the metrics listener, for a kubelet's probes (or any load
balancer's): both answer from the event loop at once, with a short JSON body, and log nothing per request
(a probe every few seconds must not fill the journal; a stall is logged once, by the watchdog).

- ``/readyz``: 200 once the configuration and state are loaded, the sources started, the API socket served
  and every component started; 503 otherwise (starting, stopping), with ``why``.
- ``/healthz``: 200 while the event loop keeps time: a watchdog task ticks every ``period_s`` and the
  answer is 503 when its last tick is older than ``stall_s``, or for ``stall_s`` after a tick that ran more
  than ``stall_s`` late (a stall that just ended), or when the task is gone. A loop wedged outright (a blocking call, a busy loop) runs no
  handler at all, so the request is never answered: the probe's own ``timeoutSeconds`` is then the signal,
  and the kubelet restarts the container after ``failureThreshold`` of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Mapping
from typing import Any

import structlog
from aiohttp import web

log = structlog.get_logger("preemptd.health")

NO_STORE = {"Cache-Control": "no-store"}


class LoopWatch:
    """The event loop's watchdog: a task that wakes every ``period_s`` and records when it ran, and how late."""

    def __init__(self, stall_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.stall_s = stall_s
        self.period_s = min(1.0, stall_s / 4)
        self._clock = clock
        self.last = clock()
        self.late_s = 0.0
        self.stalls = 0
        self._stalled: tuple[float, float] | None = None  # (how late, when) of the last late tick
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self.last, self.late_s, self._stalled = self._clock(), 0.0, None
        self._task = asyncio.get_running_loop().create_task(self._run(), name="loop-watch")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run(self) -> None:
        while True:
            due = self._clock() + self.period_s
            await asyncio.sleep(self.period_s)
            now = self._clock()
            self.last, self.late_s = now, max(0.0, now - due)
            if self.late_s > self.stall_s:
                self.stalls += 1
                self._stalled = (self.late_s, now)
                log.warning("event_loop_stalled", stalled_s=round(self.late_s, 3), bound_s=self.stall_s)

    def problem(self) -> str | None:
        """Why the loop is not healthy, or None."""
        if self._task is None or self._task.done():
            return "the event loop's watchdog task is not running"
        now = self._clock()
        if now - self.last > self.stall_s:
            return (
                f"the event loop's watchdog last ran {now - self.last:.1f} s ago (bound {self.stall_s:g} s)"
            )
        if self._stalled is not None and now - self._stalled[1] < self.stall_s:
            late, at = self._stalled
            return f"the event loop stalled for {late:.1f} s, {now - at:.1f} s ago (bound {self.stall_s:g} s)"
        return None

    def to_json(self) -> dict[str, Any]:
        return {
            "tick_age_s": round(self._clock() - self.last, 3),
            "late_s": round(self.late_s, 3),
            "stall_s": self.stall_s,
            "stalls": self.stalls,
        }


class Probes:
    """The two handlers: ``readiness`` maps each check to None (passes) or why it does not."""

    def __init__(self, watch: LoopWatch, readiness: Callable[[], Mapping[str, str | None]]) -> None:
        self.watch = watch
        self._readiness = readiness

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/healthz", self.healthz)
        app.router.add_get("/readyz", self.readyz)

    async def healthz(self, request: web.Request) -> web.Response:
        problem = self.watch.problem()
        body: dict[str, Any] = {"healthy": problem is None, "loop": self.watch.to_json()}
        if problem is not None:
            body["why"] = problem
        return web.json_response(body, status=200 if problem is None else 503, headers=NO_STORE)

    async def readyz(self, request: web.Request) -> web.Response:
        checks = self._readiness()
        why = [f"{name}: {text}" for name, text in checks.items() if text]
        body: dict[str, Any] = {"ready": not why, "checks": {n: t or "ok" for n, t in checks.items()}}
        if why:
            body["why"] = why
        return web.json_response(body, status=503 if why else 200, headers=NO_STORE)
