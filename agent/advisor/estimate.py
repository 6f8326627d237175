"""Estimators over the history log: the checkpoint save time δ from client reports and the mean time M
between interruptions that lost work. Pure: callers pass the records and ``now``. (Goodput is the ledger's:
agent/ledger/tally.py, docs/ledger.md.)

:func:`observe` reads the records (history.py), judges each notice and restart by the rules of what counts
as a loss (losses.py) and estimates δ and M from what it found.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

from agent.advisor.history import Checkpoint, Run, merge_checkpoints, parse, timeline
from agent.advisor.losses import LOSS_CAUSES, Loss, coalesce, tally, unclean_restarts
from agent.advisor.stats import mad_sigma, median, rate_interval
from agent.core.errors import ConfigError

if TYPE_CHECKING:  # annotations only: `preemptd advise` must not load the config loader (msgspec)
    from agent.config import AdvisorConfig

# A checkpoint further than this many robust standard deviations from the median is reported as an outlier
# (it still counts: the median is what keeps it from moving δ).
OUTLIER_SIGMAS = 3.5


@dataclass(frozen=True)
class SaveTime:
    value_s: float | None
    source: str | None  # "reports", "config" or None
    checkpoints: int
    reports: int
    spread_s: float | None  # robust standard deviation (scaled MAD)
    outliers: int

    def to_json(self) -> dict[str, Any]:
        return {
            "value_s": _r(self.value_s),
            "source": self.source,
            "checkpoints": self.checkpoints,
            "reports": self.reports,
            "spread_s": _r(self.spread_s),
            "outliers": self.outliers,
        }


@dataclass(frozen=True)
class Mtbp:
    """M with where it came from and how sure it is."""

    value_s: float | None
    source: str | None  # "history", "prior", "prior+history" or None
    events: int
    exposure_s: float
    effective_observations: float
    range_s: tuple[float, float] | None  # credible range of M (high end may be inf)
    lower_bound_s: float | None  # what the uptime alone rules out, when there are too few events
    prior_s: float | None = None
    prior_weight: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "value_s": _r(self.value_s),
            "source": self.source,
            "events": self.events,
            "exposure_s": _r(self.exposure_s),
            "effective_observations": round(self.effective_observations, 3),
            "range_s": [_r(v) for v in self.range_s] if self.range_s else None,
            "lower_bound_s": _r(self.lower_bound_s),
            "prior_s": _r(self.prior_s),
            "prior_weight": self.prior_weight if self.prior_s is not None else None,
        }


@dataclass(frozen=True)
class Observations:
    """Everything the advisor learned from the history."""

    save: SaveTime
    emergency_save: SaveTime
    lost: Mtbp
    announced: Mtbp
    losses: tuple[Loss, ...]
    causes: Mapping[str, int]
    announced_ids: tuple[str, ...]
    runs: int
    exposure_s: float
    current_interval_s: float | None
    current_source: str | None
    drills_ignored: int = 0
    pending_notices: int = 0
    checkpoints: tuple[Checkpoint, ...] = field(default=(), repr=False)
    snapshots: Snapshots | None = None  # None: no peer snapshot reported


@dataclass(frozen=True)
class Snapshots:
    """What the peer snapshot reports say: the stall δ1, the completion time L1 and the step time."""

    stall: SaveTime
    complete_s: float | None  # median over the snapshots that reported ``flush.complete_s``
    completes: int
    step_s: float | None  # median seconds per step between consecutive snapshots of a job
    step_gaps: int

    def to_json(self) -> dict[str, Any]:
        return {
            "stall": self.stall.to_json(),
            "complete_s": _r(self.complete_s),
            "completes": self.completes,
            "step_time_s": _r(self.step_s, 4),
            "step_gaps": self.step_gaps,
        }


def check_config(config: AdvisorConfig) -> None:
    """Raise ConfigError naming the ``advisor.*`` key whose value the advisor cannot use."""
    positive_or_none = ("save_time_s", "prior_mtbp_s", "current_interval_s")
    not_negative = ("prior_weight", "restart_s", "coalesce_s", "record_interval_s")
    at_least_one = ("min_losses", "min_reports", "report_window")
    for key in positive_or_none:
        value = getattr(config, key)
        if value is not None and not (math.isfinite(value) and value > 0):
            raise ConfigError(
                f"key 'advisor.{key}': expected a positive number of seconds or none, got {value!r}"
            )
    for key in not_negative:
        value = getattr(config, key)
        if not (math.isfinite(value) and value >= 0):
            raise ConfigError(f"key 'advisor.{key}': expected a number of at least 0, got {value!r}")
    for key in at_least_one:
        if getattr(config, key) < 1:
            raise ConfigError(
                f"key 'advisor.{key}': expected an integer of at least 1, got {getattr(config, key)!r}"
            )
    if not 0.0 < config.ram_loss_share < 1.0:
        raise ConfigError(
            "key 'advisor.ram_loss_share': expected a share above 0 and below 1 (e.g. 0.2), "
            f"got {config.ram_loss_share!r}"
        )
    if not 0.0 < config.credible_level < 1.0:
        raise ConfigError(
            f"key 'advisor.credible_level': expected a probability between 0 and 1 (e.g. 0.9), "
            f"got {config.credible_level!r}"
        )


def _r(value: float | None, digits: int = 3) -> float | None:
    if value is None:
        return None
    if math.isinf(value):
        return None
    return round(value, digits)


def _save_time(
    checkpoints: Sequence[Checkpoint], window: int, fallback: float | None, minimum: int
) -> SaveTime:
    recent = list(checkpoints)[-window:] if window > 0 else list(checkpoints)
    durations = [c.duration_s for c in recent]
    reports = sum(c.reports for c in recent)
    if durations and len(durations) >= minimum:
        centre = median(durations)
        spread = mad_sigma(durations)
        # Identical durations have no spread: flag against 5 % of the median instead.
        limit = OUTLIER_SIGMAS * max(spread, 0.05 * centre)
        outliers = sum(1 for d in durations if abs(d - centre) > limit)
        return SaveTime(centre, "reports", len(durations), reports, spread, outliers)
    if fallback is not None:
        return SaveTime(fallback, "config", len(durations), reports, None, 0)
    return SaveTime(None, None, len(durations), reports, None, 0)


# --- the estimate ------------------------------------------------------------------------------------------


def observe(records: Iterable[Any], now: datetime, config: AdvisorConfig) -> Observations:
    """Read history-shaped records (oldest first) into the advisor's inputs."""
    runs, notices, reports = parse(records)
    interrupting = set(config.interrupting_kinds)
    times = timeline(runs, reports, now)
    exposure = times.exposure_s

    checkpoints = merge_checkpoints(reports)
    periodic = [c for c in checkpoints if not c.emergency and not c.snapshot]
    emergency = [c for c in checkpoints if c.emergency]
    save = _save_time(periodic, config.report_window, config.save_time_s, max(1, config.min_reports))
    emergency_save = _save_time(emergency, config.report_window, None, 1)

    counted = tally(notices.values(), times, emergency, interrupting)
    found = counted.losses + unclean_restarts(list(notices.values()), times, interrupting)
    losses = coalesce(sorted(found, key=lambda loss: loss.time), config.coalesce_s)
    causes = {cause: sum(1 for loss in losses if loss.cause == cause) for cause in LOSS_CAUSES}
    lost = _mtbp(len(losses), exposure, config, use_prior=True)
    announced_m = _mtbp(len(counted.announced), exposure, config, use_prior=False, minimum=1)
    current, current_source = _current_interval(periodic, save.value_s, losses, runs, config)
    return Observations(
        save=save,
        emergency_save=emergency_save,
        lost=lost,
        announced=announced_m,
        losses=tuple(losses),
        causes=causes,
        announced_ids=tuple(counted.announced),
        runs=len(runs),
        exposure_s=exposure,
        current_interval_s=current,
        current_source=current_source,
        drills_ignored=counted.drills,
        pending_notices=counted.pending,
        checkpoints=tuple(checkpoints),
        snapshots=_snapshots(checkpoints, losses, runs, config),
    )


