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
# Seconds the agent adds to a date (a deadline plus a grace, now plus a notice window or a lifetime): a
# timedelta overflows long before a float does (at 999,999,999 days), so 1e308 would fail a task at run time
# rather than the file at load. Each such key has a ceiling instead of FINITE.
DAY_S = 86400.0
YEAR_S = 365 * DAY_S
SecondsUpToADay = Annotated[
    float, Meta(ge=0, le=DAY_S, description="a number of seconds from 0 to 86400 (a day)")
]
SecondsUpToAYear = Annotated[
    float,
    Meta(
        ge=MIN_INTERVAL_S,
        le=YEAR_S,
        description=f"a number of seconds from {MIN_INTERVAL_S} to {YEAR_S:.0f} (a year)",
    ),
]
# A poll of a notice that comes with minutes of lead time (AWS rebalance, Auto Scaling lifecycle), or days
# (scheduled maintenance): slower than the termination path, but never so slow the notice loses its lead.
MINUTE_S = 60.0
HOUR_S = 3600.0
SecondsUpToAMinute = Annotated[
    float,
    Meta(
        ge=MIN_INTERVAL_S,
        le=MINUTE_S,
        description=f"a number of seconds from {MIN_INTERVAL_S} to {MINUTE_S:.0f} (a minute)",
    ),
]
SecondsUpToAnHour = Annotated[
    float,
    Meta(
        ge=MIN_INTERVAL_S,
        le=HOUR_S,
        description=f"a number of seconds from {MIN_INTERVAL_S} to {HOUR_S:.0f} (an hour)",
    ),
]
AtLeastOne = Annotated[int, Meta(ge=1)]
HttpUrl = Annotated[str, Url()]

NoticeKindName = Literal[
    "termination", "rebalance", "maintenance", "gpu_fault", "gpu_degraded", "host_degraded"
]
SeverityName = Literal["info", "warning", "critical"]
