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
clears. A notice on *another* host of the job (it left an elastic job: :class:`Siblings`) raises it too, for
ten minutes, and asks for a snapshot at once: spot reclaims come in bursts by pool (98 % of one trace's
preemptions had another within ±10 min). Standard library only.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from agent.client.events import Notice, TriggerPolicy

# λ1 multipliers (shared/reference/snapshots.md, section 4 and its implications): moderate for a rebalance
# recommendation and NVML's degraded signals, less for a degraded host.
FACTORS = {"rebalance": 4.0, "gpu_degraded": 4.0, "host_degraded": 2.0}
# A notice on another host of the job: stronger evidence than a rebalance recommendation (reference, section 3:
# a peer in the same pool was lost with its host 19 % of the time within ±3 min), held for about ten minutes.
SIBLING_FACTOR = 4.0
SIBLING_HOLD_S = 600.0


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


def combined(*hazards: Hazard) -> Hazard:
    """The strongest factor of ``hazards``, with every reason."""
    return Hazard(max((h.factor for h in hazards), default=1.0), tuple(r for h in hazards for r in h.reasons))


@dataclass
class Siblings:
    """Notices on other hosts of the job, each raising the hazard of the hosts that stay for ``hold_s`` seconds,
    and the capacity pools those hosts were in, where snapshot copies go only when no other host can hold them
    for as long (a burst of reclaims in a pool takes its next host soon). Keep one for the job's life (across
    re-forms) and give it to each :class:`~agent.client.torch.Coordinator`; every staying rank notes the same
    departure, so their factors and pools agree."""

    hold_s: float = SIBLING_HOLD_S
    _until: dict[str, float] = field(default_factory=dict)  # reason -> monotonic end
    _pools: dict[str, float] = field(default_factory=dict)  # pool name -> monotonic end
    _snapshot_asked: bool = False

    def note(self, reason: str, pools: Iterable[str] = (), now: float | None = None) -> None:
        """Another host of the job had a notice (``reason`` says which; ``pools``: the pool names of the hosts
        that left, where known): raise the hazard, ask for a snapshot, avoid those pools."""
        end = (time.monotonic() if now is None else now) + self.hold_s
        self._until[reason] = end
        self._pools.update(dict.fromkeys(pools, end))
        self._snapshot_asked = True

    def hazard(self, now: float | None = None) -> Hazard:
        """:data:`SIBLING_FACTOR` while a noted notice is younger than ``hold_s``, else none."""
        self._expire(time.monotonic() if now is None else now)
        if not self._until:
            return Hazard()
        return Hazard(SIBLING_FACTOR, tuple(sorted(self._until)))

    def pools(self, now: float | None = None) -> frozenset[str]:
        """The pools of the hosts that left in the last ``hold_s`` seconds (``ShardedStore.snapshot``'s
        ``avoid_pools``)."""
        self._expire(time.monotonic() if now is None else now)
        return frozenset(self._pools)

    def _expire(self, now: float) -> None:
        for noted in (self._until, self._pools):
            for key in [k for k, end in noted.items() if end <= now]:
                del noted[key]

    def take_snapshot(self) -> bool:
        """Whether a snapshot was asked for since the last call (once per note)."""
        asked, self._snapshot_asked = self._snapshot_asked, False
        return asked


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
