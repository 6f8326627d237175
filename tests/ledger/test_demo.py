"""The ledger after the real ``preemptd demo`` (the issue "Truth", item 1): the demo's job flushes, exits and is
restarted before the notice's deadline, the order of the demo, of drills and of fast schedulers. Once the
deadline has passed, ``preemptd report --json`` from the same agent says one announced interruption, none
unannounced, notice coverage 100 %, nothing redone, and its goodput is the value /metrics exports."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import sys
from pathlib import Path
from typing import Any

import pytest

from agent.core.notice import parse_time
from tests.lazy import needs_torch
from tests.support import REPO, cli, http_json

RESUMED = "resumed from the emergency checkpoint"


async def until_resumed(stdout: asyncio.StreamReader) -> str:
    """The demo's screen up to the line that says the restarted job resumed (all of it if it never does)."""
    seen = []
    while line := (await stdout.readline()).decode():
        seen.append(line)
        if RESUMED in line:
            break
    return "".join(seen)


async def computed_after_the_deadline(socket: Path) -> None:
    """Wait until the agent's goodput was recomputed after the notice's deadline (it does so just after it)."""
    while True:
        _, ledger = await http_json(socket, "GET", "/v1/ledger")
        _, status = await http_json(socket, "GET", "/v1/status")
        deadline = max(n["deadline"] for n in ledger["notices"])
        computed = (status.get("goodput") or {}).get("computed_at")
        if computed is not None and parse_time(computed).timestamp() > deadline + 1.0:
            return
        await asyncio.sleep(0.2)  # a child process: no event to wait on


async def gauge(socket: Path) -> float:
    _, text = await http_json(socket, "GET", "/metrics")
    found = re.search(r"^preemptd_ledger_goodput_ratio (\S+)$", text, flags=re.M)
    assert found is not None, text
    return float(found.group(1))


@needs_torch
@pytest.mark.slow
@pytest.mark.timeout(240)
async def test_the_demos_flush_and_resume_are_one_announced_interruption(base: Path) -> None:
    socket = base / "demo.sock"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREEMPTD_")}
    env["PYTHONPATH"] = str(REPO)
    with (base / "demo.err").open("wb") as stderr:
        proc = await asyncio.create_subprocess_exec(
            *(sys.executable, "-m", "agent", "demo", "--after", "0.5s", "--lead", "20s", "--keep"),
            *("--socket", str(socket)),
            env=env,
            stdout=asyncio.subprocess.PIPE,
            stderr=stderr,
        )
    try:
        assert proc.stdout is not None
        screen = await asyncio.wait_for(until_resumed(proc.stdout), 150)
        assert RESUMED in screen, screen + (base / "demo.err").read_text()
        await asyncio.wait_for(computed_after_the_deadline(socket), 60)
        # The resumed job's first report makes the agent compute again (a second later): on a busy machine
        # that can fall between two reads, so read the gauge, the report and the gauge again until the gauge
        # held still around the report (bounded).
        for _ in range(10):
            before = await gauge(socket)
            code, out, err = await cli("report", "--json", "--socket", str(socket), timeout=60)
            after = await gauge(socket)
            if before == after:
                break
            await asyncio.sleep(1.5)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            await asyncio.wait_for(proc.communicate(), 30)
        except asyncio.TimeoutError:
            proc.kill()
            await proc.wait()
    assert 0 == code, err
    doc: dict[str, Any] = json.loads(out)
    total = doc["total"]
    [flush] = doc["flushes"]
    assert (
        {"announced": 1, "unannounced": 0, "total": 1},
        1.0,
        {"in_time": 1, "late": 0, "lost": 0},
        (0.0, 0),
        [(True, flush["notice_id"], flush["step"], 0)],
        (total["goodput"], total["goodput"]),
    ) == (
        total["interruptions"],
        total["notice_coverage"],
        total["flushes"],
        (total["redone_gpu_hours"], total["steps_redone"]),
        [(r["announced"], r["notice_id"], r["from_step"], r["steps_redone"]) for r in doc["resumes"]],
        (before, after),
    ), screen
