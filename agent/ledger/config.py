"""The ``[ledger]`` and ``[cost]`` tables: where the preemption cost ledger lives and how long it keeps facts,
and the prices the report turns GPU-hours into money with (docs/ledger.md)."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Annotated, Any

from msgspec import Meta

from agent.config.loader import read_toml
from agent.core.errors import ConfigError

Days = Annotated[float, Meta(gt=0, le=36500, description="a number of days > 0")]
Seconds = Annotated[float, Meta(gt=0, le=1e9, description="a number of seconds > 0")]
Price = Annotated[float, Meta(ge=0, le=1e9, description="a price >= 0")]


@dataclass(frozen=True)
class LedgerConfig:
    """``[ledger]``: the SQLite file of notices and client reports behind ``preemptd report``."""

    enabled: bool = True
    # The database; default ``<state_dir>/ledger.sqlite``.
    path: Path | None = None
    # Facts older than this are deleted (at start and every hour).
    retention_days: Days = 90.0
    # A job counts as on this host at a notice's deadline when it sent a report within this long before it
    # (longer than any checkpoint interval: jobs do not say when they end).
    active_s: Seconds = 86400.0
    # Notice kinds that take the host away (as the advisor's ``interrupting_kinds``).
    interrupting_kinds: tuple[str, ...] = ("termination", "maintenance")


@dataclass(frozen=True)
class CostConfig:
    """``[cost]``: prices per GPU-hour and for checkpoint storage; unset prices are reported as missing."""

    spot_per_gpu_hour: Price | None = None
    # What the same GPU costs on demand or reserved: the price spot is compared with.
    on_demand_per_gpu_hour: Price | None = None
    storage_per_gb_month: Price | None = None
    # Object-store requests, per 1000 (one request counted per rank's finished save).
    per_1000_requests: Price | None = None
    # How long a checkpoint is kept in storage, for its storage cost.
    keep_days: Days = 7.0
    # A TOML file with these keys (at its top level or under [cost]); keys set here win over it.
    file: Path | None = None

    def merged(self) -> CostConfig:
        """These prices with the gaps filled from ``file``; ConfigError naming the file when it is unusable."""
        if self.file is None:
            return self
        return prices_from_file(self.file, base=self)


_PRICE_KEYS = ("spot_per_gpu_hour", "on_demand_per_gpu_hour", "storage_per_gb_month", "per_1000_requests")


def prices_from_file(path: Path, base: CostConfig | None = None) -> CostConfig:
    """The ``[cost]`` keys of a TOML file (top level or a ``[cost]`` table) over ``base``'s unset ones."""
    base = base or CostConfig()
    doc = read_toml(path)  # ConfigError naming the file when it is missing, unreadable or not TOML
    table: Any = doc.get("cost", doc)
    if not isinstance(table, dict):
        raise ConfigError(f"{path}: 'cost' must be a table of prices")
    known = {f.name for f in fields(CostConfig)} - {"file"}
    unknown = sorted(set(table) - known)
    if unknown:
        raise ConfigError(f"{path}: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    values: dict[str, Any] = {}
    for key, value in table.items():
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not math.isfinite(value)
            or value < 0
        ):
            raise ConfigError(f"{path}: key {key!r}: expected a number >= 0, got {value!r}")
        if key == "keep_days" and value <= 0:
            raise ConfigError(f"{path}: key 'keep_days': expected a number of days > 0, got {value!r}")
        current = getattr(base, key)
        if key in _PRICE_KEYS and current is not None:
            continue  # set in the configuration itself: it wins
        values[key] = float(value)
    return replace(base, **values)
