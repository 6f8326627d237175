"""The preemption cost ledger on a real agent with a real SQLite file: a scripted week of drills, flushes,
resumes and periodic checkpoints through the socket (the agent's clock injected) gives `preemptd report`'s
exact totals, hand-computed here; a restart keeps them; a damaged file is moved aside for a fresh one."""

from __future__ import annotations

import argparse
import asyncio
import io
import math
import re
import signal
import sqlite3
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import structlog

from agent.cli.report import register, run
from agent.client.reporting import Reporter, client_info
from agent.core.errors import ConfigError
from agent.ledger.component import LedgerComponent
from agent.service.daemon import Agent
from tests.ledger.support import T0, Week, report
from tests.support import AgentProcess, agent_config, http_json, short_tmp

H = 3600.0


async def script_week(week: Week, restart: bool = False) -> tuple[str, str]:
    """Job A: two ranks on one GPU each; job B: one process on four GPUs. Hours from T0:

    A registers at 0 (pids 100, 101), checkpoints steps 100 (ranks take 60 and 120 s) and 200 at 1 h and
    2 h; drill N1 at 2.5 h (deadline 2 min later), A flushes step 250 in 30 s at 2.5 h + 1 min; A comes back
    at 2 h 40 (pids 200, 201), checkpoints step 400 at 4 h; drill N2 at 5 h (deadline 1 min later): A
    starts step 450 and fails, falling back to 400; A comes back at 5 h 10 (pids 300, 301), checkpoints step
    500 at 6 h; [restart of the agent]; A comes back unannounced at 7.5 h (pids 400, 401) and checkpoints
    step 600 at 8 h. B registers at 3 h, checkpoints step 10 (120 s, 4 GB) at 4 h, flushes step 11 for N2
    in 20 s at 5 h + 30 s, checkpoints step 20 at 6 h. Every rank's save is 1 GB for A."""
    gb = 10**9
    week.at(0)
    await week.register("A", 100, 0)
    await week.register("A", 101, 1)
    week.at(1)
    await week.checkpoint("A", 100, 100, 60.0, gb, 0)
    await week.checkpoint("A", 101, 100, 120.0, gb, 1)
    week.at(2)
    for pid, rank in ((100, 0), (101, 1)):
        await week.checkpoint("A", pid, 200, 60.0, gb, rank)
    week.at(2.5)
    n1 = await week.drill(120)
    week.at(2.5 + 1 / 60)
    for pid, rank in ((100, 0), (101, 1)):
        await week.checkpoint("A", pid, 250, 30.0, gb, rank, emergency=True, notice_id=n1)
    week.at(2 + 40 / 60)
    await week.register("A", 200, 0)
    await week.register("A", 201, 1)
    week.at(3)
    await week.register("B", 500, gpus=4)
    week.at(4)
    for pid, rank in ((200, 0), (201, 1)):
        await week.checkpoint("A", pid, 400, 60.0, gb, rank)
    await week.checkpoint("B", 500, 10, 120.0, 4 * gb)
    week.at(5)
    n2 = await week.drill(60)
    for pid, rank in ((200, 0), (201, 1)):
        client = {"job": "A", "pid": pid, "rank": rank}
        await week.post(
            {
                "kind": "checkpoint",
                "phase": "started",
                "step": 450,
                "emergency": True,
                "notice_id": n2,
                "client": client,
            }
        )
        await week.post(
            {
                "kind": "checkpoint",
                "phase": "failed",
                "step": 450,
                "emergency": True,
                "notice_id": n2,
                "flush": {"fallback_step": 400},
                "client": client,
            }
        )
    week.at(5 + 0.5 / 60)
    await week.checkpoint("B", 500, 11, 20.0, 4 * gb, emergency=True, notice_id=n2)
    week.at(5 + 10 / 60)
    await week.register("A", 300, 0)
    await week.register("A", 301, 1)
    week.at(6)
    for pid, rank in ((300, 0), (301, 1)):
        await week.checkpoint("A", pid, 500, 60.0, gb, rank)
    await week.checkpoint("B", 500, 20, 120.0, 4 * gb)
    if restart:
        await week.stop()
        await week.start()
    week.at(7.5)
    await week.register("A", 400, 0)
    await week.register("A", 401, 1)
    week.at(8)
    for pid, rank in ((400, 0), (401, 1)):
        await week.checkpoint("A", pid, 600, 60.0, gb, rank)
    week.at(7 * 24)  # the report is made at the end of the week
    return n1, n2


