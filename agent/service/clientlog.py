"""What clients make the agent log, bounded: no client can make the log grow without bound.

A client that sends garbage, a huge body, a body that stops short or a flood of bad reports must not be able
to fill the journal: each warning's text fields are cut to a bounded length, and past a burst each kind of
warning is logged at most once per interval with the number left out. The standard library's records for
requests aiohttp could not parse (logged by it as errors with a traceback) are turned into the same bounded
warning. Event-stream clients that come and go are one line per connection at debug and, at info, one line
per interval with the counts (:class:`StreamTally`), so a client reconnecting in a loop adds nothing at
info but that line; so are accepted reports (:class:`Tally`, one ``reports_received`` line).
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable
from typing import Any

from aiohttp.http_exceptions import HttpProcessingError

from agent.core.ratelog import BURST, INTERVAL_S, MAX_FIELD_CHARS, ClientMistakes, Tally, bounded

__all__ = [
    "BURST",
    "INTERVAL_S",
    "MAX_FIELD_CHARS",
    "BadRequestFilter",
    "ClientMistakes",
    "StreamTally",
    "Tally",
    "bounded",
]


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
