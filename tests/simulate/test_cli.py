"""``preemptd simulate``: a real process that listens on loopback, plays a scenario and stops on SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
from pathlib import Path

import aiohttp
import pytest

from tests.support import REPO

pytestmark = pytest.mark.timeout(30)


async def start(*args: str) -> tuple[asyncio.subprocess.Process, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "agent", "simulate", *args, cwd=str(REPO), stdout=asyncio.subprocess.PIPE
    )
    assert proc.stdout is not None
    line = (await asyncio.wait_for(proc.stdout.readline(), 15)).decode()
    return proc, line.rsplit(" ", 1)[-1].strip()


async def test_simulate_serves_plays_and_stops(base: Path) -> None:
    port_file = base / "port"
    proc, url = await start(
        "tencent", "--scenario", "spot-termination", "--after", "0", "--port-file", str(port_file)
    )
    try:
        async with aiohttp.ClientSession() as http:
            for _ in range(200):  # the scenario's first step is due at once
                async with http.get(url + "/_sim/state") as response:
                    state = await response.json()
                if state["published"]:
                    break
                await asyncio.sleep(0.02)
            async with http.get(url + "/latest/meta-data/spot/termination-time") as response:
                status = response.status
        assert (status, url.endswith(port_file.read_text().strip()), state["scenario"]) == (
            200,
            True,
            "spot-termination",
        )
    finally:
        proc.send_signal(signal.SIGTERM)
        code = await asyncio.wait_for(proc.wait(), 10)
    assert code == 0


async def test_simulate_lists_scenarios() -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "agent", "simulate", "azure", "--list-scenarios", cwd=str(REPO),
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, _ = await asyncio.wait_for(proc.communicate(), 15)
    assert "preempt" in json.loads(out)


async def test_simulate_rejects_an_unknown_scenario() -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "agent", "simulate", "aws", "--scenario", "nope", cwd=str(REPO),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    _, err = await asyncio.wait_for(proc.communicate(), 15)
    assert (proc.returncode, b"unknown scenario" in err) == (2, True)


def simulate_help() -> str:
    from agent.cli import build_parser
    from agent.cli.help import verb_parser

    return verb_parser(build_parser(), "simulate").format_help()


def test_simulate_help_shows_readable_choices() -> None:
    """argparse mangles a choice written with brackets (`{,404}` in the usage, `{[],404}` below it)."""
    text = simulate_help()
    assert (2, []) == (
        text.count("--empty-maintenance {empty,404}"),
        [word for word in text.split() if word.startswith(("{,", "{[", "[{,"))],
    )


def test_empty_maintenance_empty_serves_an_empty_list() -> None:
    """`--empty-maintenance empty` is the simulator's "[]" (and "[]" itself is still accepted)."""
    from agent.simulate.cli import _options, add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    chosen = [
        _options(parser.parse_args(["aws", "--empty-maintenance", value]))["empty_maintenance"]
        for value in ("empty", "[]", "404")
    ]
    assert ["[]", "[]", "404"] == chosen