def _snapshots(
    checkpoints: Sequence[Checkpoint], losses: Sequence[Loss], runs: Sequence[Run], config: AdvisorConfig
) -> Snapshots | None:
    """δ1, L1 and the step time from the peer snapshots (not emergency ones), as δ from durable ones."""
    taken = [c for c in checkpoints if c.snapshot and not c.emergency]
    if not taken:
        return None
    stall = _save_time(taken, config.report_window, None, max(1, config.min_reports))
    recent = taken[-config.report_window :]
    completes = [c.complete_s for c in recent if c.complete_s is not None]
    breaks = sorted([loss.time for loss in losses] + [run.start for run in runs])
    by_job: dict[str, list[Checkpoint]] = {}
    for checkpoint in recent:
        by_job.setdefault(checkpoint.job, []).append(checkpoint)
    per_step: list[float] = []
    for done in by_job.values():
        for a, b in itertools.pairwise(done):
            if a.step is None or b.step is None or b.step <= a.step:
                continue  # a restart from an earlier step, or no step numbers
            if any(a.finished_at < t <= b.finished_at for t in breaks):
                continue  # a loss or an agent restart in between: not training time
            compute = (b.finished_at - a.finished_at).total_seconds() - b.duration_s
            if compute > 0:
                per_step.append(compute / (b.step - a.step))
    return Snapshots(
        stall=stall,
        complete_s=median(completes) if completes else None,
        completes=len(completes),
        step_s=median(per_step) if len(per_step) >= 2 else None,
        step_gaps=len(per_step),
    )


