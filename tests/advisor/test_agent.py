"""The advisor through the real agent: history on disk, reports over POST /v1/reports, interruptions through
the notice board, and the answer of GET /v1/advice, /v1/status and /metrics."""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import signal
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

from agent.advisor import math as cm
from agent.advisor.cli import register, run
from agent.core.errors import ConfigError
from agent.core.notice import Kind, Observation, format_time, utcnow
from agent.service.daemon import Agent
from tests.support import AgentProcess, agent_config, http_json, running_agent

HOUR = 3600.0
DURATIONS = [230.0, 240.0, 250.0, 240.0, 1800.0]  # one pathological checkpoint


def write_history(base: Path, records: list[dict[str, Any]]) -> None:
    state = base / "state"
    state.mkdir(parents=True, exist_ok=True)
    (state / "history.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def ago(hours: float) -> str:
    return format_time(utcnow() - timedelta(hours=hours))


def gpu_fault(hours_ago: float, nid: str) -> dict[str, Any]:
    at = ago(hours_ago)
    notice = {
        "id": nid,
        "kind": "gpu_fault",
        "severity": "critical",
        "source": "nvml",
        "reason": "XID 79",
        "detected_at": at,
        "deadline": None,
        "drill": False,
        "detail": {},
    }
    return {"time": at, "type": "notice", "notice": notice}


async def post_checkpoints(agent: Agent, durations: list[float]) -> None:
    for step, duration in enumerate(durations, start=1):
        body = {
            "kind": "checkpoint",
            "phase": "finished",
            "step": 100 * step,
            "duration_s": duration,
            "client": {"job": "llm", "rank": 0},
        }
        status, answer = await http_json(agent.config.socket, "POST", "/v1/reports", body)
        assert status < 300, answer


async def test_advice_from_history_and_reported_checkpoints(base: Path) -> None:
    """Four GPU faults in 39 h of earlier uptime and checkpoints of 4 min (median, outlier ignored)."""
    write_history(
        base,
        [
            {"time": ago(40), "type": "agent_start", "boot_id": "old", "previous_clean": None},
            *[gpu_fault(h, f"nvml-{h}") for h in (35, 25, 15, 5)],
            {"time": ago(1), "type": "agent_stop", "boot_id": "old"},
        ],
    )
    async with running_agent(base) as agent:
        await post_checkpoints(agent, DURATIONS)
        status, advice = await http_json(agent.config.socket, "GET", "/v1/advice")
    mtbp = advice["mtbp"]["unannounced"]["value_s"]
    assert (status, advice["save_time"]["value_s"], advice["losses"]["gpu_fault"]) == (200, 240.0, 4)
    assert mtbp == pytest.approx(39 * HOUR / 4, rel=1e-3)
    assert advice["interval_s"] == pytest.approx(cm.exact_interval(240.0, mtbp), rel=1e-4)


async def test_no_advice_without_data_says_why(base: Path) -> None:
    async with running_agent(base) as agent:
        status, advice = await http_json(agent.config.socket, "GET", "/v1/advice")
    assert (status, advice["interval_s"], advice["confidence"], bool(advice["reason"])) == (
        200,
        None,
        "none",
        True,
    )


async def test_live_gpu_faults_count_as_losses(base: Path) -> None:
    settings = {"advisor.coalesce_s": 0.0, "advisor.min_losses": 1}
    async with running_agent(base, settings=settings) as agent:
        await post_checkpoints(agent, [60.0, 60.0, 60.0])
        for i in range(3):
            agent.inject("nvml", Observation(key=f"xid-{i}", kind=Kind.GPU_FAULT, reason="XID 79"))
        _, advice = await http_json(agent.config.socket, "GET", "/v1/advice")
    assert (advice["losses"]["gpu_fault"], advice["interval_s"] is not None) == (3, True)


async def test_prior_gives_advice_before_any_loss(base: Path) -> None:
    settings = {"advisor.prior_mtbp_s": 6 * HOUR, "advisor.prior_weight": 2.0}
    async with running_agent(base, settings=settings) as agent:
        await post_checkpoints(agent, [240.0])
        _, advice = await http_json(agent.config.socket, "GET", "/v1/advice")
    assert (advice["mtbp"]["unannounced"]["source"], advice["confidence"]) == ("prior+history", "low")
    assert advice["interval_s"] == pytest.approx(cm.exact_interval(240.0, 6 * HOUR), rel=1e-3)


async def test_status_carries_advice(base: Path) -> None:
    """The advice's summary is in status (its goodput section is the ledger's: tests/ledger/test_ledger.py)."""
    async with running_agent(base, settings={"advisor.save_time_s": 240.0}) as agent:
        await post_checkpoints(agent, [240.0, 240.0])
        await http_json(agent.config.socket, "GET", "/v1/advice")
        _, status = await http_json(agent.config.socket, "GET", "/v1/status")
    assert 240.0 == status["advice"]["save_time_s"]


async def test_metrics_expose_advice_and_goodput(base: Path) -> None:
    """The advice's gauges, and the one goodput gauge (the ledger's, as `preemptd report`)."""
    settings = {"advisor.prior_mtbp_s": 6 * HOUR}
    async with running_agent(base, settings=settings) as agent:
        await post_checkpoints(agent, [240.0])
        await http_json(agent.config.socket, "GET", "/v1/advice")
        _, text = await http_json(agent.config.socket, "GET", "/metrics")
    assert all(
        name in text
        for name in (
            "preemptd_advice_interval_seconds",
            "preemptd_advice_mtbp_seconds",
            "preemptd_ledger_goodput_ratio",
        )
    )


async def test_flushed_notice_is_announced_and_does_not_count(base: Path) -> None:
    """A termination notice, an emergency checkpoint that finished before the deadline, then the deadline."""
    clock = [datetime.now(timezone.utc)]
    agent = Agent(agent_config(base, {"advisor.save_time_s": 240.0}), clock=lambda: clock[0])
    await agent.start()
    try:
        await post_checkpoints(agent, [240.0])
        notice = agent.inject(
            "aws",
            Observation(
                key="spot", kind=Kind.TERMINATION, reason="spot", deadline=clock[0] + timedelta(minutes=2)
            ),
        )
        assert notice is not None
        body = {
            "kind": "checkpoint",
            "phase": "finished",
            "duration_s": 40.0,
            "emergency": True,
            "notice_id": notice.id,
        }
        await http_json(agent.config.socket, "POST", "/v1/reports", body)
        clock[0] += timedelta(minutes=3)
        _, advice = await http_json(agent.config.socket, "GET", "/v1/advice")
    finally:
        await agent.stop()
    assert (
        advice["announced_interruptions"],
        advice["losses"]["total"],
        advice["emergency_save_time"]["value_s"],
    ) == (
        1,
        0,
        40.0,
    )


async def test_advise_verb_asks_the_running_agent(base: Path) -> None:
    settings = {"advisor.prior_mtbp_s": 6 * HOUR}
    async with running_agent(base, settings=settings) as agent:
        await post_checkpoints(agent, [240.0])
        parser = argparse.ArgumentParser()
        register(parser.add_subparsers())
        args = parser.parse_args(["advise", "--json", "--socket", str(agent.config.socket)])
        out = io.StringIO()
        code = await asyncio.to_thread(run, args, out, io.StringIO())
    doc = json.loads(out.getvalue())
    assert (code, doc["mode"], doc["interval_s"] is not None) == (0, "live", True)


async def test_advisor_marks_the_history_periodically(base: Path) -> None:
    """The advisor hands a periodic ``advice`` record to the agent's history (it bounds how much uptime an
    unclean stop can hide)."""
    async with running_agent(base, settings={"advisor.record_interval_s": 0.1}) as agent:
        recorded: list[dict[str, Any]] = []
        seen = asyncio.Event()
        original = agent.keeper.record

        def spy(record: dict[str, Any]) -> None:
            original(record)
            if record.get("type") == "advice":
                recorded.append(record)
                seen.set()

        agent.keeper.record = spy  # type: ignore[method-assign]
        await asyncio.wait_for(seen.wait(), timeout=5.0)
    assert {"interval_s", "confidence", "save_time_s", "mtbp_s"} <= set(recorded[0])


@pytest.mark.slow
async def test_restart_after_a_killed_agent_counts_as_an_unclean_loss(base: Path) -> None:
    """The agent process is killed (no clean stop), started again, and the advisor counts one loss."""
    proc = AgentProcess(base)
    await proc.start()
    await proc.stop(signal.SIGKILL)
    seen = len(proc.notifications)
    await proc.start(wait_ready=False)
    await proc.wait_notification("READY=1", after=seen)
    try:
        status, advice = await http_json(proc.socket_path, "GET", "/v1/advice")
    finally:
        await proc.stop()
    assert (status, advice["losses"]["unclean_restart"], advice["losses"]["total"]) == (200, 1, 1)


async def test_unusable_advisor_setting_stops_start_up_naming_the_key(base: Path) -> None:
    agent = Agent(agent_config(base, {"advisor.credible_level": 90.0}))
    try:
        with pytest.raises(ConfigError, match=r"advisor\.credible_level"):
            await agent.start()
    finally:
        await agent.stop()


async def test_notice_without_a_flush_while_training_is_a_loss(base: Path) -> None:
    clock = [datetime.now(timezone.utc)]
    agent = Agent(agent_config(base, {"advisor.save_time_s": 240.0}), clock=lambda: clock[0])
    await agent.start()
    try:
        await post_checkpoints(agent, [240.0])
        deadline = clock[0] + timedelta(seconds=30)
        agent.inject(
            "gcp", Observation(key="preempted", kind=Kind.TERMINATION, reason="spot", deadline=deadline)
        )
        clock[0] += timedelta(minutes=1)
        _, advice = await http_json(agent.config.socket, "GET", "/v1/advice")
    finally:
        await agent.stop()
    assert (advice["losses"]["uncovered_notice"], advice["announced_interruptions"]) == (1, 0)
