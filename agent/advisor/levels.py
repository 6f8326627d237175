"""The ``two_level`` part of the advice: peer snapshots and durable checkpoints, each with its interval, and
what the peer level saves against durable checkpoints alone. Pure; present only when peer snapshots were
reported (``flush.tier`` "snapshot"). The math: agent/advisor/two_level.py; docs/advisor.md, "Two levels".
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from agent.advisor import two_level
from agent.advisor.estimate import Snapshots
from agent.core.durations import format_duration
from agent.core.screen import plural

if TYPE_CHECKING:  # annotations only: `preemptd advise` must not load the config loader (msgspec)
    from agent.config import AdvisorConfig

DAY_S = 86400.0


def section(
    snaps: Snapshots | None, config: AdvisorConfig, durable_s: float, mtbp_s: float
) -> dict[str, Any] | None:
    """The advice for both levels from the snapshots' δ1 and L1, the durable δ2 and the unannounced M: λ2 is
    the configured share of 1/M (the losses that take every RAM copy), λ1 the rest."""
    if snaps is None:
        return None
    share = config.ram_loss_share
    rate = 1.0 / mtbp_s
    rate1, rate2 = (1.0 - share) * rate, share * rate
    doc: dict[str, Any] = {
        "levels": None,
        "snapshots": snaps.to_json(),
        "durable_save_time_s": round(durable_s, 3),
        "assumption": {
            "ram_loss_share": share,
            "source": "config (advisor.ram_loss_share): no loss of every RAM copy is measured",
            "mtbp_peer_repairable_s": round(1.0 / rate1, 3),
            "mtbp_all_copies_lost_s": round(1.0 / rate2, 3),
        },
        "peer": None,
        "durable": None,
        "expected_waste": None,
        "saves": None,
        "reason": None,
    }
    stall = snaps.stall.value_s
    if stall is None or stall <= 0:
        doc["reason"] = (
            f"too few peer snapshots ({snaps.stall.checkpoints} reported, {config.min_reports} needed)"
        )
        doc["explanation"] = f"No two-level advice yet: {doc['reason']}."
        return doc
    found = two_level.plan(stall, snaps.complete_s, durable_s, rate1, rate2, snaps.step_s)
    doc.update(_numbers(found, snaps.step_s))
    doc["explanation"] = explain(doc, snaps)
    return doc


def _numbers(found: two_level.Plan, step_s: float | None) -> dict[str, Any]:
    saved = found.saved
    peer = None
    if found.peer is not None:
        peer = {**found.peer.as_dict(), "steps": found.steps, "step_time_s": step_s}
    return {
        "levels": found.levels,
        "n_star": round(found.n_star, 3),
        "peer": peer,
        "durable": {**found.durable.as_dict(), "every_snapshots": found.every},
        "expected_waste": {
            "two_level": round(found.waste, 5) if found.levels == 2 else None,
            "peer_level": round(found.peer_waste, 5),
            "durable_level": round(found.waste - found.peer_waste, 5),
            "from_completion": round(found.completion_waste, 5),
            "durable_only": round(found.durable_only_waste, 5),
            "durable_only_interval_s": round(found.durable_only.interval_s, 3),
        },
        "saves": {"waste": round(saved, 5), "hours_per_day": round(saved * DAY_S / 3600.0, 3)},
        "reason": found.reason,
    }


def _pct(value: float) -> str:
    return f"{100.0 * value:.1f} %"


def explain(doc: dict[str, Any], snaps: Snapshots) -> str:
    """The two-level advice in sentences (wrapped by whoever prints it)."""
    stall = snaps.stall
    waste = doc["expected_waste"]
    assumed = doc["assumption"]
    parts = [
        f"Peer snapshots block training for {format_duration(stall.value_s or 0.0)} (median of "
        f"{plural(stall.checkpoints, 'snapshot')})"
        + (
            f" and are complete on the peers after {format_duration(snaps.complete_s)}."
            if snaps.complete_s is not None
            else "; none reported its completion time (flush.complete_s)."
        ),
        f"Assumed: {_pct(assumed['ram_loss_share'])} of the unannounced losses also take every RAM copy "
        f"(advisor.ram_loss_share), so a peer copy repairs a loss every "
        f"{format_duration(assumed['mtbp_peer_repairable_s'])} and every copy is lost every "
        f"{format_duration(assumed['mtbp_all_copies_lost_s'])}.",
    ]
    alone = f"{_pct(waste['durable_only'])} with durable checkpoints alone"
    if doc["levels"] == 1:
        parts.append(
            f"One level: {doc['reason']}; checkpoint durably every "
            f"{format_duration(doc['durable']['interval_s'])} of compute ({alone})."
        )
        return " ".join(parts)
    peer, durable = doc["peer"], doc["durable"]
    steps = f" ({peer['steps']} steps of {format_duration(peer['step_time_s'])})" if peer["steps"] else ""
    parts.append(
        f"Peer snapshot every {format_duration(peer['interval_s'])} of compute{steps}; durable "
        f"checkpoint every {format_duration(durable['interval_s'])} (every "
        f"{plural(durable['every_snapshots'], 'snapshot')})."
    )
    parts.append(
        f"Expected waste {_pct(waste['two_level'])} with both levels (snapshots "
        f"{_pct(waste['peer_level'])}, durable {_pct(waste['durable_level'])}), against {alone}: "
        f"snapshots save {_pct(doc['saves']['waste'])} of wall time, "
        f"{doc['saves']['hours_per_day']:.1f} h a day."
    )
    return " ".join(parts)