# The hand-computed figures of the scripted week.
# A: 2 GPUs, 0 h to 8 h: 16 GPU-h. Periodic checkpoints 120+60+60+60+60 = 360 s x 2 GPUs = 0.2 GPU-h; the
# flush of step 250: 30 s x 2 = 1/60 GPU-h. Redone: N2 was lost (deadline 5 h 01 - checkpoint 4 h = 3660 s)
# and the unannounced one at 7.5 h (7.5 h - 6 h = 5400 s): 9060 s x 2 = 5.0333 GPU-h. Restarts, from when
# each notice stopped the job to its return: N1's flush ended at 2 h 31, A was back at 2 h 40: 540 s; N2's
# flush was lost, so its deadline 5 h 01 to 5 h 10: 540 s; 1080 s x 2 = 0.6 GPU-h. (Until the timeline
# rewrite the first was counted from N1's deadline, 2 h 32: the minute A was down before it counted as
# useful.) Steps redone: 450 - 400 = 50. Goodput 1 - (0.2 + 1/60 + 5.0333 + 0.6) / 16 = 0.6344.
# B: 4 GPUs, 3 h to 6 h: 12 GPU-h; checkpoints 240 s x 4 = 0.2667 GPU-h, flush 20 s x 4 = 0.0222 GPU-h.
A_LOST = (0.2 + 30 * 2 / H + 9060 * 2 / H + 1080 * 2 / H) / 16
B_LOST = (240 * 4 / H + 20 * 4 / H) / 12
TOTAL_OVERHEAD = 0.2 + 30 * 2 / H + 9060 * 2 / H + 1080 * 2 / H + 240 * 4 / H + 20 * 4 / H


def expected_total() -> dict[str, Any]:
    return {
        "jobs": 2,
        "gpus": 6,
        "job_hours": 11.0,
        "gpu_hours": 28.0,
        "interruptions": {"announced": 3, "unannounced": 1, "total": 4},
        "notice_coverage": 0.75,
        "flushes": {"in_time": 2, "late": 0, "lost": 1},
        "checkpoints": 7,
        "checkpoint_bytes": 24 * 10**9,
        "checkpoint_gpu_hours": round(0.2 + 240 * 4 / H, 4),
        "flush_gpu_hours": round(30 * 2 / H + 20 * 4 / H, 4),
        "redone_gpu_hours": round(9060 * 2 / H, 4),
        "restart_gpu_hours": round(1080 * 2 / H, 4),
        "steps_redone": 50,
        "useful_gpu_hours": round(28 - TOTAL_OVERHEAD, 4),
        "goodput": round(1 - TOTAL_OVERHEAD / 28, 4),
        "notice_benefit": {
            "covered_share": 0.5,
            "interval_factor": round(1 / math.sqrt(0.5), 4),
            "checkpoint_gpu_hours_saved": round((0.2 + 240 * 4 / H) * (1 / math.sqrt(0.5) - 1), 4),
            "checkpoint_bytes_saved": round(18 * 10**9 * (1 / math.sqrt(0.5) - 1)),
        },
        "cost": {"missing": ["cost.spot_per_gpu_hour", "cost.on_demand_per_gpu_hour"]},
        "reforms": {
            "reformed": 0,
            "left": 0,
            "stopped": 0,
            "stopped_reasons": [],
            "reform_s": 0.0,
            "halted_gpu_seconds": 0.0,
            "relaunch_s": None,
            "relaunches_measured": 0,
            "saved_reforms": 0,
            "saved_gpu_hours": None,
        },
        "snapshots": {  # no peer snapshot reported
            "taken": 0,
            "failed": 0,
            "stall_gpu_hours": 0.0,
            "complete_s_median": None,
            "bytes": None,
            "bytes_reported": 0,
            "interval": {"steps": None, "seconds": None, "pairs": 0},
            "durable_interval": {"steps": None, "seconds": None, "pairs": 0},
            "interruptions": 0,
            "resumed_from_snapshot": 0,
            "saved_steps": 0,
            "saved_gpu_hours": 0.0,
        },
    }


