"""What clients make the agent log, bounded: no client can make the log grow without bound.

A client that sends garbage, a huge body, a body that stops short or a flood of bad reports must not be able
to fill the journal: each warning's text fields are cut to a bounded length, and past a burst each kind of
warning is logged at most once per interval with the number left out. The standard library's records for
requests aiohttp could not parse (logged by it as errors with a traceback) are turned into the same bounded
warning. Event-stream clients that come and go are one line per connection at debug and, at info, one line
per interval with the counts (:class:`StreamTally`), so a client reconnecting in a loop adds nothing at
info but that line.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

from aiohttp.http_exceptions import HttpProcessingError

MAX_FIELD_CHARS = 240
BURST = 10
INTERVAL_S = 60.0


def bounded(value: Any, limit: int = MAX_FIELD_CHARS) -> Any:
    """``value`` for a log record: text cut to ``limit`` characters (with the length it had), containers
    cut to a few items; numbers and booleans as they are."""
    if value is None or isinstance(value, (bool, int, float)):
        return value
    if isinstance(value, Mapping):
        items = list(value.items())[:16]
        return {bounded(k, 64): bounded(v, limit) for k, v in items}
    if isinstance(value, (list, tuple)):
        return [bounded(v, limit) for v in list(value)[:16]]
    text = value if isinstance(value, str) else repr(value)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}… ({len(text)} characters)"


class ClientMistakes:
    """Rate-limited warnings, one budget per event name: ``BURST`` at once, refilled over ``INTERVAL_S``;
    the first warning logged after some were left out carries ``suppressed``, their number."""

    def __init__(
        self,
        log: Any,
        burst: int = BURST,
        interval_s: float = INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._log = log
        self._burst = burst
        self._rate = burst / interval_s
        self._clock = clock
        self._budget: dict[str, tuple[float, float, int]] = {}  # event → (tokens, at, suppressed)

    def warning(self, event: str, **fields: Any) -> bool:
        """Log ``event`` unless its budget is spent; returns whether it was logged."""
        now = self._clock()
        tokens, at, suppressed = self._budget.get(event, (float(self._burst), now, 0))
        tokens = min(float(self._burst), tokens + (now - at) * self._rate)
        if tokens < 1.0:
            self._budget[event] = (tokens, now, suppressed + 1)
            return False
        self._budget[event] = (tokens - 1.0, now, 0)
        extra = {"suppressed": suppressed} if suppressed else {}
        self._log.warning(event, **{k: bounded(v) for k, v in fields.items()}, **extra)
        return True


class BadRequestFilter(logging.Filter):
    """On aiohttp's server logger: a request it could not parse (bad request line, header too long, bad
    chunking) is a client's mistake, reported through :class:`ClientMistakes` instead of as an error with a
    traceback. Every other record passes unchanged."""

    def __init__(self, mistakes: ClientMistakes) -> None:
        super().__init__()
        self._mistakes = mistakes

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if not isinstance(exc, HttpProcessingError):
            return True
        self._mistakes.warning(
            "bad_request", status=exc.code, error=exc.message or type(exc).__name__, kind=type(exc).__name__
        )
        return False


class StreamTally:
    """Event-stream connections and disconnections: each one a ``client_connected`` / ``client_disconnected``
    line at debug, and at info one ``event_streams`` line per ``interval_s`` in which any came or went, with
    the counts, the reasons streams ended, the peak and the number open when it is written. The line is
    written ``interval_s`` after the first change of the interval (a timer on the loop, not a task), and at
    :meth:`close` for what is left."""

    def __init__(self, log: Any, open_now: Callable[[], int], interval_s: float = INTERVAL_S) -> None:
        self._log = log
        self._open_now = open_now
        self.interval_s = interval_s
        self._connected = 0
        self._disconnected = 0
        self._peak = 0
        self._reasons: Counter[str] = Counter()
        self._timer: asyncio.TimerHandle | None = None

    def connected(self, **fields: Any) -> None:
        self._log.debug("client_connected", **fields)
        self._connected += 1
        self._peak = max(self._peak, self._open_now())
        self._arm()

    def disconnected(self, reason: str, **fields: Any) -> None:
        self._log.debug("client_disconnected", reason=reason, **fields)
        self._disconnected += 1
        # The reasons are the agent's own words (a few kinds); the cap only keeps the line short regardless.
        if reason in self._reasons or len(self._reasons) < 8:
            self._reasons[reason] += 1
        self._arm()

    def _arm(self) -> None:
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.interval_s, self.flush)

    def flush(self) -> None:
        """Write the interval's line (if anything came or went) and start a new interval."""
        self._timer = None
        if not self._connected and not self._disconnected:
            return
        self._log.info(
            "event_streams",
            connected=self._connected,
            disconnected=self._disconnected,
            reasons=dict(self._reasons),
            peak=self._peak,
            open=self._open_now(),
            interval_s=self.interval_s,
        )
        self._connected = self._disconnected = self._peak = 0
        self._reasons.clear()

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self.flush()
