"""Two-level advice: peer snapshots into other hosts' RAM and durable checkpoints. The first-order math
against shared/reference/snapshots.md's worked example, the fallback to one level, K in steps, the inputs
read from snapshot reports, and a real agent that shows both intervals in `preemptd advise` and status."""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import math
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

from agent.advisor import math as cm
from agent.advisor import two_level as tl
from agent.advisor.advice import advise
from agent.advisor.cli import register, run
from agent.advisor.estimate import check_config, observe
from agent.config import AdvisorConfig
from agent.core.errors import ConfigError
from agent.core.notice import format_time
from agent.service.daemon import Agent
from tests.support import agent_config, http_json

HOUR = 3600.0
MIN = 60.0
# The worked example: δ1 = 2 s, L1 = 20 s, δ2 = 60 s, 1/λ1 = 6 h, 1/λ2 = 48 h.
D1, L1, D2 = 2.0, 20.0, 60.0
RATE1, RATE2 = 1.0 / (6 * HOUR), 1.0 / (48 * HOUR)


# ----- the pure math -----------------------------------------------------------------------------------------


def test_the_worked_example_figure_by_figure() -> None:
    t1 = tl.level(D1, RATE1).first_order_s
    t2 = tl.level(D2, RATE2).first_order_s
    stalls_and_rework, completion = tl.minimum_waste(D1, L1, D2, RATE1, RATE2)
    alone = tl.level(D2, RATE1 + RATE2).first_order_s
    assert (round(t1 / MIN, 1), round(t2 / MIN), round(tl.n_star(D1, D2, RATE1, RATE2), 1)) == (4.9, 76, 15.5)
    assert (round(100 * stalls_and_rework, 1), round(100 * completion, 1)) == (4.0, 0.1)
    # Durable checkpoints alone with the same failures: M = 5.3 h, T ≈ 25 min, waste ≈ 7.9 %.
    assert round(1.0 / (RATE1 + RATE2) / HOUR, 1) == 5.3
    assert round(alone / MIN) == 25
    assert round(100 * tl.single_level_waste(alone - D2, D2, RATE1 + RATE2), 1) == 7.9
    assert tl.steps_between(t1, L1, 1.5) == 196
    assert round(tl.level(D1, 4 * RATE1).first_order_s / MIN, 1) == 2.4


def test_the_closed_form_minimum_is_the_waste_at_n_star_and_p_star() -> None:
    n = tl.n_star(D1, D2, RATE1, RATE2)
    period = math.sqrt(2 * D2 / RATE2)
    stalls_and_rework, completion = tl.minimum_waste(D1, L1, D2, RATE1, RATE2)
    at_optimum = tl.waste(period, n, D1, L1, D2, RATE1, RATE2)
    assert at_optimum == pytest.approx(stalls_and_rework + completion, rel=1e-12)
    assert period / n == pytest.approx(tl.level(D1, RATE1).first_order_s, rel=1e-12)  # T1 = P*/n*
    # Any other pattern wastes more; for a given n, best_period is the minimum over P.
    for p, k in ((0.8 * period, n), (1.2 * period, n), (period, n - 2), (period, n + 2)):
        assert tl.waste(p, k, D1, L1, D2, RATE1, RATE2) > at_optimum
    best = tl.best_period(15, D1, D2, RATE1, RATE2)
    assert tl.waste(best, 15, D1, L1, D2, RATE1, RATE2) < min(
        tl.waste(best * f, 15, D1, L1, D2, RATE1, RATE2) for f in (0.95, 1.05)
    )


def test_restart_terms_add_their_rates() -> None:
    period = 4500.0
    base = tl.waste(period, 15, D1, L1, D2, RATE1, RATE2)
    with_restarts = tl.waste(period, 15, D1, L1, D2, RATE1, RATE2, r1=30.0, r2=600.0)
    assert with_restarts - base == pytest.approx(RATE1 * 30.0 + RATE2 * 600.0, rel=1e-9)


def test_the_plan_applies_dalys_higher_order_correction_per_level() -> None:
    plan = tl.plan(D1, L1, D2, RATE1, RATE2, step_s=1.5)
    assert plan.peer is not None and (plan.levels, plan.every, plan.reason) == (2, 15, None)
    assert plan.peer.interval_s == pytest.approx(cm.daly_higher_order(D1, 6 * HOUR), rel=1e-12)
    assert plan.durable.interval_s == pytest.approx(cm.daly_higher_order(D2, 48 * HOUR), rel=1e-12)
    assert plan.durable_only.interval_s == pytest.approx(cm.daly_higher_order(D2, 1 / (RATE1 + RATE2)))
    # 292.6 s of compute between snapshots: 195 steps (the first-order 293.9 s gives the example's 196).
    assert (round(plan.peer.interval_s, 1), plan.steps) == (292.6, 195)
    assert (round(100 * plan.waste, 1), round(100 * plan.durable_only_waste, 1)) == (4.1, 7.9)
    assert plan.saved == pytest.approx(plan.durable_only_waste - plan.waste)
    assert round(plan.saved * 24, 2) == 0.92  # hours a day
    assert plan.completion_waste == pytest.approx(RATE1 * L1)
    assert 0 < plan.peer_waste < plan.waste