@pytest.fixture
def base() -> Path:
    return short_tmp("pd-ledger-")


async def test_a_scripted_week_gives_the_hand_computed_totals(base: Path) -> None:
    """Drills, flushes (in time, lost), resumes (announced, unannounced) and periodic checkpoints of two jobs
    through the socket: the report's totals are the hand-computed ones."""
    week = Week(base)
    await week.start()
    try:
        await script_week(week)
        doc = await report(week.socket, "--drills", "--since", "30d")
    finally:
        await week.stop()
    assert expected_total() == doc["total"]


async def test_each_job_has_its_own_figures(base: Path) -> None:
    """Job A's and job B's goodput, interruptions and GPU-hours, apart."""
    week = Week(base)
    await week.start()
    try:
        await script_week(week)
        doc = await report(week.socket, "--drills", "--since", "30d")
    finally:
        await week.stop()
    a, b = doc["jobs"]["A"], doc["jobs"]["B"]
    assert (
        (2, 16.0, {"announced": 2, "unannounced": 1, "total": 3}, round(1 - A_LOST, 4)),
        (4, 12.0, {"announced": 1, "unannounced": 0, "total": 1}, round(1 - B_LOST, 4)),
    ) == (
        (a["gpus"], a["gpu_hours"], a["interruptions"], a["goodput"]),
        (b["gpus"], b["gpu_hours"], b["interruptions"], b["goodput"]),
    )


async def test_flushes_and_resumes_are_listed_with_their_outcome(base: Path) -> None:
    """Each flush with its outcome and slack; each resume with the step it came back from."""
    week = Week(base)
    await week.start()
    try:
        n1, n2 = await script_week(week)
        doc = await report(week.socket, "--drills", "--since", "30d")
    finally:
        await week.stop()
    flushes = sorted(
        (f["job"], f["notice_id"], f["outcome"], f["slack_s"], f["fallback_step"]) for f in doc["flushes"]
    )
    resumes = [
        (r["job"], r["from_step"], r["steps_redone"], r["announced"], r["notice_id"]) for r in doc["resumes"]
    ]
    assert (
        sorted(
            [("A", n1, "in_time", 60.0, None), ("A", n2, "lost", None, 400), ("B", n2, "in_time", 30.0, None)]
        ),
        [("A", 250, 0, True, n1), ("A", 400, 50, True, n2), ("A", 500, 0, False, None)],
    ) == (flushes, resumes)


async def test_a_restart_mid_week_keeps_the_totals(base: Path) -> None:
    """The agent stops and starts again between 6 h and 7.5 h: the same totals as without the restart."""
    week = Week(base)
    await week.start()
    try:
        await script_week(week, restart=True)
        doc = await report(week.socket, "--drills", "--since", "30d")
    finally:
        await week.stop()
    assert expected_total() == doc["total"]


async def test_drills_are_not_interruptions_unless_asked(base: Path) -> None:
    """Without --drills the drill notices are counted as notices only; the unannounced resume remains."""
    week = Week(base)
    await week.start()
    try:
        await script_week(week)
        doc = await report(week.socket, "--since", "30d")
    finally:
        await week.stop()
    assert (
        {"announced": 0, "unannounced": 1, "total": 1},
        2,
    ) == (doc["total"]["interruptions"], doc["notices"]["drills"])


