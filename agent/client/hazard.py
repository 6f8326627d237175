"""The hazard a job's host is under, as its notices say, and how much more often it should take peer snapshots
(docs/snapshots.md, "The hazard raises the rate").

A notice that calls for a checkpoint (the watcher's trigger policy: a termination, by default a rebalance
recommendation too) makes the job evacuate at once; these are the others, which say that a host is more likely
to be lost soon without a usable notice: a rebalance recommendation where the policy does not act on it (its
precision was about 30 % in the one published sample), NVML's degraded signals (rising ECC or row-remap counts,
thermal or power slowdown, XID warnings) and host degradation. Each multiplies the rate of unannounced losses
λ1 by a factor; since the peer interval goes as λ1^(-1/2) (two-level Young/Daly, docs/advisor.md), the steps
between snapshots are divided by √factor. The strongest signal of any rank's host counts for the whole job
(:class:`agent.client.torch.Coordinator` agrees on it with its one all_reduce); the rate relaxes when the notice
clears. Standard library only.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from agent.client.events import Notice, TriggerPolicy

# λ1 multipliers (shared/reference/snapshots.md, section 4 and its implications): moderate for a rebalance
# recommendation and NVML's degraded signals, less for a degraded host.
FACTORS = {"rebalance": 4.0, "gpu_degraded": 4.0, "host_degraded": 2.0}


@dataclass(frozen=True)
class Hazard:
    """How much likelier an unannounced loss is (1: as usual) and why (one line per notice)."""

    factor: float = 1.0
    reasons: tuple[str, ...] = ()


def hazard_of(notices: Iterable[Notice], policy: TriggerPolicy | None = None) -> Hazard:
    """The hazard the active ``notices`` put the host under: the largest factor of those the trigger
    ``policy`` does not act on (drills count: they rehearse the change)."""
    policy = policy or TriggerPolicy()
    found = [n for n in notices if n.kind in FACTORS and not policy.matches(n)]
    if not found:
        return Hazard()
    reasons = tuple(
        sorted(
            f"{n.kind}{' drill' if n.drill else ''} from {n.source or 'the agent'}: {n.reason}".rstrip(": ")
            for n in found
        )
    )
    return Hazard(max(FACTORS[n.kind] for n in found), reasons)


def steps_between(every: int, factor: float) -> int:
    """The steps between snapshots under a hazard ``factor``: ``every`` divided by √factor, at least one."""
    if every < 1:
        raise ValueError(f"every must be at least 1, got {every}")
    if not factor >= 1.0:
        factor = 1.0
    return max(1, round(every / math.sqrt(factor)))


def rate_report(
    step: int, every: int, usual: int, hazard: Hazard, client: Mapping[str, Any]
) -> dict[str, Any]:
    """The ``snapshot_rate`` report of a change to snapshots every ``every`` steps (``usual`` without a hazard):
    ``raised`` below it, ``relaxed`` back at it; the agent's journal, status and ``preemptd watch`` show it."""
    rate: dict[str, Any] = {"every": every, "usual": usual, "factor": float(hazard.factor)}
    if hazard.reasons:
        rate["reason"] = "; ".join(hazard.reasons)[:500]
    phase = "raised" if every < usual else "relaxed"
    return {"kind": "snapshot_rate", "phase": phase, "step": step, "rate": rate, "client": dict(client)}
