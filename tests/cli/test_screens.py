"""Every screen of the command line fits 80 columns and speaks to people: for each state that matters (no GPU,
no advice yet, a cloud notice, a drill, a flush that does not fit, the RAM tier holding steps, no agent) the
real command's output has no line wider than 80 columns (wrapped at words, indented), no Python repr (None,
True, False), no "?" placeholder, no raw float and no machine timestamp. The states come from real agents."""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import re
from pathlib import Path
from typing import Any

from agent.cli.render import format_status
from agent.cli.report import register, render_html, render_text
from agent.cli.report import run as run_report
from agent.core.screen import columns, duration, plural, when, wrap
from agent.service.daemon import Agent
from tests.cloud_harness import rig
from tests.ramtier.support import put_step, tier_agent
from tests.support import AgentProcess, cli, http_json, running_agent, short_tmp

REPR = re.compile(r"\b(None|True|False)\b")
PLACEHOLDER = re.compile(r"(?:^|[\s(\[])\?(?=$|[\s),\]])")  # a lone "?" for an unknown value
RAW_FLOAT = re.compile(r"\d\.\d{4,}")  # 0.004991, 45.123456
MACHINE_TIME = re.compile(r"\d{4}-\d\d-\d\dT\d\d|\d\d:\d\d:\d\d\.\d")  # RFC 3339, microseconds
HUMAN_TIME = re.compile(r"\b\d{4}-\d\d-\d\d \d\d:\d\d:\d\d [A-Z+-][\w:+-]*|\b\d\d:\d\d:\d\d [A-Z+-][\w:+-]*")
# A reason as long as clouds and operators write them, with a word as long as a path.
REASON = (
    "Spot instance interruption: the capacity pool for p5.48xlarge in us-east-1b is being reclaimed and this "
    "instance will be stopped; save now to /checkpoints/llm-pretraining-70b/rank-0/step-000123456"
)


def unfit(text: str) -> list[str]:
    """The lines of ``text`` a person should not see: too wide (but for one word longer than a line, a path,
    which stands whole on its own line), a repr, a placeholder, a raw float or time."""
    return [
        line
        for line in text.splitlines()
        if (columns(line) > 80 and " " in line.strip())
        or REPR.search(line)
        or PLACEHOLDER.search(line)
        or RAW_FLOAT.search(line)
        or MACHINE_TIME.search(line)
    ]


async def status_text(agent: Agent) -> str:
    """What `preemptd status` prints for this agent (the real command, in a child process)."""
    _, out, err = await cli("status", socket=agent.config.socket)
    assert out, err
    return out


async def report(agent: Agent, body: dict[str, Any]) -> None:
    status, answer = await http_json(agent.config.socket, "POST", "/v1/reports", body)
    assert status == 202, answer


# ----- the shared helpers ------------------------------------------------------------------------------------


def test_wrap_breaks_between_words_and_indents_the_rest() -> None:
    lines = wrap("word " * 30, "  ", "    ", width=40)
    assert (True, True, True) == (
        all(len(line) <= 40 for line in lines),
        lines[0].startswith("  word") and all(line.startswith("    word") for line in lines[1:]),
        all(line.endswith("word") for line in lines),
    )


def test_times_are_to_the_second_with_their_zone() -> None:
    shown = when("2026-12-06T12:01:29.123456Z")
    assert HUMAN_TIME.fullmatch(shown), shown


def test_durations_are_rounded_for_people() -> None:
    assert ["5 ms", "0s", "1.5s", "45s", "2m00s", "3h20m", "2.5 days"] == [
        duration(s) for s in (0.004991, 0, 1.5, 45.123456, 120, 12000, 216000)
    ]


def test_one_is_singular() -> None:
    assert ("1 step", "2 steps", "1 job", "0 jobs") == (
        plural(1, "step"),
        plural(2, "step"),
        plural(1, "job"),
        plural(0, "job"),
    )


# ----- the states ----------------------------------------------------------------------------------------------


