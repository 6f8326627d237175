"""The ``[ram_tier]`` table: where this host's RAM tier lives and how much of the memory it may hold."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from msgspec import Meta

from agent.config import NonNegative
from agent.core.errors import ConfigError

Fraction = Annotated[float, Meta(gt=0, le=1, description="a fraction above 0 and at most 1")]
Bytes = Annotated[int, Meta(ge=0, description="a number of bytes, 0 or more")]
Seconds = Annotated[float, Meta(gt=0, le=7 * 24 * 3600.0, description="seconds, above 0 and at most a week")]
Timeout = Annotated[
    float, Meta(ge=0, le=7 * 24 * 3600.0, description="seconds, 0 (scaled to the step) to a week")
]
Count = Annotated[int, Meta(ge=1, le=1_000_000, description="a whole number from 1 to 1000000")]
Workers = Annotated[int, Meta(ge=1, le=64, description="a whole number from 1 to 64")]


@dataclass(frozen=True)
class RamTierConfig:
    # Off until the evacuation's end-to-end tests pass everywhere (issue 24): an operator turns it on.
    enabled: bool = False
    # A tmpfs directory that outlives the training processes but not the host; the agent owns it.
    path: Path = Path("/dev/shm/preemptd")
    # The most the tier may hold; 0: cap_fraction of the memory available when the agent starts.
    cap_bytes: Bytes = 0
    cap_fraction: Fraction = 0.25
    # How fast a complete step is copied to its durable root after the window (MB/s; 0: no limit).
    drain_rate_mb_s: NonNegative = 200.0
    # A reservation that is neither committed nor released counts against the cap this long.
    reservation_ttl_s: Seconds = 600.0
    # One user's live reservations at most (429 beyond): a flood of them cannot grow the books without bound.
    max_reservations_per_uid: Count = 256
    # How often what the jobs' directories hold is measured (and also before each reservation): bytes written
    # past a reservation count against the cap, and are evicted when the tier is over it.
    usage_interval_s: Seconds = 5.0
    # The longest one drain may run before it is killed and reported failed (the step stays in RAM); 0: scaled
    # to the step's bytes (docs/ram-tier.md, "Drain to durable storage").
    drain_timeout_s: Timeout = 0.0
    # Drains of different jobs that run at once (one job's drains run one at a time).
    drain_concurrency: Workers = 2

    def __post_init__(self) -> None:
        if not self.path.is_absolute():
            raise ConfigError(
                f"ram_tier.path must be an absolute path (a directory on tmpfs such as /dev/shm/preemptd), "
                f"got {str(self.path)!r}"
            )