def _mtbp(
    events: int, exposure: float, config: AdvisorConfig, use_prior: bool, minimum: int | None = None
) -> Mtbp:
    """M as the posterior mean time of a Gamma(w + n, w·M₀ + T) rate; without a prior, T/n once n is enough."""
    level = config.credible_level
    prior = config.prior_mtbp_s if use_prior and config.prior_weight > 0 else None
    weight = config.prior_weight if prior is not None else 0.0
    needed = config.min_losses if minimum is None else minimum
    if prior is not None:
        shape = weight + events
        rate_scale = weight * prior + exposure
        low, high = rate_interval(shape, rate_scale, level)
        source = "prior" if events == 0 and exposure <= 0 else "prior+history"
        return Mtbp(
            value_s=rate_scale / shape,
            source=source,
            events=events,
            exposure_s=exposure,
            effective_observations=shape,
            range_s=(1.0 / high, 1.0 / low if low > 0 else math.inf),
            lower_bound_s=None,
            prior_s=prior,
            prior_weight=weight,
        )
    low, high = rate_interval(events, exposure, level) if exposure > 0 else (0.0, math.inf)
    if events >= max(1, needed) and exposure > 0:
        return Mtbp(
            value_s=exposure / events,
            source="history",
            events=events,
            exposure_s=exposure,
            effective_observations=float(events),
            range_s=(1.0 / high, 1.0 / low if low > 0 else math.inf),
            lower_bound_s=None,
        )
    # Too few events: say only what the uptime rules out (the range's low end for M).
    bound = 1.0 / high if exposure > 0 and math.isfinite(high) else None
    return Mtbp(None, None, events, exposure, float(events), None, bound)


def _current_interval(
    periodic: Sequence[Checkpoint],
    save_s: float | None,
    losses: Sequence[Loss],
    runs: Sequence[Run],
    config: AdvisorConfig,
) -> tuple[float | None, str | None]:
    """The interval the jobs use now: configured, else the median gap between periodic checkpoints less δ."""
    if config.current_interval_s is not None:
        return config.current_interval_s, "config"
    if save_s is None:
        return None, None
    breaks = sorted([loss.time for loss in losses] + [run.start for run in runs])
    by_job: dict[str, list[datetime]] = {}
    for checkpoint in periodic[-max(config.report_window, 2) :]:
        by_job.setdefault(checkpoint.job, []).append(checkpoint.finished_at)
    gaps: list[float] = []
    for times in by_job.values():
        for a, b in itertools.pairwise(times):
            if any(a < t <= b for t in breaks):
                continue  # a restart in between: not a periodic gap
            gaps.append((b - a).total_seconds())
    if len(gaps) < 2:
        return None, None
    interval = median(gaps) - save_s
    return (interval, "reports") if interval > 0 else (None, None)
