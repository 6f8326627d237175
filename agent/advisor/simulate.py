"""Monte Carlo of training under exponential interruptions, to check the waste formulas and to show a policy's
spread. Pure Python, seeded, bounded by the number of runs and the work per run.

The model is the one :func:`agent.advisor.math.efficiency_mixed` solves: compute τ then checkpoint δ, over and
over; an interruption with a usable notice flushes an emergency checkpoint (δₑ) that keeps the compute done
so far, one without loses everything since the last checkpoint; both then need a restart R that further
interruptions may strike. Each run checkpoints whole periods until it has saved the work asked for; by Wald's
identity the ratio of summed work to summed wall time estimates the analytical efficiency without bias from
the run's end.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from statistics import NormalDist
from typing import Any

from agent.advisor import math as cm

MAX_SEGMENTS = 20_000_000  # a hard bound on the work one call may do


@dataclass(frozen=True)
class SimulationResult:
    runs: int
    interval_s: float
    waste: float
    ci_low: float
    ci_high: float
    level: float
    analytical_waste: float
    interruptions: int
    lost: int
    announced: int
    wall_s: float

    @property
    def agrees(self) -> bool:
        return self.ci_low <= self.analytical_waste <= self.ci_high

    def to_json(self) -> dict[str, Any]:
        return {
            "runs": self.runs,
            "interval_s": round(self.interval_s, 3),
            "waste": round(self.waste, 6),
            "ci": [round(self.ci_low, 6), round(self.ci_high, 6)],
            "level": self.level,
            "analytical_waste": round(self.analytical_waste, 6),
            "agrees": self.agrees,
            "interruptions": self.interruptions,
            "lost": self.lost,
            "announced": self.announced,
        }


def simulate(
    tau: float,
    delta: float,
    mtbp: float,
    *,
    announced_share: float = 0.0,
    restart: float = 0.0,
    emergency_delta: float | None = None,
    periods_per_run: int = 100,
    runs: int = 1000,
    seed: int | None = 0,
    level: float = 0.95,
) -> SimulationResult:
    """Simulate ``runs`` jobs of ``periods_per_run``·τ of work each, interrupted at mean interval ``mtbp`` (all
    interruptions), a share ``announced_share`` of them with a notice long enough to flush."""
    _check(tau, delta, mtbp, restart, announced_share, runs, periods_per_run)
    flush = delta if emergency_delta is None else emergency_delta
    rng = random.Random(seed)
    works: list[float] = []
    walls: list[float] = []
    lost = announced = 0
    for _ in range(runs):
        run = _Run(tau, delta, 1.0 / mtbp, restart, flush, announced_share)
        run.until(periods_per_run * tau, rng)
        works.append(run.saved)
        walls.append(run.clock)
        lost += run.lost
        announced += run.announced
    total_work, total_wall = sum(works), sum(walls)
    eff = total_work / total_wall
    # Delta method for a ratio of means: Var(η̂) ≈ Σ(wᵢ - η̂·tᵢ)² / (n(n-1)·t̄²).
    n = len(works)
    mean_wall = total_wall / n
    resid = sum((w - eff * t) ** 2 for w, t in zip(works, walls, strict=True))
    stderr = math.sqrt(resid / (n * (n - 1))) / mean_wall
    z = NormalDist().inv_cdf(0.5 + level / 2.0)
    analytical = 1.0 - cm.efficiency_mixed(
        tau,
        delta,
        mtbp / (1.0 - announced_share) if announced_share < 1.0 else None,
        mtbp / announced_share if announced_share > 0.0 else None,
        restart=restart,
        emergency_delta=flush,
    )
    return SimulationResult(
        runs=n,
        interval_s=tau,
        waste=1.0 - eff,
        ci_low=1.0 - eff - z * stderr,
        ci_high=1.0 - eff + z * stderr,
        level=level,
        analytical_waste=analytical,
        interruptions=lost + announced,
        lost=lost,
        announced=announced,
        wall_s=total_wall,
    )


def _check(
    tau: float,
    delta: float,
    mtbp: float,
    restart: float,
    announced_share: float,
    runs: int,
    periods_per_run: int,
) -> None:
    """ValueError naming the first of :func:`simulate`'s arguments out of its range."""
    if not (tau > 0 and delta >= 0 and mtbp > 0 and restart >= 0):
        raise ValueError("interval and MTBP must be positive, save and restart times not negative")
    if not 0.0 <= announced_share <= 1.0:
        raise ValueError(f"announced share must be between 0 and 1, got {announced_share!r}")
    if runs < 2 or periods_per_run < 1 or runs * periods_per_run > MAX_SEGMENTS:
        raise ValueError(
            f"runs x periods must be between 2 and {MAX_SEGMENTS}, got {runs} x {periods_per_run}"
        )


@dataclass
class _Run:
    """One simulated job: the work saved, the wall clock, and its interruptions so far."""

    tau: float
    delta: float
    rate: float
    restart: float
    flush: float
    announced_share: float
    clock: float = 0.0
    saved: float = 0.0
    lost: int = 0
    announced: int = 0

    def until(self, target: float, rng: random.Random) -> None:
        """Run until ``target`` of work is saved (and a restart it needs is done), drawing from ``rng``."""
        need_restart = False
        while need_restart or self.saved < target:
            if need_restart:
                hit = rng.expovariate(self.rate)
                if hit < self.restart:
                    self.clock += (
                        hit  # struck while restarting: start the restart again (nothing new to lose)
                    )
                    continue
                self.clock += self.restart
                need_restart = False
                continue
            hit = rng.expovariate(self.rate)
            if hit >= self.tau + self.delta:
                self.clock += self.tau + self.delta
                self.saved += self.tau
                continue
            need_restart = True
            if rng.random() < self.announced_share:
                self.announced += 1
                self.saved += min(hit, self.tau)
                self.clock += hit + self.flush
            else:
                self.lost += 1
                self.clock += hit