async def test_prices_give_the_discount_and_the_break_even_rate(base: Path, tmp_path: Path) -> None:
    """Spot 1.00 and on demand 3.00 per GPU-hour, storage 0.02 per GB-month kept a month, 0.005 per 1000
    requests: the realised discount and the break-even rate of docs/ledger.md, by hand."""
    prices = tmp_path / "prices.toml"
    prices.write_text(
        "[cost]\nspot_per_gpu_hour = 1.0\non_demand_per_gpu_hour = 3.0\n"
        "storage_per_gb_month = 0.02\nper_1000_requests = 0.005\nkeep_days = 30\n"
    )
    week = Week(base)
    await week.start()
    try:
        await script_week(week)
        doc = await report(week.socket, "--drills", "--since", "30d", "--prices", str(prices))
    finally:
        await week.stop()
    storage = 24 * 0.02 * 1 + 15 / 1000 * 0.005  # 24 GB for a month; 15 saves (12 of A's ranks, 3 of B)
    spot = 28 * 1.0 + storage
    useful = 28 - TOTAL_OVERHEAD
    c = (0.2 + 240 * 4 / H) / 28
    ell = (TOTAL_OVERHEAD - (0.2 + 240 * 4 / H)) / 4 / (28 / 11)  # job-hours lost per interruption
    break_even = 24 * (1 - c - (1.0 + storage / 28) / 3.0) / ell
    cost = doc["total"]["cost"]
    assert (
        [],
        round(spot, 4),
        round(useful * 3.0, 4),
        round(1 - spot / (useful * 3.0), 4),
        round(24 * 4 / 11, 4),
        round(break_even, 4),
    ) == (
        cost["missing"],
        cost["spot"],
        cost["on_demand_equivalent"],
        cost["effective_discount"],
        cost["preemptions_per_day"],
        cost["break_even_per_day"],
    )


async def test_missing_prices_are_said_not_printed_as_zeros(base: Path) -> None:
    """Without [cost] prices the text report says which are missing and prints no money."""
    week = Week(base)
    await week.start()
    try:
        await week.checkpoint("A", 100, 1, 10.0, 1000, 0)
        parser = argparse.ArgumentParser()
        register(parser.add_subparsers())
        args = parser.parse_args(["report", "--socket", str(week.socket)])
        out = io.StringIO()
        code = await asyncio.to_thread(run, args, out, io.StringIO())
    finally:
        await week.stop()
    text = out.getvalue()
    assert (0, True, False) == (
        code,
        "prices missing: set cost.spot_per_gpu_hour, cost.on_demand_per_gpu_hour" in " ".join(text.split()),
        "spot cost" in text,
    )


async def test_a_corrupt_ledger_is_moved_aside_and_a_fresh_one_starts(base: Path) -> None:
    """Garbage where the ledger should be: the agent logs ledger_corrupt naming where it moved the file,
    keeps running, and records into a fresh ledger."""
    state = base / "state"
    state.mkdir(parents=True)
    (state / "ledger.sqlite").write_bytes(b"this is not a database\n" * 100)
    week = Week(base)
    with structlog.testing.capture_logs() as logs:
        await week.start()
        try:
            await week.checkpoint("A", 100, 1, 10.0, 1000, 0)
            doc = await report(week.socket)
            _, status = await http_json(week.socket, "GET", "/v1/status")
        finally:
            await week.stop()
    corrupt = [e for e in logs if e["event"] == "ledger_corrupt"]
    moved = Path(corrupt[0]["moved_to"])
    kept = await asyncio.to_thread(moved.read_bytes)
    assert (1, True, b"this is not", 1, str(moved)) == (
        len(corrupt),
        moved.name.startswith("ledger.sqlite.corrupt-"),
        kept[:11],
        doc["total"]["checkpoints"],
        status["ledger"]["moved_aside_to"],
    )


async def test_the_ledger_is_sqlite_in_wal_mode_in_the_state_directory(base: Path) -> None:
    """The file is a real SQLite database in WAL mode holding the reports."""
    week = Week(base)
    await week.start()
    try:
        await week.checkpoint("A", 100, 1, 10.0, 1000, 0)
        await report(week.socket)  # waits until the facts are written
    finally:
        await week.stop()
    conn = sqlite3.connect(base / "state" / "ledger.sqlite")
    try:
        mode = conn.execute("PRAGMA journal_mode").fetchone()[0]
        rows = conn.execute("SELECT job, step, bytes FROM reports").fetchall()
    finally:
        conn.close()
    assert ("wal", [("A", 1, 1000)]) == (mode, rows)


