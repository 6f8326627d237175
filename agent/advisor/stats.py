"""Small robust statistics for the advisor, in pure Python: median, MAD, and gamma quantiles for the credible
range of an interruption rate (the agent must not pull in scipy)."""

from __future__ import annotations

import math
from collections.abc import Sequence

MAD_TO_SIGMA = 1.482602218505602  # 1/Φ⁻¹(3/4): the MAD of a normal sample estimates sigma/this


def median(values: Sequence[float]) -> float:
    if not values:
        raise ValueError("median of no values")
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2.0


def mad_sigma(values: Sequence[float]) -> float:
    """The median absolute deviation scaled to estimate a standard deviation (robust to outliers)."""
    centre = median(values)
    return MAD_TO_SIGMA * median([abs(v - centre) for v in values])


def gamma_p(a: float, x: float) -> float:
    """The regularized lower incomplete gamma function P(a, x) (series below a + 1, continued fraction above)."""
    if a <= 0:
        raise ValueError(f"shape must be positive, got {a!r}")
    if x <= 0:
        return 0.0
    log_prefix = a * math.log(x) - x - math.lgamma(a)
    if x < a + 1.0:
        term = total = 1.0 / a
        n = a
        for _ in range(10_000):
            n += 1.0
            term *= x / n
            total += term
            if abs(term) < abs(total) * 1e-16:
                break
        return min(1.0, total * math.exp(log_prefix))
    # Lentz's method for the continued fraction of Q(a, x).
    tiny = 1e-300
    b = x + 1.0 - a
    c = 1.0 / tiny
    d = 1.0 / b
    h = d
    for i in range(1, 10_000):
        an = -i * (i - a)
        b += 2.0
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1.0 / d
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < 1e-16:
            break
    return max(0.0, 1.0 - math.exp(log_prefix) * h)


def gamma_ppf(q: float, a: float) -> float:
    """The q-quantile of the Gamma(shape a, scale 1) distribution (bisection on P, then Newton)."""
    if not 0.0 < q < 1.0:
        raise ValueError(f"quantile must be between 0 and 1, got {q!r}")
    lo, hi = 0.0, max(1.0, a)
    while gamma_p(a, hi) < q:
        lo, hi = hi, hi * 2.0
    for _ in range(200):
        mid = (lo + hi) / 2.0
        if gamma_p(a, mid) < q:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-14 * hi:
            break
    x = (lo + hi) / 2.0
    for _ in range(3):  # polish: dP/dx is the gamma density
        density = math.exp((a - 1.0) * math.log(x) - x - math.lgamma(a)) if x > 0 else 0.0
        if density <= 0:
            break
        step = (gamma_p(a, x) - q) / density
        if not lo <= x - step <= hi:
            break
        x -= step
    return x


def rate_interval(events: float, exposure: float, level: float) -> tuple[float, float]:
    """Equal-tailed credible range of a Poisson rate whose posterior is Gamma(events, exposure).

    ``events`` may be fractional (a prior adds pseudo-observations); with no events the lower end is 0.
    """
    tail = (1.0 - level) / 2.0
    if exposure <= 0:
        return 0.0, math.inf
    low = gamma_ppf(tail, events) / exposure if events > 0 else 0.0
    high = gamma_ppf(1.0 - tail, events if events > 0 else 1.0) / exposure
    return low, high
