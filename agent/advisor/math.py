"""Checkpoint-interval formulas: Young, Daly (first and higher order), the exact optimum under exponential
interruptions, and the expected waste of any interval. Pure functions over seconds (any one unit works).

Notation (``shared/reference/checkpoint-math.md``): δ the time a checkpoint blocks training, M the mean time
between interruptions that lose work, R the restart time, τ the compute time between two checkpoints.
Interruptions that come with a notice long enough to flush a checkpoint lose no work; :func:`efficiency_mixed`
and :func:`optimal_interval_mixed` take them into account with their own rate.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

INV_E = math.exp(-1.0)
_GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0
# Efficiencies closer than this are treated as equal when choosing an interval (it moves a well-defined
# optimum by about 0.005 %).
FLAT_TOLERANCE = 1e-10


def _check(delta: float, mtbp: float) -> None:
    if not (math.isfinite(delta) and delta > 0):
        raise ValueError(f"checkpoint save time must be a positive number of seconds, got {delta!r}")
    if not (math.isfinite(mtbp) and mtbp > 0):
        raise ValueError(
            f"mean time between interruptions must be a positive number of seconds, got {mtbp!r}"
        )


def young(delta: float, mtbp: float) -> float:
    """Young (1974): τ ≈ √(2δM)."""
    _check(delta, mtbp)
    return math.sqrt(2.0 * delta * mtbp)


def daly_first_order(delta: float, mtbp: float) -> float:
    """Daly (2006) first order, the vendor article's formula: τ ≈ √(2δM) - δ (never below zero)."""
    return max(0.0, young(delta, mtbp) - delta)


def daly_higher_order(delta: float, mtbp: float) -> float:
    """Daly (2006) higher order: √(2δM)·[1 + ⅓√(δ/2M) + ⅑(δ/2M)] - δ for δ < 2M, else M."""
    _check(delta, mtbp)
    if delta >= 2.0 * mtbp:
        return mtbp
    ratio = delta / (2.0 * mtbp)
    return math.sqrt(2.0 * delta * mtbp) * (1.0 + math.sqrt(ratio) / 3.0 + ratio / 9.0) - delta


def lambert_w0(x: float) -> float:
    """The principal branch W₀ of the Lambert W function for real x ≥ -1/e (Halley's iteration)."""
    if math.isnan(x) or x < -INV_E * (1.0 + 1e-15):
        raise ValueError(f"W0 is real only for x >= -1/e, got {x!r}")
    if x == 0.0:
        return 0.0
    if math.isinf(x):
        return math.inf
    # Initial guess: the branch-point series near -1/e, the Taylor series near 0, the log expansion far out.
    branch = 2.0 * (math.e * x + 1.0)
    if branch < 0.5:
        p = math.sqrt(max(branch, 0.0))
        w = -1.0 + p - p * p / 3.0 + 11.0 / 72.0 * p**3
    elif x < 3.0:
        w = x * (1.0 - x + 1.5 * x * x) if abs(x) < 0.3 else math.log1p(x) * 0.8
    else:
        lx = math.log(x)
        w = lx - math.log(lx)
    for _ in range(50):
        ew = math.exp(w)
        f = w * ew - x
        wp1 = w + 1.0
        if wp1 == 0.0:
            break
        step = f / (ew * wp1 - (w + 2.0) * f / (2.0 * wp1))
        w -= step
        if abs(step) <= 4e-16 * (1.0 + abs(w)):
            break
    return w