def test_a_rising_hazard_halves_the_peer_interval() -> None:
    calm = tl.plan(D1, L1, D2, RATE1, RATE2, step_s=1.5)
    hazard = tl.plan(D1, L1, D2, 4 * RATE1, RATE2, step_s=1.5)
    assert calm.peer is not None and hazard.peer is not None and hazard.steps is not None
    assert hazard.peer.first_order_s == pytest.approx(calm.peer.first_order_s / 2, rel=1e-12)
    assert round(hazard.peer.interval_s / MIN, 1) == 2.4
    assert hazard.steps == round(hazard.peer.interval_s / 1.5)


def test_snapshots_that_do_not_pay_fall_back_to_one_level_and_say_so() -> None:
    # A snapshot as costly as a durable checkpoint and RAM copies lost more often than the rest: n* < 1.
    plan = tl.plan(60.0, 5.0, 60.0, RATE2, RATE1, step_s=1.5)
    alone = cm.daly_higher_order(60.0, 1.0 / (RATE1 + RATE2))
    assert (plan.levels, plan.peer, plan.every, plan.steps) == (1, None, None, None)
    assert plan.n_star < 1 and plan.reason is not None and "n* = 0.35 < 1" in plan.reason
    assert plan.durable.interval_s == pytest.approx(alone)
    assert (plan.waste, plan.saved) == (plan.durable_only_waste, 0.0)


def test_a_snapshot_that_takes_too_long_to_complete_does_not_pay() -> None:
    """n* > 1, but a completion of 4 h costs λ1·L1 = 67 % of the time."""
    plan = tl.plan(D1, 4 * HOUR, D2, RATE1, RATE2)
    assert plan.n_star > 1 and (plan.levels, plan.peer) == (1, None)
    assert plan.reason is not None and "waste with them" in plan.reason


def test_k_from_the_step_time_and_the_completion_bound() -> None:
    without = tl.plan(D1, L1, D2, RATE1, RATE2)
    assert without.steps is None and without.peer is not None
    assert tl.steps_between(292.6, 20.0, 1.5) == 195
    assert tl.steps_between(292.6, None, 1.5) == 195
    assert tl.steps_between(10.0, 20.0, 1.5) == 14  # ⌈20/1.5⌉: one snapshot in flight at most
    assert tl.steps_between(0.1, None, 1.5) == 1
    # A completion longer than the interval raises both the interval and K.
    slow = tl.plan(D1, 600.0, D2, RATE1, RATE2, step_s=1.5)
    assert slow.peer is not None and (slow.peer.interval_s, slow.steps) == (600.0, 400)
    with pytest.raises(ValueError, match="step time"):
        tl.steps_between(100.0, None, 0.0)


def test_rates_must_be_positive() -> None:
    with pytest.raises(ValueError, match="λ2"):
        tl.n_star(D1, D2, RATE1, 0.0)
    with pytest.raises(ValueError, match="rate"):
        tl.level(D1, math.inf)


def test_the_share_of_losses_that_take_every_ram_copy_is_checked() -> None:
    check_config(AdvisorConfig())
    for bad in (0.0, 1.0, -0.1, math.nan):
        with pytest.raises(ConfigError, match=r"advisor\.ram_loss_share"):
            check_config(AdvisorConfig(ram_loss_share=bad))


# ----- the inputs, from the history --------------------------------------------------------------------------

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


def report(seconds: float, step: int, duration: float, rank: int = 0, **flush: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "kind": "checkpoint",
        "phase": "finished",
        "step": step,
        "duration_s": duration,
        "emergency": False,
        "client": {"job": "llm", "rank": rank},
    }
    if flush:
        doc["flush"] = flush
    return {"time": format_time(T0 + timedelta(seconds=seconds)), "type": "report", "report": doc}


def snapshot_history(step_s: float = 1.5, steps: int = 200) -> list[dict[str, Any]]:
    """Snapshots every ``steps`` steps from two ranks (rank 1 the slower), a durable checkpoint every 15."""
    records: list[dict[str, Any]] = [{"time": format_time(T0), "type": "agent_start", "previous_clean": True}]
    now = 0.0
    for i in range(1, 31):
        now += steps * step_s + D1
        for rank, (stall, complete) in enumerate(((1.5, 18.0), (D1, L1))):
            records.append(report(now, i * steps, stall, rank, tier="snapshot", complete_s=complete))
        if i % 15 == 0:
            now += D2
            records.append(report(now, i * steps, D2, tier="durable"))
    return records


