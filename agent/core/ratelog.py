"""Warnings a client can cause, bounded (agent/service/clientlog.py applies them to the socket's requests,
the RAM tier to its refusals): each text field cut to a bounded length, and past a burst each kind of warning
logged at most once per interval with the number left out."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

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
        """Log ``event`` as a warning unless its budget is spent; returns whether it was logged."""
        return self.note("warning", event, **fields)

    def note(self, level: str, event: str, **fields: Any) -> bool:
        """Log ``event`` at ``level`` unless its budget is spent; returns whether it was logged."""
        now = self._clock()
        tokens, at, suppressed = self._budget.get(event, (float(self._burst), now, 0))
        tokens = min(float(self._burst), tokens + (now - at) * self._rate)
        if tokens < 1.0:
            self._budget[event] = (tokens, now, suppressed + 1)
            return False
        self._budget[event] = (tokens - 1.0, now, 0)
        extra = {"suppressed": suppressed} if suppressed else {}
        getattr(self._log, level)(event, **{k: bounded(v) for k, v in fields.items()}, **extra)
        return True
