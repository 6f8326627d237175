"""Lines a client can cause, bounded (agent/service/clientlog.py applies them to the socket's requests,
the RAM tier to its refusals and requests): each text field cut to a bounded length; past a burst each kind
of warning logged at most once per interval with the number left out (:class:`ClientMistakes`); a line per
valid request at debug and, at info, one line per interval with the counts (:class:`Tally`)."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

MAX_FIELD_CHARS = 240
BURST = 10
INTERVAL_S = 60.0
# Keys counted apart per group in one interval of a Tally; the rest are counted under OTHER.
MAX_KEYS = 16
OTHER = "other"


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


class Tally:
    """Valid requests a client may repeat at will (a report, a RAM tier reservation): the caller logs each
    at debug and counts it here; at info, one ``event`` line per ``interval_s`` in which any came, with the
    number (``total``), the counts per key of each group (``MAX_KEYS`` keys a group, the rest under
    ``OTHER``) and the sums of the amounts. The line is written ``interval_s`` after the interval's first
    count (a timer on the loop, not a task), and at :meth:`close` for what is left."""

    def __init__(self, log: Any, event: str, interval_s: float = INTERVAL_S) -> None:
        self._log = log
        self.event = event
        self.interval_s = interval_s
        self._total = 0
        self._groups: dict[str, Counter[str]] = {}
        self._sums: Counter[str] = Counter()
        self._timer: asyncio.TimerHandle | None = None

    def count(self, by: Mapping[str, str], amounts: Mapping[str, int] | None = None) -> None:
        """One request, counted under its key in each group of ``by``; ``amounts`` added to the sums."""
        self._total += 1
        for group, name in by.items():
            counts = self._groups.setdefault(group, Counter())
            key = bounded(name, 64)
            counts[key if key in counts or len(counts) < MAX_KEYS else OTHER] += 1
        self._sums.update(amounts or {})
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.interval_s, self.flush)

    def flush(self) -> None:
        """Write the interval's line (if anything was counted) and start a new interval."""
        self._timer = None
        if not self._total:
            return
        groups = {group: dict(counts) for group, counts in self._groups.items()}
        self._log.info(self.event, total=self._total, **groups, **self._sums, interval_s=self.interval_s)
        self._total = 0
        self._groups.clear()
        self._sums.clear()

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self.flush()
