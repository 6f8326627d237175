"""The instance identity a cloud source reads beside its notices: retried on its own slower schedule with its
own backoff, its failures reported apart (status field ``identity``, log event ``identity_read_failed`` with
the HTTP status), so that they never delay a notice read nor make the source ``degraded``.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import structlog

from agent.core.notice import format_time, utcnow
from agent.sources.base import Sink
from agent.sources.cloud_http import Backoff, CloudError

log = structlog.get_logger("preemptd.sources.identity")

# The retry schedule, in units of the source's own error backoff cap: the first retry comes when the notice
# poll's backoff would end, and the wait doubles up to this many caps (a minute with the default 5 s).
RETRY_MAX_FACTOR = 12.0
# A failure that repeats the last one is logged again after this long at the earliest.
RELOG_S = 600.0


class IdentityReader:
    """Reads the identity once, retrying until it answers. ``read`` raises CloudError on a failure. The
    source runs :meth:`run` beside its notice poll, never inside it (``run_all``, or :meth:`start` and
    :meth:`stop` around a poll loop), and shows :meth:`status` under ``identity`` in its status."""

    def __init__(
        self,
        source: str,
        cloud: str,
        read: Callable[[], Awaitable[Mapping[str, str]]],
        backoff_max_s: float,
        rng: Callable[[], float] = random.random,
    ) -> None:
        self.source = source
        self.cloud = cloud
        self._read = read
        base = max(backoff_max_s, 0.1)
        self._backoff = Backoff(base, base * RETRY_MAX_FACTOR, rng)
        self.identity: dict[str, str] = {}
        self.error: str | None = None
        self.http_status: int | None = None
        self.failures = 0
        self._last_error_at: str | None = None
        self._next_try: float | None = None  # monotonic
        self._logged: tuple[str | None, float] = (None, 0.0)
        # Set once the first read has answered or failed: a source that needs the identity to read its
        # notices right (Azure without azure.vm_name) waits for this, and only this, before its first poll.
        self.attempted = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def status(self) -> dict[str, Any]:
        state = "ok" if self.identity else ("failing" if self.failures else "pending")
        doc: dict[str, Any] = {
            "state": state,
            "failures": self.failures,
            "last_error": self.error,
            "last_error_status": self.http_status,
            "last_error_at": self._last_error_at,
        }
        if not self.identity and self._next_try is not None:
            doc["next_try_in_s"] = round(max(0.0, self._next_try - time.monotonic()), 1)
        return doc

    def start(self, sink: Sink) -> None:
        """Run :meth:`run` as a task this reader owns, for a source whose own ``run`` is its poll loop; the
        source awaits :meth:`stop` when that loop ends."""
        if self._task is None:
            self._task = asyncio.ensure_future(self.run(sink))

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def run(self, sink: Sink) -> None:
        """Read until the identity is known, then hand it to ``sink.identify`` and return."""
        while not self.identity:
            try:
                identity = dict(await self._read())
            except Exception as exc:
                # Anything but a CloudError is a bug in the read; it too must not end the retries.
                error = exc if isinstance(exc, CloudError) else CloudError(f"{type(exc).__name__}: {exc}")
                delay = self._failed(error, exc_info=error is not exc)
                self.attempted.set()
                await asyncio.sleep(delay)
                continue
            if self.failures:
                log.info("identity_read", source=self.source, cloud=self.cloud, after_failures=self.failures)
            self.identity = identity
            self.error = None
            self._next_try = None
            self.attempted.set()
            sink.identify(self.cloud, identity)

    def _failed(self, exc: CloudError, exc_info: bool = False) -> float:
        self.failures += 1
        self.error = str(exc)
        self.http_status = exc.status
        self._last_error_at = format_time(utcnow())
        delay = self._backoff.next_delay(exc.retry_after_s)
        self._next_try = time.monotonic() + delay
        # A metadata service that never serves the identity (a mock, a proxy that allows only the notice
        # path) fails every retry: log the first failure, each new one, and a repeat at most every 10 min.
        last, at = self._logged
        now = time.monotonic()
        if self.error != last or now - at >= RELOG_S:
            log.warning(
                "identity_read_failed",
                source=self.source,
                cloud=self.cloud,
                error=self.error,
                status=exc.status,
                failures=self.failures,
                retry_in_s=round(delay, 1),
                exc_info=exc_info,
            )
            self._logged = (self.error, now)
        return delay
