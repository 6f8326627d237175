"""Client mistakes in the log: bounded in size and rate-limited, as warnings without tracebacks.

A client that sends garbage, a huge body or a flood of bad reports must not be able to fill the journal:
each warning's text fields are cut to a bounded length, and past a burst each kind of warning is logged at
most once per interval with the number left out. The standard library's records for requests aiohttp could
not parse (logged by it as errors with a traceback) are turned into the same bounded warning.
"""

from __future__ import annotations

import logging
import time
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
