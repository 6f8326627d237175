"""The value types of configuration keys, with the ranges the loader checks (msgspec ``Meta``, :class:`Url`,
:class:`ZeroOr`): every section, cloud and plug-in table uses them, so the same key means the same thing
and fails with the same words everywhere."""

from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta

from agent.config.loader import FINITE, Url, ZeroOr

# Ranges checked by msgspec (a queue of 0 is unbounded, ...).
# Every interval, timeout and backoff: anything the agent waits on or repeats at. A heartbeat or a poll of
# 1e-9 s keeps a core busy, so each has a floor (tests and plug-in tables use the same types).
MIN_INTERVAL_S = 0.1
Seconds = Annotated[
    float, Meta(ge=MIN_INTERVAL_S, le=FINITE, description=f"a finite number of seconds >= {MIN_INTERVAL_S}")
]
# An interval where 0 turns the repetition off.
SecondsOrOff = Annotated[float, ZeroOr(MIN_INTERVAL_S)]
NonNegative = Annotated[float, Meta(ge=0, le=FINITE)]
AtLeastOne = Annotated[int, Meta(ge=1)]
HttpUrl = Annotated[str, Url()]

NoticeKindName = Literal[
    "termination", "rebalance", "maintenance", "gpu_fault", "gpu_degraded", "host_degraded"
]
SeverityName = Literal["info", "warning", "critical"]