async def test_status_and_advise_of_an_agent_with_no_gpu_and_no_advice(base: Path) -> None:
    """The agent in a process of its own: in this one, another test's fake NVML library may be loaded, and
    the dynamic loader would hand it to any later load of libnvidia-ml.so.1."""
    agent = AgentProcess(base)
    await agent.start()
    try:
        _, shown, _ = await cli("status", socket=agent.socket_path)
        _, advice, _ = await cli("advise", socket=agent.socket_path)
    finally:
        await agent.stop()
    nvml = " ".join(shown[shown.index("  nvml") :].split("\n  host")[0].split())
    assert ([], [], True) == (unfit(shown), unfit(advice), "no NVIDIA driver" in nvml), shown + advice
    assert advice.startswith("No advice yet: no checkpoint save time yet (0 finished periodic checkpoints")
    assert "M is probably above" not in advice  # a bound from seconds of uptime says nothing


async def test_a_20_s_cloud_notice_gives_the_window_its_own_lead(base: Path) -> None:
    """The demo's notice: AWS with 20 s of lead, not the 2 minutes AWS usually gives."""
    async with rig("aws", base) as cloud:
        await report(
            cloud.agent,
            {
                "kind": "checkpoint",
                "phase": "finished",
                "step": 1,
                "duration_s": 0.004991,
                "client": {"job": "j"},
            },
        )
        cloud.sim.trigger({"type": "spot", "action": "terminate", "in_s": 20})
        await cloud.notice("notice")
        shown = await status_text(cloud.agent)
    window = shown[shown.index("Window") :]
    assert [] == unfit(shown), shown
    assert window.startswith("Window (predicted flush 5 ms, slowest of the last 1 periodic saves):"), window
    # AWS gives the time to the second: the lead is what is left of the 20 s when the agent saw it.
    assert re.search(
        r"^  termination  (19|20)s \(notice binds\): fits  \[notice (19|20)s\]$", window, re.M
    ), window
    assert HUMAN_TIME.search(shown[shown.index("Notices") :]), shown


async def test_a_drill_with_a_long_reason_and_a_flush_that_does_not_fit(base: Path) -> None:
    async with running_agent(base) as agent:
        client = {"job": "llm-pretraining-70b", "rank": 0, "host": "gpu-node-17.cluster.internal"}
        await report(
            agent,
            {"kind": "checkpoint", "phase": "finished", "step": 1, "duration_s": 45.123456, "client": client},
        )
        _, drilled, err = await cli("drill", "--in", "30s", "--reason", REASON, socket=agent.config.socket)
        [notice_id] = [n["id"] for n in agent.status()["notices"]]
        flush = {"predicted_s": 45.123456, "time_left_s": 29.87654, "predicted_miss": True, "tier": "durable"}
        step = {"kind": "checkpoint", "step": 2, "emergency": True, "notice_id": notice_id, "client": client}
        await report(agent, {**step, "phase": "started", "flush": flush})
        late = {
            "tier": "durable",
            "fallback": "all_hosts_noticed",
            "predicted_s": 45.123456,
            "slack_s": -15.25,
        }
        await report(agent, {**step, "phase": "finished", "duration_s": 45.123456, "flush": late})
        doc = agent.status()
        shown = await status_text(agent)
    assert ([], [], "") == (unfit(drilled), unfit(shown), err), drilled + shown
    assert drilled.startswith(f"drill {notice_id}: termination with deadline ")
    assert HUMAN_TIME.search(drilled), drilled
    assert "Flush at risk: step 2 predicted to take 45s with 30s left" in shown, shown
    assert "slack -15s" in " ".join(shown.split()), shown
    assert doc["window"]["window_too_short"], doc["window"]
    assert "window_too_short: termination: the flush (45s) outlasts notice (30s)" in shown, shown


async def test_the_ram_tier_holding_steps(base: Path) -> None:
    async with tier_agent(base, cap_bytes=1 << 30) as (agent, _):
        for step in (1, 2):
            status, _ = await put_step(agent, step, {"__0_0.distcp": b"x" * 1000, ".metadata": b"m"})
            assert 200 == status
        shown = await status_text(agent)
    [line] = [line for line in shown.splitlines() if line.startswith("RAM tier")]
    assert ([], "2 steps of 1 job") == (unfit(shown), line.split("; ")[1][: len("2 steps of 1 job")]), shown