async def test_report_reads_the_file_when_no_agent_answers(base: Path, tmp_path: Path) -> None:
    """With the agent stopped, `preemptd report` reads the ledger file the configuration names."""
    week = Week(base)
    await week.start()
    try:
        await week.checkpoint("A", 100, 1, 10.0, 1000, 0)
        await report(week.socket)
    finally:
        await week.stop()
    config = tmp_path / "config.toml"
    config.write_text(f'state_dir = "{base / "state"}"\n')
    doc = await report(base / "a.sock", "--config", str(config), "--since", "3650d")
    assert ("file", 1, 1000) == (doc["source"], doc["total"]["checkpoints"], doc["total"]["checkpoint_bytes"])


def test_old_facts_are_pruned_past_the_retention(tmp_path: Path) -> None:
    """Facts older than the retention are deleted; newer ones stay."""
    from agent.ledger import store
    from agent.ledger.facts import ReportFact

    path = tmp_path / "ledger.sqlite"
    conn = store.connect(path)
    try:
        rows = [
            ReportFact(t, "A", 1, 0, None, "checkpoint", "finished", 1, 1.0, 1, False, None, None, None)
            for t in (100.0, 200.0, 300.0)
        ]
        store.write(conn, [], rows)
        gone = store.prune(conn, 250.0)
    finally:
        conn.close()
    assert (2, [300.0]) == (gone, [r.time for r in store.read(path).reports])


async def test_the_agents_cost_table_prices_the_report(base: Path) -> None:
    """Prices set in the agent's [cost] table reach `preemptd report` through the socket."""
    settings = {"cost.spot_per_gpu_hour": 1.0, "cost.on_demand_per_gpu_hour": 4.0}
    agent = Agent(agent_config(base, settings))
    await agent.start()
    try:
        await http_json(
            agent.config.socket,
            "POST",
            "/v1/reports",
            {"kind": "checkpoint", "phase": "finished", "step": 1, "duration_s": 1.0, "client": {"job": "A"}},
        )
        doc = await report(agent.config.socket)
    finally:
        await agent.stop()
    assert ([], 0.75) == (doc["total"]["cost"]["missing"], doc["total"]["cost"]["list_discount"])


def test_a_bad_price_is_refused_when_the_configuration_loads(base: Path) -> None:
    """A negative price in [cost] is a configuration error naming the key."""
    with pytest.raises(ConfigError, match=r"cost\.spot_per_gpu_hour"):
        agent_config(base, {"cost.spot_per_gpu_hour": -1.0})


async def test_a_bad_prices_file_is_a_usage_error_naming_the_key(base: Path, tmp_path: Path) -> None:
    """`--prices FILE` with a misspelt key exits 2 and names the file and the key."""
    prices = tmp_path / "prices.toml"
    prices.write_text("spot_per_gpu_hr = 1.0\n")
    week = Week(base)
    await week.start()
    try:
        parser = argparse.ArgumentParser()
        register(parser.add_subparsers())
        args = parser.parse_args(["report", "--socket", str(week.socket), "--prices", str(prices)])
        err = io.StringIO()
        code = await asyncio.to_thread(run, args, io.StringIO(), err)
    finally:
        await week.stop()
    said = " ".join(err.getvalue().split())  # wrapped at 80 columns
    assert (2, True) == (code, f"{prices}: unknown key(s) spot_per_gpu_hr" in said)


async def test_the_counters_give_the_same_totals(base: Path) -> None:
    """The scripted week (its drills counted apart): /metrics shows the report's totals since the start."""
    week = Week(base)
    await week.start()
    try:
        await script_week(week)
        assert week.agent is not None
        ledger = next(c for c in week.agent.components if isinstance(c, LedgerComponent))
        await ledger.refresh()
        doc = await report(week.socket, "--since", "30d")
        async with (
            aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(week.socket))) as session,
            session.get("http://agent/metrics") as response,
        ):
            text = await response.text()
    finally:
        await week.stop()
    samples = dict(re.findall(r"^(preemptd_ledger_\S+) (\S+)$", text, flags=re.M))
    total = doc["total"]
    assert (
        float(total["interruptions"]["unannounced"]),
        round(3600 * total["redone_gpu_hours"], 0),
        round(3600 * total["gpu_hours"], 0),
        float(total["checkpoint_bytes"]),
    ) == (
        float(samples['preemptd_ledger_interruptions_total{announced="false"}']),
        round(float(samples['preemptd_ledger_gpu_seconds_total{category="redone"}']), 0),
        round(float(samples['preemptd_ledger_gpu_seconds_total{category="total"}']), 0),
        float(samples["preemptd_ledger_checkpoint_bytes_total"]),
    )


