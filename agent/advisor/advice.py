"""Turn measured inputs into advice: the interval to use, what every formula says, the expected waste at the
advised and the current interval, how sure the advisor is, and a short explanation. Pure.

``interval_s`` is τ, the compute time between the end of one checkpoint and the start of the next; the
period between checkpoint starts is τ + δ (``period_s``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from agent.advisor import levels
from agent.advisor import math as cm
from agent.advisor.estimate import Observations
from agent.advisor.losses import LOSS_CAUSES
from agent.core.durations import format_duration as _short_duration
from agent.core.notice import format_time
from agent.core.screen import plural

if TYPE_CHECKING:  # annotations only: `preemptd advise` must not load the config loader (msgspec)
    from agent.config import AdvisorConfig

CONFIDENCE_LEVELS = ("none", "low", "medium", "high")
# The uptime after which the advice without enough interruptions says what it rules out of M: the bound from
# seconds or minutes of uptime is seconds or minutes, which tells nobody anything about a spot market.
BOUND_AFTER_S = 3600.0


@dataclass(frozen=True)
class Inputs:
    save_s: float
    mtbp_lost_s: float
    mtbp_announced_s: float | None = None
    restart_s: float = 0.0
    emergency_save_s: float | None = None
    current_s: float | None = None


def waste_at(inputs: Inputs, tau: float) -> float:
    """Expected share of wall time wasted at interval τ, announced interruptions included."""
    return 1.0 - cm.efficiency_mixed(
        tau,
        inputs.save_s,
        inputs.mtbp_lost_s,
        inputs.mtbp_announced_s,
        restart=inputs.restart_s,
        emergency_delta=inputs.emergency_save_s,
    )


def advised_interval(inputs: Inputs) -> float:
    return cm.optimal_interval_mixed(
        inputs.save_s,
        inputs.mtbp_lost_s,
        inputs.mtbp_announced_s,
        restart=inputs.restart_s,
        emergency_delta=inputs.emergency_save_s,
    )


def calculate(inputs: Inputs) -> dict[str, Any]:
    """The numbers shared by live and offline advice."""
    tau = advised_interval(inputs)
    formulas = cm.intervals(inputs.save_s, inputs.mtbp_lost_s)
    doc: dict[str, Any] = {
        "interval_s": round(tau, 3),
        "period_s": round(tau + inputs.save_s, 3),
        "formulas": {
            "young_s": round(formulas.young, 3),
            "daly_first_order_s": round(formulas.daly_first_order, 3),
            "daly_higher_order_s": round(formulas.daly_higher_order, 3),
            "exact_s": round(formulas.exact, 3),
        },
        "expected_waste": {
            "advised": round(waste_at(inputs, tau), 5),
            "current": round(waste_at(inputs, inputs.current_s), 5) if inputs.current_s else None,
            "first_order_minimum": round(math.sqrt(2.0 * inputs.save_s / inputs.mtbp_lost_s), 5),
        },
    }
    if inputs.mtbp_announced_s is not None:
        # What a notice-blind advisor would say: every interruption counted as a loss.
        both = 1.0 / (1.0 / inputs.mtbp_lost_s + 1.0 / inputs.mtbp_announced_s)
        naive = cm.exact_interval(inputs.save_s, both)
        doc["expected_waste"]["if_every_interruption_lost_work"] = {
            "mtbp_s": round(both, 3),
            "interval_s": round(naive, 3),
            "waste": round(waste_at(inputs, naive), 5),
        }
    doc["notice_benefit"] = notice_benefit(inputs, tau)
    return doc


def notice_benefit(inputs: Inputs, tau: float) -> dict[str, Any] | None:
    """How much longer the interval is because notices cover a share a of the interruptions, and the periodic
    checkpoints that saves: only uncovered interruptions count in M, so M grows by 1/(1-a) and T* ~ sqrt(2δM)
    by 1/sqrt(1-a) (``interval_factor``); ``exact_factor`` compares the advised interval with the one a
    notice-blind advisor would give (every interruption a loss). None without announced interruptions."""
    if inputs.mtbp_announced_s is None:
        return None
    lost, announced = 1.0 / inputs.mtbp_lost_s, 1.0 / inputs.mtbp_announced_s
    share = announced / (lost + announced)
    blind = cm.exact_interval(inputs.save_s, 1.0 / (lost + announced))
    per_day = 86400.0 / (blind + inputs.save_s) - 86400.0 / (tau + inputs.save_s)
    return {
        "covered_share": round(share, 4),
        "interval_factor": round(1.0 / math.sqrt(1.0 - share), 4),
        "exact_factor": round(tau / blind, 4),
        "checkpoints_saved_per_day": round(per_day, 3),
        "checkpoint_time_saved_per_day_s": round(per_day * inputs.save_s, 1),
    }


def _confidence(obs: Observations) -> str:
    counts = obs.lost.effective_observations
    saves = obs.save.checkpoints if obs.save.source == "reports" else 0
    if counts < 3 or saves < 3:
        return "low"
    if counts < 10 or saves < 10:
        return "medium"
    return "high"


def advise(obs: Observations, config: AdvisorConfig, now: datetime) -> dict[str, Any]:
    """The ``GET /v1/advice`` document."""
    restart = config.restart_s
    doc: dict[str, Any] = {
        "interval_s": None,
        "period_s": None,
        "confidence": "none",
        "interval_range_s": None,
        "computed_at": format_time(now),
        "save_time": obs.save.to_json(),
        "emergency_save_time": obs.emergency_save.to_json(),
        "mtbp": {"unannounced": obs.lost.to_json(), "announced": obs.announced.to_json()},
        "losses": {"total": len(obs.losses), **{cause: obs.causes.get(cause, 0) for cause in LOSS_CAUSES}},
        "announced_interruptions": len(obs.announced_ids),
        "pending_notices": obs.pending_notices,
        "drills_ignored": obs.drills_ignored,
        "observed_uptime_s": round(obs.exposure_s, 3),
        "restart": {"value_s": restart, "source": "config"},
        "current_interval": {"value_s": _round(obs.current_interval_s), "source": obs.current_source},
        "formulas": None,
        "expected_waste": None,
        "reason": None,
    }
    missing = _missing(obs, config)
    if missing:
        doc["reason"] = "; ".join(missing)
        doc["explanation"] = "No advice yet: " + doc["reason"] + "."
        return doc
    assert obs.save.value_s is not None and obs.lost.value_s is not None
    inputs = Inputs(
        save_s=obs.save.value_s,
        mtbp_lost_s=obs.lost.value_s,
        mtbp_announced_s=obs.announced.value_s,
        restart_s=restart,
        emergency_save_s=obs.emergency_save.value_s,
        current_s=obs.current_interval_s,
    )
    doc.update(calculate(inputs))
    doc["confidence"] = _confidence(obs)
    if obs.lost.range_s is not None:
        low_m, high_m = obs.lost.range_s
        low = advised_interval(_with_m(inputs, low_m))
        high = advised_interval(_with_m(inputs, high_m)) if math.isfinite(high_m) else None
        doc["interval_range_s"] = [round(low, 3), _round(high)]
    doc["explanation"] = explain(doc, obs, config)
    two = levels.section(obs.snapshots, config, inputs.save_s, inputs.mtbp_lost_s)
    if two is not None:  # only when peer snapshots were reported: the document is otherwise unchanged
        doc["two_level"] = two
    return doc


def _missing(obs: Observations, config: AdvisorConfig) -> list[str]:
    """What advice still lacks (a save time, enough work-losing interruptions), one phrase each."""
    missing = []
    if obs.save.value_s is None or obs.save.value_s <= 0:
        missing.append(
            f"no checkpoint save time yet ({plural(obs.save.checkpoints, 'finished periodic checkpoint')} "
            f"reported, {config.min_reports} needed, and advisor.save_time_s is not set)"
        )
    if obs.lost.value_s is None:
        bound = obs.lost.lower_bound_s
        missing.append(
            f"too few work-losing interruptions to estimate M ({obs.lost.events} in "
            f"{format_duration(obs.exposure_s)} of uptime, {config.min_losses} needed, and no advisor.prior_mtbp_s)"
            + (
                f"; M is probably above {format_duration(bound)}"
                if bound and obs.exposure_s >= BOUND_AFTER_S
                else ""
            )
        )
    return missing


def _with_m(inputs: Inputs, mtbp: float) -> Inputs:
    return Inputs(
        inputs.save_s,
        mtbp,
        inputs.mtbp_announced_s,
        inputs.restart_s,
        inputs.emergency_save_s,
        inputs.current_s,
    )


def format_duration(seconds: float) -> str:
    """Human duration; days past two days (uptime runs into months)."""
    if seconds >= 2 * 86400:
        return f"{seconds / 86400:.1f} d"
    return _short_duration(seconds)


def _round(value: float | None) -> float | None:
    return None if value is None or not math.isfinite(value) else round(value, 3)


def _pct(value: float) -> str:
    return f"{100.0 * value:.1f} %"


def explain(doc: dict[str, Any], obs: Observations, config: AdvisorConfig) -> str:
    save, lost = obs.save, obs.lost
    parts: list[str] = []
    if save.source == "reports":
        parts.append(
            f"Checkpoints block training for {format_duration(save.value_s or 0)} "
            f"(median of {plural(save.checkpoints, 'finished checkpoint')}"
            + (f", {plural(save.outliers, 'outlier')} ignored" if save.outliers else "")
            + ")."
        )
    else:
        parts.append(
            f"Checkpoints are assumed to take {format_duration(save.value_s or 0)} (advisor.save_time_s)."
        )
    causes = ", ".join(plural(n, cause.replace("_", " ")) for cause, n in obs.causes.items() if n)
    seen = (
        f"{plural(lost.events, 'work-losing interruption')} in {format_duration(lost.exposure_s)} of uptime"
    )
    seen += f" ({causes})" if causes else ""
    if lost.source == "history":
        parts.append(f"{seen}: M = {format_duration(lost.value_s or 0)}.")
    else:
        parts.append(
            f"{seen}, combined with the configured prior M = {format_duration(lost.prior_s or 0)} "
            f"(weight {lost.prior_weight:g}): M = {format_duration(lost.value_s or 0)}."
        )
    if obs.announced_ids:
        parts.append(
            f"{plural(len(obs.announced_ids), 'interruption')} came with a notice and lost no work, so "
            + ("it does" if len(obs.announced_ids) == 1 else "they do")
            + " not count in M."
        )
    waste = doc["expected_waste"]
    line = f"Checkpoint every {format_duration(doc['interval_s'])} of compute: expected waste {_pct(waste['advised'])}"
    current = doc["current_interval"]["value_s"]
    if current and waste.get("current") is not None:
        line += f", against {_pct(waste['current'])} at the current {format_duration(current)}"
    parts.append(line + ".")
    naive = waste.get("if_every_interruption_lost_work")
    if naive:
        parts.append(
            f"Counting every interruption as lost work would advise {format_duration(naive['interval_s'])} "
            f"({_pct(naive['waste'])} waste)."
        )
    rng = doc.get("interval_range_s")
    level = f"{100 * config.credible_level:.0f} %"
    if rng:
        high = format_duration(rng[1]) if rng[1] is not None else "unbounded"
        parts.append(f"Confidence {doc['confidence']}: {level} range {format_duration(rng[0])} to {high}.")
    else:
        parts.append(f"Confidence {doc['confidence']}.")
    return " ".join(parts)
