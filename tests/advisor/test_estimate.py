"""The advisor's estimators over history records: δ from reports, M from losses, and the advice."""

from __future__ import annotations

import math
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest

from agent.advisor import math as cm
from agent.advisor.advice import advise
from agent.advisor.estimate import observe
from agent.advisor.stats import gamma_p, gamma_ppf, mad_sigma, median, rate_interval
from agent.config import AdvisorConfig
from agent.core.notice import format_time

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)
HOUR = 3600.0


def at(hours: float) -> str:
    return format_time(T0 + timedelta(hours=hours))


def start(hours: float, clean: bool | None = True) -> dict[str, Any]:
    return {"time": at(hours), "type": "agent_start", "boot_id": f"b{hours}", "previous_clean": clean}


def stop(hours: float) -> dict[str, Any]:
    return {"time": at(hours), "type": "agent_stop"}


def notice(
    hours: float,
    nid: str,
    kind: str = "termination",
    lead_s: float | None = 120.0,
    drill: bool = False,
    event: str = "notice",
) -> dict[str, Any]:
    deadline = at(hours + lead_s / HOUR) if lead_s is not None else None
    doc = {
        "id": nid,
        "kind": kind,
        "severity": "critical",
        "source": "aws",
        "reason": "r",
        "detected_at": at(hours),
        "deadline": deadline,
        "drill": drill,
        "detail": {},
    }
    if event == "cleared":
        doc["cleared_at"] = at(hours)
    return {"time": at(hours), "type": event, "notice": doc}


def report(
    hours: float,
    duration_s: float,
    step: int | None = None,
    emergency: bool = False,
    notice_id: str | None = None,
    rank: int = 0,
    phase: str = "finished",
) -> dict[str, Any]:
    doc = {
        "kind": "checkpoint",
        "phase": phase,
        "received_at": at(hours),
        "step": step,
        "duration_s": duration_s,
        "emergency": emergency,
        "notice_id": notice_id,
        "client": {"job": "j", "rank": rank},
    }
    return {"time": at(hours), "type": "report", "report": doc}


def periodic(
    first_hour: float, count: int, every_h: float, duration_s: float = 240.0
) -> list[dict[str, Any]]:
    return [report(first_hour + i * every_h, duration_s, step=1000 * (i + 1)) for i in range(count)]


CONFIG = AdvisorConfig(min_losses=3)


# --- statistics ---------------------------------------------------------------------------------------


def test_median_of_even_count_is_mean_of_middle_pair() -> None:
    assert median([4.0, 1.0, 3.0, 2.0]) == 2.5


def test_mad_sigma_ignores_one_huge_outlier() -> None:
    assert mad_sigma([10.0, 11.0, 9.0, 10.0, 1e6]) == pytest.approx(1.4826, rel=1e-3)


@pytest.mark.parametrize("shape", [0.5, 1.0, 3.0, 12.5, 200.0])
def test_gamma_p_matches_scipy(shape: float) -> None:
    special = pytest.importorskip("scipy.special")
    xs = [0.01, 0.5, 1.0, shape, 3 * shape + 5]
    assert [float(special.gammainc(shape, x)) for x in xs] == pytest.approx(
        [gamma_p(shape, x) for x in xs], abs=1e-13
    )


@pytest.mark.parametrize("shape", [0.5, 1.0, 3.0, 12.5, 200.0])
def test_gamma_ppf_matches_scipy(shape: float) -> None:
    # scipy.stats.gamma.ppf(q, a) is scipy.special.gammaincinv(a, q); special imports in a fraction of the time
    special = pytest.importorskip("scipy.special")
    qs = [0.001, 0.05, 0.5, 0.95, 0.999]
    assert [float(special.gammaincinv(shape, q)) for q in qs] == pytest.approx(
        [gamma_ppf(q, shape) for q in qs], rel=1e-10
    )


def test_zero_events_give_the_rule_of_three_upper_rate() -> None:
    """No event in T: the 95 % one-sided bound on the rate is about 3/T (exactly -ln 0.05 / T)."""
    _, high = rate_interval(0, 100.0, level=0.90)
    assert high == pytest.approx(-math.log(0.05) / 100.0, rel=1e-12)


# --- save time ----------------------------------------------------------------------------------------


def test_save_time_is_the_median_and_ignores_outliers() -> None:
    durations = [230.0, 250.0, 240.0, 235.0, 245.0, 240.0, 5000.0, 238.0, 242.0]
    records = [start(0)] + [report(1 + i, d, step=i + 1) for i, d in enumerate(durations)]
    obs = observe(records, T0 + timedelta(hours=11), CONFIG)
    assert (obs.save.value_s, obs.save.outliers) == (240.0, 1)


def test_ranks_of_one_checkpoint_count_once_at_the_slowest_rank() -> None:
    records = [start(0), report(1, 200.0, step=10, rank=0), report(1.001, 260.0, step=10, rank=1)]
    obs = observe(records, T0 + timedelta(hours=2), CONFIG)
    assert (obs.save.checkpoints, obs.save.reports, obs.save.value_s) == (1, 2, 260.0)