async def test_every_verb_without_an_agent_says_so_in_80_columns(base: Path, tmp_path: Path) -> None:
    # A socket path as long as a per-user one under a long home or runtime directory.
    sock = base / ("run-user-1000-preemptd-" * 3) / "preemptd.sock"
    config = tmp_path / "config.toml"
    config.write_text(f'state_dir = "{base / ("state-of-the-agent-" * 3)}"\n')
    results = await asyncio.gather(
        cli("status", socket=sock),
        cli("watch", socket=sock),
        cli("drill", "--in", "30s", socket=sock),
        cli("advise", socket=sock),
        cli("report", "--config", str(config), socket=sock),
    )
    assert [69] * 5 == [code for code, _, _ in results], results
    assert [] == [line for _, _, err in results for line in unfit(err)], results
    assert all(len(err.splitlines()) > 1 for _, _, err in results), results  # wrapped, not cut


async def test_offline_advice_with_a_simulation_fits_80_columns() -> None:
    code, out, err = await cli(
        "advise", "--save-time", "4m", "--mtbp", "6h", "--current", "30m", "--announced-share", "70%",
        "--simulate", "--runs", "20", "--restart", "0",
    )  # fmt: skip
    assert (0, [], "") == (code, unfit(out), err), out
    assert "restart R = 0s" in out


def test_a_status_document_of_every_section_fits_80_columns() -> None:
    """Recorded from a real agent, with what a long run adds (a host limit of unknown length, a source that
    fails with a long error, a state directory that cannot be used)."""
    doc = json.loads((Path(__file__).parents[1] / "data" / "status_full.json").read_text())
    shown = format_status(doc)
    assert [] == unfit(shown), shown
    assert "slurm unknown" in shown and "STATE PROBLEM" in shown


async def test_the_report_of_a_real_agent_fits_80_columns_with_its_time_in_words() -> None:
    """One job's checkpoints and no prices: the missing prices are named under their row."""
    async with running_agent(short_tmp("pd-report-")) as agent:
        client = {"job": "llm-pretraining-70b-with-a-long-name", "pid": 10, "gpus": 8}
        for step in (1, 2):
            body = {
                "kind": "checkpoint",
                "phase": "finished",
                "step": step,
                "duration_s": 5.0,
                "bytes": 10**6,
            }
            await report(agent, {**body, "client": client})
        parser = argparse.ArgumentParser()
        register(parser.add_subparsers())
        args = parser.parse_args(["report", "--socket", str(agent.config.socket)])
        out, err = io.StringIO(), io.StringIO()
        code = await asyncio.to_thread(run_report, args, out, err)
    shown = out.getvalue()
    assert (0, [], "") == (code, unfit(shown), err.getvalue()), shown
    assert HUMAN_TIME.search(shown.splitlines()[0]), shown
    assert "prices missing: set cost.spot_per_gpu_hour," in shown


def recorded_week() -> dict[str, Any]:
    """A real agent's report of a scripted week (tests/ledger/test_ledger.py's): two jobs, two drills, a flush in
    time and a lost one, three resumes, priced."""
    doc: dict[str, Any] = json.loads((Path(__file__).parents[1] / "data" / "report_week.json").read_text())
    return doc


def test_the_report_of_a_week_fits_80_columns_with_rates_rounded() -> None:
    shown = render_text(recorded_week())
    assert [] == unfit(shown), shown
    assert "  preemptions per day       8.73; break-even 28: spot is cheaper" in shown.splitlines()


def test_the_html_report_says_yes_no_and_times_in_words() -> None:
    page = render_html(recorded_week())
    cells = re.findall(r"<t[dh]>([^<]*)</t[dh]>", page)
    resumes = page[page.index("<h2>Resumes</h2>") :]
    assert [] == [
        cell for cell in cells if REPR.search(cell) or RAW_FLOAT.search(cell) or MACHINE_TIME.search(cell)
    ]
    assert HUMAN_TIME.search(page[page.index("<h1>") : page.index("</h1>")]), page[:400]
    assert ("<td>yes</td>" in resumes, "<td>no</td>" in resumes) == (True, True)
    assert HUMAN_TIME.search(resumes), resumes
