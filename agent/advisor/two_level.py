"""Two-level checkpoint intervals: peer snapshots (level 1, into other hosts' RAM) and durable checkpoints
(level 2). Pure functions over seconds and rates per second.

Notation (``shared/reference/snapshots.md`` section 1): δ1 the training stall of one peer snapshot, L1 the
time until it is complete on the peers (it runs in the background), δ2 the stall of one durable checkpoint,
λ1 the rate of losses a peer copy repairs, λ2 the rate of losses that destroy every RAM copy of some shard,
n the peer snapshots per durable checkpoint, K the steps between peer snapshots.

A pattern of period P holds n snapshots, the last of which is also a durable checkpoint; its waste per unit
of time, to first order, is

    W(P, n) = (n·δ1 + δ2)/P + λ1·(P/(2n) + L1 + R1) + λ2·(P/2 + R2)

Its minimum is at n* = √((δ2·λ1)/(δ1·λ2)) and P* = √(2·δ2/λ2): each level takes Young's interval with its
own cost and rate, T1 = √(2·δ1/λ1), T2 = √(2·δ2/λ2), and W* = √(2·δ1·λ1) + √(2·δ2·λ2) + λ1·(L1 + R1) + λ2·R2.
When n* < 1 the peer level does not pay: one level with λ = λ1 + λ2. The advised intervals apply Daly's
higher-order correction per level (agent/advisor/math.py), as the single-level advice does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from agent.advisor import math as cm


def _rate(value: float, name: str) -> float:
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a positive rate per second, got {value!r}")
    return value


@dataclass(frozen=True)
class Level:
    """One level's interval: Young's first-order value and the advised one (Daly, higher order)."""

    first_order_s: float  # √(2δ/λ)
    interval_s: float  # compute time between the end of one checkpoint and the start of the next

    def as_dict(self) -> dict[str, float]:
        return {"interval_s": round(self.interval_s, 3), "first_order_s": round(self.first_order_s, 3)}


def level(delta: float, rate: float) -> Level:
    """The interval of one level of stall ``delta`` struck at ``rate``."""
    mtbp = 1.0 / _rate(rate, "the failure rate")
    return Level(cm.young(delta, mtbp), cm.daly_higher_order(delta, mtbp))


def n_star(d1: float, d2: float, rate1: float, rate2: float) -> float:
    """Peer snapshots per durable checkpoint at the optimum: √((δ2·λ1)/(δ1·λ2)) (below 1: they do not pay)."""
    return math.sqrt((d2 * _rate(rate1, "λ1")) / (d1 * _rate(rate2, "λ2")))


def waste(
    period: float,
    n: float,
    d1: float,
    l1: float,
    d2: float,
    rate1: float,
    rate2: float,
    r1: float = 0.0,
    r2: float = 0.0,
) -> float:
    """W(P, n), the first-order share of time lost to stalls, rework, completion and restarts."""
    if not (period > 0 and n > 0):
        raise ValueError(f"the period and n must be positive, got {period!r} and {n!r}")
    return (n * d1 + d2) / period + rate1 * (period / (2.0 * n) + l1 + r1) + rate2 * (period / 2.0 + r2)


def minimum_waste(d1: float, l1: float, d2: float, rate1: float, rate2: float) -> tuple[float, float]:
    """W* split in two: stalls plus rework, √(2·δ1·λ1) + √(2·δ2·λ2), and the completion term λ1·L1
    (restarts excluded)."""
    return math.sqrt(2.0 * d1 * rate1) + math.sqrt(2.0 * d2 * rate2), rate1 * l1


def best_period(n: float, d1: float, d2: float, rate1: float, rate2: float) -> float:
    """The P that minimises W(P, n) for a given n: √((n·δ1 + δ2)/(λ1/(2n) + λ2/2))."""
    return math.sqrt((n * d1 + d2) / (rate1 / (2.0 * n) + rate2 / 2.0))


def single_level_waste(tau: float, delta: float, rate: float) -> float:
    """The first-order waste of one level: δ/P + λ·P/2 with P = τ + δ."""
    period = tau + delta
    return delta / period + rate * period / 2.0


def steps_between(interval_s: float, complete_s: float | None, step_s: float) -> int:
    """K = max(⌈L1/t_step⌉, round(T1/t_step)): at most one snapshot in flight, and at least one step."""
    if not (math.isfinite(step_s) and step_s > 0):
        raise ValueError(f"the step time must be a positive number of seconds, got {step_s!r}")
    in_flight = math.ceil(complete_s / step_s - 1e-9) if complete_s else 0
    return max(1, in_flight, round(interval_s / step_s))


@dataclass(frozen=True)
class Plan:
    """The advice for both levels, or for durable checkpoints alone when snapshots do not pay."""

    levels: int  # 2, or 1 when peer snapshots do not pay
    n_star: float
    peer: Level | None  # None with one level
    durable: Level
    every: int | None  # durable checkpoint every this many snapshots (n)
    steps: int | None  # K, when the step time is known
    waste: float  # first-order waste of the advised pattern (completion term included)
    peer_waste: float  # its peer part: n·δ1/P + λ1·(P/(2n) + L1)
    completion_waste: float  # λ1·L1, part of the above
    durable_only: Level  # one level at λ1 + λ2
    durable_only_waste: float
    reason: str | None  # why one level

    @property
    def saved(self) -> float:
        """Share of wall time the peer level saves against durable checkpoints alone."""
        return self.durable_only_waste - self.waste


def plan(
    d1: float, l1: float | None, d2: float, rate1: float, rate2: float, step_s: float | None = None
) -> Plan:
    """Both intervals for measured stalls δ1, δ2, completion L1 (None: not reported, counted as 0) and the
    rates λ1, λ2; K steps when the step time is known."""
    complete = l1 or 0.0
    both = _rate(rate1, "λ1") + _rate(rate2, "λ2")
    alone = level(d2, both)
    alone_waste = single_level_waste(alone.interval_s, d2, both)
    ratio = n_star(d1, d2, rate1, rate2)
    one = Plan(1, ratio, None, alone, None, None, alone_waste, 0.0, 0.0, alone, alone_waste, None)
    if ratio < 1.0:
        why = f"peer snapshots do not pay: n* = {ratio:.2f} < 1 (δ2·λ1 < δ1·λ2)"
        return replace(one, reason=why)
    first, second = level(d1, rate1), level(d2, rate2)
    peer = Level(first.first_order_s, max(first.interval_s, complete))
    n = max(1, round(second.interval_s / peer.interval_s))
    period = n * (peer.interval_s + d1) + d2
    total = waste(period, n, d1, complete, d2, rate1, rate2)
    peer_part = n * d1 / period + rate1 * (period / (2.0 * n) + complete)
    if total >= alone_waste:
        why = f"peer snapshots do not pay: {100 * total:.1f} % waste with them, {100 * alone_waste:.1f} % without"
        return replace(one, reason=why)
    steps = steps_between(peer.interval_s, l1, step_s) if step_s else None
    return Plan(
        2, ratio, peer, second, n, steps, total, peer_part, rate1 * complete, alone, alone_waste, None
    )
