"""Fault injection for the cloud simulators: what a fault request may say, and which requests a fault hits.

A fault is ``{"type": T, "count": N, "duration_s": S, "path": "/prefix"}`` where ``count`` limits it to the
next N matching requests and ``duration_s`` to a time window (neither: until removed). Types: ``latency``
(``ms``), ``hang`` (no answer until the fault is removed or ``hang_s`` passes, then the connection drops),
``5xx`` (``status``, default 500), ``429``, ``garbage`` (200 with a body of random bytes), ``oversized``
(200 with ``size`` bytes, default 4 MiB), ``reset`` (the TCP connection is reset), ``token-expiry`` (every
issued token stops working now; AWS and Alibaba).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from agent.core.errors import PreemptdError

FAULT_TYPES = ("latency", "hang", "5xx", "429", "garbage", "oversized", "reset", "token-expiry")
DEFAULT_OVERSIZED = 4 * 1024 * 1024


class SimulatorError(PreemptdError):
    """A control request is malformed (answered with 400 and this message)."""


@dataclass
class Fault:
    type: str
    count: int | None = None
    until: float | None = None  # monotonic
    path: str = ""
    status: int = 500
    ms: float = 0.0
    size: int = DEFAULT_OVERSIZED
    hang_s: float = 3600.0

    def matches(self, path: str, now: float) -> bool:
        if self.until is not None and now >= self.until:
            return False
        if self.count is not None and self.count <= 0:
            return False
        return path.startswith(self.path)

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"type": self.type, "path": self.path}
        if self.count is not None:
            doc["count_left"] = self.count
        if self.until is not None:
            doc["seconds_left"] = round(max(0.0, self.until - time.monotonic()), 3)
        if self.type == "5xx":
            doc["status"] = self.status
        if self.type == "latency":
            doc["ms"] = self.ms
        if self.type == "oversized":
            doc["size"] = self.size
        return doc


def parse_fault(doc: Any, now: float) -> Fault:
    """Validate a fault request (pure apart from ``now``)."""
    if not isinstance(doc, Mapping):
        raise SimulatorError("a fault must be a JSON object")
    kind = doc.get("type")
    if kind not in FAULT_TYPES:
        raise SimulatorError(f"unknown fault type {kind!r}; expected one of {', '.join(FAULT_TYPES)}")

    def number(name: str, default: float | None, minimum: float = 0.0) -> float | None:
        value = doc.get(name, default)
        if value is None:
            return None
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value < minimum:
            raise SimulatorError(f"fault field {name!r} must be a number >= {minimum:g}, got {value!r}")
        return float(value)

    count = number("count", None, 1)
    duration = number("duration_s", None)
    path = doc.get("path", "")
    if not isinstance(path, str):
        raise SimulatorError("fault field 'path' must be a string (a path prefix)")
    status = int(number("status", 500, 100) or 500)
    if kind == "5xx" and not 500 <= status <= 599:
        raise SimulatorError(f"a 5xx fault needs a status from 500 to 599, got {status}")
    return Fault(
        type=str(kind),
        count=int(count) if count is not None else None,
        until=now + duration if duration is not None else None,
        path=path,
        status=status,
        ms=number("ms", 200.0) or 0.0,
        size=int(number("size", DEFAULT_OVERSIZED, 1) or DEFAULT_OVERSIZED),
        hang_s=number("hang_s", 3600.0) or 3600.0,
    )