def test_emergency_checkpoints_are_kept_apart_from_periodic_ones() -> None:
    records = [start(0), *periodic(1, 3, 1.0, 240.0), report(5, 30.0, emergency=True, notice_id="n1")]
    obs = observe(records, T0 + timedelta(hours=6), CONFIG)
    assert (obs.save.value_s, obs.emergency_save.value_s) == (240.0, 30.0)


def test_configured_save_time_is_used_until_reports_arrive() -> None:
    obs = observe([start(0)], T0 + timedelta(hours=1), AdvisorConfig(save_time_s=120.0))
    assert (obs.save.value_s, obs.save.source) == (120.0, "config")


def test_failed_and_started_reports_do_not_count_as_save_times() -> None:
    records = [start(0), report(1, 10.0, step=1, phase="failed"), report(1, 0.0, step=2, phase="started")]
    assert observe(records, T0 + timedelta(hours=2), CONFIG).save.value_s is None


# --- losses and M ---------------------------------------------------------------------------------------


def test_gpu_faults_are_losses() -> None:
    records = [start(0), *[notice(10 * i + 5, f"g{i}", kind="gpu_fault", lead_s=None) for i in range(3)]]
    obs = observe(records, T0 + timedelta(hours=30), CONFIG)
    assert (obs.causes["gpu_fault"], obs.lost.value_s) == (3, 10 * HOUR)


def test_drills_never_count() -> None:
    records = [start(0), notice(1, "d", kind="gpu_fault", drill=True), notice(2, "d2", drill=True)]
    obs = observe(records, T0 + timedelta(hours=3), CONFIG)
    assert (len(obs.losses), obs.drills_ignored, obs.announced_ids) == (0, 2, ())


def test_notice_flushed_before_its_deadline_is_announced_not_lost() -> None:
    records = [
        start(0),
        report(1, 240.0, step=1),
        notice(2, "n1"),
        report(2.01, 40.0, emergency=True, notice_id="n1"),
    ]
    obs = observe(records, T0 + timedelta(hours=3), CONFIG)
    assert (len(obs.losses), obs.announced_ids) == (0, ("n1",))


def test_notice_whose_flush_finished_after_the_deadline_is_a_loss() -> None:
    records = [
        start(0),
        report(1, 240.0, step=1),
        notice(2, "n1"),
        report(2.05, 300.0, emergency=True, notice_id="n1"),
    ]
    obs = observe(records, T0 + timedelta(hours=3), CONFIG)
    assert obs.causes["uncovered_notice"] == 1


def test_notice_with_no_flush_while_training_is_a_loss() -> None:
    records = [start(0), report(1, 240.0, step=1), notice(2, "n1")]
    obs = observe(records, T0 + timedelta(hours=3), CONFIG)
    assert obs.causes["uncovered_notice"] == 1


def test_emergency_report_without_notice_id_covers_by_time() -> None:
    records = [start(0), report(1, 240.0, step=1), notice(2, "n1"), report(2.01, 40.0, emergency=True)]
    obs = observe(records, T0 + timedelta(hours=3), CONFIG)
    assert obs.announced_ids == ("n1",)


def test_notice_before_its_deadline_is_pending() -> None:
    records = [start(0), report(1, 240.0, step=1), notice(2, "n1", lead_s=600)]
    obs = observe(records, T0 + timedelta(hours=2, minutes=1), CONFIG)
    assert (obs.pending_notices, len(obs.losses)) == (1, 0)


def test_notice_withdrawn_before_its_deadline_is_no_interruption() -> None:
    records = [
        start(0),
        report(1, 240.0, step=1),
        notice(2, "n1", lead_s=600),
        notice(2.05, "n1", event="cleared", lead_s=600),
    ]
    obs = observe(records, T0 + timedelta(hours=3), CONFIG)
    assert (len(obs.losses), obs.announced_ids) == (0, ())


def test_rebalance_recommendations_are_not_interruptions() -> None:
    records = [start(0), report(1, 240.0, step=1), notice(2, "r1", kind="rebalance")]
    assert observe(records, T0 + timedelta(hours=3), CONFIG).losses == ()


def test_unclean_restart_is_a_loss() -> None:
    records = [start(0), report(1, 240.0, step=1), start(5, clean=False)]
    obs = observe(records, T0 + timedelta(hours=6), CONFIG)
    assert obs.causes["unclean_restart"] == 1


def test_clean_restart_is_no_loss() -> None:
    records = [start(0), stop(4), start(5, clean=True)]
    assert observe(records, T0 + timedelta(hours=6), CONFIG).losses == ()


def test_unclean_restart_after_a_gpu_fault_counts_once() -> None:
    records = [start(0), notice(3, "g", kind="gpu_fault", lead_s=None), start(3.5, clean=False)]
    obs = observe(records, T0 + timedelta(hours=6), CONFIG)
    assert (len(obs.losses), obs.causes["gpu_fault"]) == (1, 1)