def exact_interval(delta: float, mtbp: float) -> float:
    """The τ that maximises efficiency under exponential interruptions: τ = M·[1 + W₀(-e^{-(1+δ/M)})].

    Computed through Lambert W, then polished with Newton on the equivalent y + log(1 - y) = -δ/M
    (y = τ/M), which stays accurate when δ ≪ M and W₀ sits next to its branch point.
    """
    _check(delta, mtbp)
    eps = delta / mtbp
    # -e^{-(1+ε)} written as -(1/e)·e^{-ε} so the distance to the branch point is not lost to rounding.
    y = 1.0 + lambert_w0(-INV_E * math.exp(-eps))
    y = min(max(y, 1e-300), 1.0 - 1e-16)
    for _ in range(8):
        f = y + math.log1p(-y) + eps
        fp = -y / (1.0 - y)
        if fp == 0.0:
            break
        new = y - f / fp
        if not 0.0 < new < 1.0:
            break
        if abs(new - y) <= 1e-16 * y:
            y = new
            break
        y = new
    return mtbp * y


def expected_wall_time(
    tau: float, delta: float, mtbp: float, restart: float = 0.0, work: float = 1.0
) -> float:
    """Daly's expected wall time to finish ``work`` of compute: M·e^{R/M}·(e^{(τ+δ)/M} - 1)·(work/τ).

    Exact for exponential interruptions that may also strike during checkpoints and restarts.
    """
    _check(delta, mtbp)
    if not (tau > 0 and math.isfinite(tau)):
        raise ValueError(f"interval must be a positive number of seconds, got {tau!r}")
    if restart < 0:
        raise ValueError(f"restart time must not be negative, got {restart!r}")
    exponent = (tau + delta) / mtbp + restart / mtbp
    if exponent > 700.0:  # the job practically never finishes: avoid an overflow, the answer is infinite
        return math.inf
    return mtbp * math.exp(restart / mtbp) * math.expm1((tau + delta) / mtbp) * (work / tau)


def efficiency(tau: float, delta: float, mtbp: float, restart: float = 0.0) -> float:
    """Share of wall time that is preserved compute at interval τ (exact model)."""
    return 1.0 / expected_wall_time(tau, delta, mtbp, restart, work=1.0)


def waste(tau: float, delta: float, mtbp: float, restart: float = 0.0) -> float:
    """Share of wall time lost to checkpoints, recomputation and restarts at interval τ (exact model)."""
    return 1.0 - efficiency(tau, delta, mtbp, restart)


def waste_first_order(tau: float, delta: float, mtbp: float, restart: float = 0.0) -> float:
    """The first-order waste fraction δ/T + T/(2M) + R/M with T = τ + δ."""
    _check(delta, mtbp)
    period = tau + delta
    return delta / period + period / (2.0 * mtbp) + restart / mtbp


def efficiency_mixed(
    tau: float,
    delta: float,
    mtbp_lost: float | None,
    mtbp_announced: float | None = None,
    *,
    restart: float = 0.0,
    emergency_delta: float | None = None,
) -> float:
    """Efficiency when some interruptions lose work (rate 1/``mtbp_lost``) and others come with a notice long
    enough to flush an emergency checkpoint (rate 1/``mtbp_announced``, flush time ``emergency_delta``, δ by
    default) that saves all compute done so far.

    Renewal-reward over the cycle that starts after a checkpoint: either the period τ + δ passes without an
    interruption, or one comes at X; a lost one keeps nothing, an announced one keeps min(X, τ) and costs the
    flush; both then need a restart R that interruptions may also strike. With no announced interruptions
    this is exactly :func:`efficiency`.
    """
    if not (tau > 0 and math.isfinite(tau)):
        raise ValueError(f"interval must be a positive number of seconds, got {tau!r}")
    if delta < 0 or restart < 0:
        raise ValueError("save and restart times must not be negative")
    lam_u = 0.0 if mtbp_lost is None or math.isinf(mtbp_lost) else 1.0 / mtbp_lost
    lam_a = 0.0 if mtbp_announced is None or math.isinf(mtbp_announced) else 1.0 / mtbp_announced
    flush = delta if emergency_delta is None else emergency_delta
    lam = lam_u + lam_a
    period = tau + delta
    if lam == 0.0:
        return tau / period
    p_fail = -math.expm1(-lam * period)  # P(X < τ + δ)
    share_a = lam_a / lam
    if lam * restart > 700.0:
        return 0.0  # restarts practically never succeed
    mean_time = p_fail / lam + p_fail * (share_a * flush + math.expm1(lam * restart) / lam)
    # E[min(X, τ); X < τ+δ] = E[X; X < τ] + τ·P(τ ≤ X < τ+δ)
    lt = lam * tau
    kept_before = (-math.expm1(-lt) - lt * math.exp(-lt)) / lam
    kept_during = tau * (math.exp(-lt) - math.exp(-lam * period))
    mean_work = tau * math.exp(-lam * period) + share_a * (kept_before + kept_during)
    return mean_work / mean_time