async def test_the_status_and_the_metrics_show_the_reports_goodput(base: Path) -> None:
    """One goodput: the `goodput` status section, the preemptd_ledger_goodput_ratio gauge and `preemptd report`
    (over the same facts: everything since the agent started) give the same value; the advisor exports none
    of its own."""
    week = Week(base)
    await week.start()
    try:
        await script_week(week)
        assert week.agent is not None
        ledger = next(c for c in week.agent.components if isinstance(c, LedgerComponent))
        await ledger.refresh()
        doc = await report(week.socket, "--since", "30d")
        _, status = await http_json(week.socket, "GET", "/v1/status")
        _, text = await http_json(week.socket, "GET", "/metrics")
    finally:
        await week.stop()
    gauges = dict(re.findall(r"^(preemptd_\S*goodput\S*) (\S+)$", text, flags=re.M))
    total = doc["total"]
    assert (
        {"preemptd_ledger_goodput_ratio": total["goodput"]},
        (total["goodput"], total["useful_gpu_hours"], total["gpu_hours"]),
    ) == (
        {name: float(value) for name, value in gauges.items()},
        (status["goodput"]["ratio"], status["goodput"]["useful_gpu_hours"], status["goodput"]["gpu_hours"]),
    )


async def test_a_drill_resumed_before_its_deadline_is_announced_and_its_flush_its_own(base: Path) -> None:
    """`preemptd drill --in 20s` on a job under `preemptd exec`: it flushes step 5 with 19.9 s to spare and is
    back 2 s later, before the deadline; after the deadline the new process saves again on SIGTERM (no
    notice). Without --drills nothing counts and nothing is redone, the resume is the drill's; with
    --drills one announced interruption, its flush in time with its own bytes."""
    week = Week(base)
    await week.start()
    try:
        week.at(0)
        await week.register("loop", 100)
        week.at(60 / H)
        await week.checkpoint("loop", 100, 3, 1.0, 1000)
        week.at(100 / H)
        nid = await week.drill(20)
        week.at(100.1 / H)
        await week.checkpoint("loop", 100, 5, 0.5, 1000, emergency=True, notice_id=nid)
        week.at(102 / H)
        await week.register("loop", 200)
        week.at(130 / H)
        await week.checkpoint("loop", 200, 9, 0.5, 1000, emergency=True)
        week.at(1)
        plain = await report(week.socket)
        drills = await report(week.socket, "--drills")
    finally:
        await week.stop()
    assert (
        ({"announced": 0, "unannounced": 0, "total": 0}, 0.0, 0),
        [(True, True, nid, 5)],
        {"announced": 1, "unannounced": 0, "total": 1},
        [("in_time", 5, 1000, 19.9)],
    ) == (
        (plain["total"]["interruptions"], plain["total"]["redone_gpu_hours"], plain["total"]["steps_redone"]),
        [(r["announced"], r["drill"], r["notice_id"], r["from_step"]) for r in plain["resumes"]],
        drills["total"]["interruptions"],
        [(f["outcome"], f["step"], f["bytes"], f["slack_s"]) for f in drills["flushes"]],
    )