def test_snapshot_reports_give_delta1_l1_and_the_step_time_and_stay_out_of_delta2() -> None:
    config = AdvisorConfig(prior_mtbp_s=5.4 * HOUR, prior_weight=1e6)
    obs = observe(snapshot_history(), T0 + timedelta(hours=3), config)
    snaps = obs.snapshots
    assert snaps is not None and snaps.stall.value_s == D1  # the slowest rank of each snapshot
    assert (snaps.stall.checkpoints, snaps.stall.reports, snaps.complete_s, snaps.completes) == (
        30,
        60,
        L1,
        30,
    )
    assert snaps.step_s == pytest.approx(1.5)
    assert (obs.save.value_s, obs.save.checkpoints) == (D2, 2)  # durable checkpoints only


def test_without_snapshots_the_advice_has_no_two_level_part() -> None:
    records = [
        r for r in snapshot_history() if (r.get("report") or {}).get("flush", {}).get("tier") != "snapshot"
    ]
    config = AdvisorConfig(prior_mtbp_s=5.4 * HOUR)
    obs = observe(records, T0 + timedelta(hours=3), config)
    doc = advise(obs, config, T0 + timedelta(hours=3))
    assert obs.snapshots is None and doc["interval_s"] is not None and "two_level" not in doc


def test_the_advice_takes_lambda2_as_the_configured_share_of_the_unannounced_rate() -> None:
    config = AdvisorConfig(prior_mtbp_s=16 * HOUR / 3, prior_weight=1e9, ram_loss_share=1 / 9)
    now = T0 + timedelta(hours=3)
    doc = advise(observe(snapshot_history(), now, config), config, now)["two_level"]
    assumed = doc["assumption"]
    assert round(assumed["mtbp_peer_repairable_s"] / HOUR, 3) == 6.0
    assert round(assumed["mtbp_all_copies_lost_s"] / HOUR, 3) == 48.0
    assert (doc["levels"], doc["durable"]["every_snapshots"], doc["peer"]["steps"]) == (2, 15, 195)
    assert round(doc["peer"]["first_order_s"] / MIN, 1) == 4.9
    assert round(doc["durable"]["first_order_s"] / MIN) == 76
    assert (doc["expected_waste"]["two_level"], doc["expected_waste"]["durable_only"]) == pytest.approx(
        (0.0409, 0.0791), abs=1e-4
    )
    assert "advisor.ram_loss_share" in doc["explanation"] and "11.1 %" in doc["explanation"]


def test_too_few_snapshots_say_so_and_a_bad_completion_in_the_history_is_skipped() -> None:
    records = snapshot_history()[:5]  # the start, then two snapshots of two ranks
    records[1]["report"]["flush"]["complete_s"] = -5.0
    records[3]["report"]["flush"]["complete_s"] = "20"
    config = AdvisorConfig(prior_mtbp_s=5.4 * HOUR, save_time_s=D2, min_reports=3)
    now = T0 + timedelta(hours=1)
    doc = advise(observe(records, now, config), config, now)["two_level"]
    assert (doc["levels"], doc["peer"], doc["snapshots"]["completes"]) == (None, None, 2)
    assert doc["snapshots"]["complete_s"] == L1  # rank 1's of both snapshots; rank 0's were unusable
    assert doc["reason"] == "too few peer snapshots (2 reported, 3 needed)"


# ----- a real agent -------------------------------------------------------------------------------------------


async def post(agent: Agent, body: dict[str, Any]) -> tuple[int, Any]:
    return await http_json(agent.config.socket, "POST", "/v1/reports", body)


async def feed(agent: Agent, clock: list[datetime]) -> None:
    """Ten snapshots 200 steps of 1.5 s apart from two ranks, and two durable checkpoints, over the socket."""
    for i in range(1, 11):
        clock[0] += timedelta(seconds=200 * 1.5 + D1)
        for rank in (0, 1):
            body = {
                "kind": "checkpoint",
                "phase": "finished",
                "emergency": False,
                "step": 200 * i,
                "duration_s": D1 - 0.5 * rank,
                "bytes": 10**9,
                "flush": {"tier": "snapshot", "complete_s": L1 - rank},
                "client": {"job": "llm", "rank": rank},
            }
            status, answer = await post(agent, body)
            assert status < 300, answer
        if i % 5 == 0:
            clock[0] += timedelta(seconds=D2)
            durable = {"kind": "checkpoint", "phase": "finished", "step": 200 * i, "duration_s": D2}
            status, answer = await post(agent, {**durable, "client": {"job": "llm", "rank": 0}})
            assert status < 300, answer