def _golden_min(fn: Callable[[float], float], lo: float, hi: float, tol: float = 1e-10) -> float:
    """Minimum of a unimodal function on [lo, hi] by golden-section search (on whatever scale it is given)."""
    a, b = lo, hi
    c = b - _GOLDEN * (b - a)
    d = a + _GOLDEN * (b - a)
    fc, fd = fn(c), fn(d)
    while abs(b - a) > tol * (abs(a) + abs(b)):
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - _GOLDEN * (b - a)
            fc = fn(c)
        else:
            a, c, fc = c, d, fd
            d = a + _GOLDEN * (b - a)
            fd = fn(d)
    return (a + b) / 2.0


def optimal_interval_mixed(
    delta: float,
    mtbp_lost: float,
    mtbp_announced: float | None = None,
    *,
    restart: float = 0.0,
    emergency_delta: float | None = None,
) -> float:
    """The τ maximising :func:`efficiency_mixed` (golden-section search on log τ, seeded by Lambert W)."""
    _check(delta, mtbp_lost)
    guess = exact_interval(delta, mtbp_lost)
    if mtbp_announced is None or math.isinf(mtbp_announced):
        return guess

    def cost(log_tau: float) -> float:
        tau = math.exp(log_tau)
        return -efficiency_mixed(
            tau, delta, mtbp_lost, mtbp_announced, restart=restart, emergency_delta=emergency_delta
        )

    # Announced interruptions move the optimum, possibly far: scan a wide log grid, then refine around the
    # best point (the efficiency is smooth and has one maximum in practice).
    centre, steps, width = math.log(guess), 120, math.log(1e4)
    grid = [centre - width + 2.0 * width * i / steps for i in range(steps + 1)]
    best = min(range(len(grid)), key=lambda i: cost(grid[i]))
    lo, hi = grid[max(best - 1, 0)], grid[min(best + 1, steps)]
    peak = _golden_min(cost, lo, hi, tol=1e-12)
    # When announced interruptions dominate, the efficiency is flat far to the right of its maximum: advise
    # the shortest interval within FLAT_TOLERANCE of the best, a well-defined answer that keeps periodic
    # checkpoints in case a notice fails.
    target = cost(peak) + FLAT_TOLERANCE
    left = grid[0]
    if cost(left) <= target:
        return math.exp(left)
    right = peak
    for _ in range(100):
        mid = (left + right) / 2.0
        if cost(mid) <= target:
            right = mid
        else:
            left = mid
        if right - left < 1e-12:
            break
    return math.exp(right)


@dataclass(frozen=True)
class Intervals:
    """Every formula's interval for one (δ, M), in the unit of the inputs."""

    young: float
    daly_first_order: float
    daly_higher_order: float
    exact: float

    def as_dict(self) -> dict[str, float]:
        return {
            "young": self.young,
            "daly_first_order": self.daly_first_order,
            "daly_higher_order": self.daly_higher_order,
            "exact": self.exact,
        }


def intervals(delta: float, mtbp: float) -> Intervals:
    return Intervals(
        young=young(delta, mtbp),
        daly_first_order=daly_first_order(delta, mtbp),
        daly_higher_order=daly_higher_order(delta, mtbp),
        exact=exact_interval(delta, mtbp),
    )