async def test_a_job_reporting_through_the_client_library_is_in_the_ledger(base: Path) -> None:
    """The client library's Reporter (what the stores use) with the optional `gpus`: the report counts its
    GPUs and its checkpoint."""
    week = Week(base)
    await week.start()
    try:
        reporter = Reporter(week.socket, client={**client_info(name="train.py"), "job": "lib", "gpus": 2})
        reporter.checkpoint("finished", 7, duration_s=3.0, size=4096)
        await asyncio.to_thread(reporter.close)
        doc = await report(week.socket, "--job", "lib")
    finally:
        await week.stop()
    lib = doc["jobs"]["lib"]
    assert (0, 2, 1, 4096) == (reporter.failed, lib["gpus"], lib["checkpoints"], lib["checkpoint_bytes"])


async def test_a_held_database_delays_the_writer_not_the_agent(base: Path) -> None:
    """Another program holds the ledger's write lock: reports are still accepted and the status answered at
    once; once the lock is let go the facts are written and reported."""
    week = Week(base)
    await week.start()
    try:
        await week.checkpoint("A", 100, 1, 10.0, 1000, 0)
        await report(week.socket)  # the file exists, with its schema
        holder = sqlite3.connect(base / "state" / "ledger.sqlite", isolation_level=None)
        holder.execute("BEGIN EXCLUSIVE")
        try:
            await week.checkpoint("A", 100, 2, 10.0, 1000, 0)
            status, doc = await http_json(week.socket, "GET", "/v1/status")
        finally:
            holder.execute("ROLLBACK")
            holder.close()
        after = await report(week.socket)
    finally:
        await week.stop()
    assert (200, "ok", 2) == (status, doc["ledger"]["state"], after["total"]["checkpoints"])


async def test_a_flush_says_its_tier_and_the_notices_their_source_and_lead(base: Path) -> None:
    """A flush reported with `flush.tier` keeps it; the notices are counted by source with their lead time."""
    week = Week(base)
    await week.start()
    try:
        week.at(0)
        await week.register("A", 100, 0)
        nid = await week.drill(90)
        await week.checkpoint("A", 100, 5, 2.0, 10, 0, emergency=True, notice_id=nid, flush={"tier": "peer"})
        week.at(1)
        doc = await report(week.socket, "--drills")
    finally:
        await week.stop()
    assert (["peer"], {"drill": 1}, 90.0) == (
        [f["tier"] for f in doc["flushes"]],
        doc["notices"]["by_source"],
        doc["notices"]["lead_s"]["max"],
    )


async def test_a_killed_agent_keeps_what_it_had_written(base: Path) -> None:
    """The agent process is killed (SIGKILL) after a report was written: the next agent reports it."""
    proc = AgentProcess(base)
    await proc.start()
    try:
        status, _ = await http_json(
            proc.socket_path,
            "POST",
            "/v1/reports",
            {"kind": "checkpoint", "phase": "finished", "step": 3, "duration_s": 1.0, "client": {"job": "K"}},
        )
        await report(proc.socket_path)  # answered once the report is in the database
        await proc.stop(signal.SIGKILL)
        seen = len(proc.notifications)
        await proc.start(wait_ready=False)
        await proc.wait_notification("READY=1", after=seen)
        doc = await report(proc.socket_path, "--job", "K")
    finally:
        await proc.stop()
    assert (202, 1) == (status, doc["jobs"]["K"]["checkpoints"])


def test_a_writer_stopped_before_it_started_stops_at_once(tmp_path: Path) -> None:
    """The agent may stop during its start, before the ledger's thread runs: closing returns at once."""
    from agent.ledger import store

    errors: list[str] = []
    writer = store.Writer(
        tmp_path / "l.sqlite", 86400.0, lambda: T0, lambda moved, error: None, errors.append
    )
    writer.open()
    assert (True, []) == (writer.close(1.0), errors)


async def test_a_reload_applies_new_prices(base: Path) -> None:
    """SIGHUP (Agent.reload) with new [cost] prices: the next report uses them."""
    settings: dict[str, Any] = {}
    agent = Agent(agent_config(base, settings), reload_config=lambda: agent_config(base, settings))
    await agent.start()
    try:
        settings.update({"cost.spot_per_gpu_hour": 1.0, "cost.on_demand_per_gpu_hour": 2.0})
        await agent.reload()
        doc = await report(agent.config.socket)
    finally:
        await agent.stop()
    assert 0.5 == doc["total"]["cost"]["list_discount"]