async def advise_verb(agent: Agent, *flags: str) -> tuple[int, str]:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["advise", *flags, "--socket", str(agent.config.socket)])
    out = io.StringIO()
    code = await asyncio.to_thread(run, args, out, io.StringIO())
    return code, out.getvalue()


async def with_agent(base: Path, body: Callable[[Agent, list[datetime]], Any]) -> Any:
    clock = [datetime.now(timezone.utc)]
    settings = {
        "advisor.prior_mtbp_s": 16 * HOUR / 3,
        "advisor.prior_weight": 1e6,
        "advisor.ram_loss_share": 1 / 9,
    }
    agent = Agent(agent_config(base, settings), clock=lambda: clock[0])
    await agent.start()
    try:
        return await body(agent, clock)
    finally:
        await agent.stop()


async def test_a_real_agent_shows_both_intervals_in_advise_and_status(base: Path) -> None:
    async def body(agent: Agent, clock: list[datetime]) -> tuple[Any, ...]:
        await feed(agent, clock)
        code, shown = await advise_verb(agent, "--json")
        text_code, text = await advise_verb(agent)
        _, status = await http_json(agent.config.socket, "GET", "/v1/status")
        return code, json.loads(shown), text_code, text, status

    code, doc, text_code, text, status = await with_agent(base, body)
    two = doc["two_level"]
    assert (code, text_code, doc["mode"], doc["save_time"]["value_s"]) == (0, 0, "live", D2)
    assert (two["snapshots"]["stall"]["value_s"], two["snapshots"]["complete_s"]) == (D1, L1)
    assert two["snapshots"]["step_time_s"] == pytest.approx(1.5)
    assert (two["levels"], two["peer"]["steps"], two["durable"]["every_snapshots"]) == (2, 195, 15)
    assert round(two["peer"]["interval_s"] / MIN, 1) == 4.9
    assert round(two["durable"]["first_order_s"] / MIN) == 76
    assert round(100 * two["expected_waste"]["durable_only"], 1) == 7.9
    assert two["saves"]["hours_per_day"] == pytest.approx(0.92, abs=0.01)
    assert two["assumption"]["ram_loss_share"] == pytest.approx(1 / 9)
    summary = status["advice"]["two_level"]
    assert (summary["peer_steps"], summary["every_snapshots"], summary["levels"]) == (195, 15, 2)
    assert summary["peer_interval_s"] == two["peer"]["interval_s"]
    assert summary["saves"] == two["saves"]
    assert [] == [line for line in text.splitlines() if len(line) > 80], text
    flat = " ".join(text.split())
    assert "Peer snapshot every 4m53s of compute (195 steps of 1.5s)" in flat, text
    assert "durable checkpoint every 1h15m (every 15 snapshots)" in flat, text
    assert "snapshots save 3.8 % of wall time, 0.9 h a day" in flat, text


async def test_a_real_agent_without_snapshots_shows_todays_advice(base: Path) -> None:
    async def body(agent: Agent, clock: list[datetime]) -> tuple[Any, ...]:
        durable = {"kind": "checkpoint", "phase": "finished", "step": 1, "duration_s": D2}
        await post(agent, {**durable, "flush": {"tier": "durable"}, "client": {"job": "llm"}})
        _, advice = await http_json(agent.config.socket, "GET", "/v1/advice")
        _, status = await http_json(agent.config.socket, "GET", "/v1/status")
        return advice, status

    advice, status = await with_agent(base, body)
    assert advice["interval_s"] is not None
    assert ("two_level" in advice, "two_level" in status["advice"]) == (False, False)


@pytest.mark.parametrize(
    ("value", "expected"),
    [(-1.0, "from 0 to 604800"), ("20s", "finite number of seconds"), (1e9, "from 0 to 604800")],
)
async def test_a_malformed_completion_time_is_refused_naming_the_field(
    base: Path, value: Any, expected: str
) -> None:
    async def body(agent: Agent, clock: list[datetime]) -> tuple[int, Any]:
        raw = {
            "kind": "checkpoint",
            "phase": "finished",
            "step": 1,
            "duration_s": D1,
            "flush": {"tier": "snapshot", "complete_s": value},
        }
        return await http_json(
            agent.config.socket, "POST", "/v1/reports", raw=json.dumps(raw, allow_nan=True).encode()
        )

    status, answer = await with_agent(base, body)
    assert status == 400 and "'flush.complete_s'" in answer["error"] and expected in answer["error"], answer