def test_gpu_faults_close_together_count_as_one_interruption() -> None:
    records = [start(0), *[notice(3 + i / 3600, f"g{i}", kind="gpu_fault", lead_s=None) for i in range(8)]]
    assert len(observe(records, T0 + timedelta(hours=6), CONFIG).losses) == 1


def test_uptime_excludes_time_the_agent_was_stopped() -> None:
    records = [start(0), stop(10), start(20), {"time": at(25), "type": "advice"}]
    assert observe(records, T0 + timedelta(hours=30), CONFIG).exposure_s == 20 * HOUR


def test_too_few_losses_and_no_prior_gives_no_m_but_a_lower_bound() -> None:
    obs = observe(
        [start(0), notice(5, "g", kind="gpu_fault", lead_s=None)], T0 + timedelta(hours=100), CONFIG
    )
    assert (obs.lost.value_s, obs.lost.lower_bound_s is not None) == (None, True)


def test_prior_alone_gives_m_equal_to_the_prior() -> None:
    config = AdvisorConfig(prior_mtbp_s=6 * HOUR, prior_weight=2.0)
    obs = observe([], T0, config)
    assert (obs.lost.value_s, obs.lost.source) == (6 * HOUR, "prior")


def test_prior_and_history_combine_as_pseudo_observations() -> None:
    """Prior 6 h with weight 2 plus 2 losses in 10 h: M = (2·6 h + 10 h) / (2 + 2) = 5.5 h."""
    config = AdvisorConfig(prior_mtbp_s=6 * HOUR, prior_weight=2.0, coalesce_s=0)
    records = [
        start(0),
        notice(3, "g1", kind="gpu_fault", lead_s=None),
        notice(7, "g2", kind="gpu_fault", lead_s=None),
    ]
    obs = observe(records, T0 + timedelta(hours=10), config)
    assert obs.lost.value_s == pytest.approx(5.5 * HOUR)


def test_current_interval_is_inferred_from_periodic_checkpoint_times() -> None:
    records = [start(0), *periodic(1, 6, 1.0, 240.0)]
    obs = observe(records, T0 + timedelta(hours=8), CONFIG)
    assert (obs.current_interval_s, obs.current_source) == (pytest.approx(HOUR - 240.0), "reports")


# --- the advice document ---------------------------------------------------------------------------------


def _history_with(losses: int, every_h: float = 10.0) -> list[dict[str, Any]]:
    records = [start(0), *periodic(0.5, 20, 0.5, 240.0)]
    records += [notice(every_h * (i + 1), f"g{i}", kind="gpu_fault", lead_s=None) for i in range(losses)]
    return records


def test_advice_is_null_with_a_reason_when_data_is_missing() -> None:
    doc = advise(observe([start(0)], T0 + timedelta(hours=1), CONFIG), CONFIG, T0)
    assert (doc["interval_s"], doc["confidence"], "save time" in doc["reason"]) == (None, "none", True)


def test_advice_uses_the_exact_optimum_for_measured_inputs() -> None:
    now = T0 + timedelta(hours=40)
    obs = observe(_history_with(4), now, CONFIG)
    doc = advise(obs, CONFIG, now)
    assert doc["interval_s"] == pytest.approx(cm.exact_interval(240.0, 10 * HOUR), rel=1e-6)


def test_advice_with_few_observations_says_its_confidence_is_low() -> None:
    now = T0 + timedelta(hours=40)
    config = AdvisorConfig(min_losses=1)
    doc = advise(observe(_history_with(2, every_h=15), now, config), config, now)
    assert (
        doc["confidence"],
        doc["interval_range_s"][0] < doc["interval_s"] < doc["interval_range_s"][1],
    ) == (
        "low",
        True,
    )


def test_advice_compares_the_current_interval() -> None:
    now = T0 + timedelta(hours=40)
    config = AdvisorConfig(current_interval_s=600.0)
    doc = advise(observe(_history_with(4), now, config), config, now)
    assert doc["expected_waste"]["current"] > doc["expected_waste"]["advised"]


def test_advice_explains_itself() -> None:
    now = T0 + timedelta(hours=40)
    doc = advise(observe(_history_with(4), now, CONFIG), CONFIG, now)
    assert "4 gpu fault" in doc["explanation"] and "expected waste" in doc["explanation"]


def test_announced_interruptions_lengthen_the_interval_against_counting_them_all() -> None:
    now = T0 + timedelta(hours=40)
    records = _history_with(3, every_h=12)
    for i in range(6):
        records += [
            notice(5 + 5 * i + 0.3, f"n{i}"),
            report(5 + 5 * i + 0.31, 40.0, emergency=True, notice_id=f"n{i}"),
        ]
    records.sort(key=lambda r: r["time"])
    doc = advise(observe(records, now, CONFIG), CONFIG, now)
    naive = doc["expected_waste"]["if_every_interruption_lost_work"]
    assert (
        doc["announced_interruptions"],
        naive["interval_s"] < doc["interval_s"],
        naive["waste"] > doc["expected_waste"]["advised"],
    ) == (6, True, True)
