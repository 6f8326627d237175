"""The drain (issue 24 item 3): a step held in the RAM tiers of two simulated hosts (two real agents, each
with its own tier directory) is copied into one durable root by each agent, and committed there as an
ordinary ShardedStore step once both parts are in; plain DCP loads it."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.ramtier.drains import Drain
from tests.lazy import needs_torch
from tests.ramtier.support import JOB, as_user, request_as, tier_agent, write_step
from tests.support import REPO, http_json, short_tmp

STEP = 5


@pytest.fixture
def other() -> Iterator[Path]:
    """A second host's directory (socket, state, RAM tier)."""
    path = short_tmp()
    yield path
    shutil.rmtree(path, ignore_errors=True)


def python(code: str) -> str:
    """Run ``code`` in a fresh interpreter (torch and DCP stay out of the test process); its stdout."""
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert 0 == done.returncode, done.stderr
    return done.stdout


def dcp_files(directory: Path) -> dict[str, bytes]:
    """A real one-rank DCP checkpoint of ``{"w": arange(12)}``: its files by name."""
    python(
        f"""
        import torch, torch.distributed.checkpoint as dcp
        dcp.save({{"w": torch.arange(12.0)}}, checkpoint_id={str(directory)!r}, no_dist=True)
        """
    )
    return {p.name: p.read_bytes() for p in directory.iterdir()}


async def hold(agent: Any, files: dict[str, bytes], durable_root: Path | None, step: int = STEP) -> Any:
    """Reserve, write and commit a step on one host, naming the durable root at reserve."""
    sock = agent.config.socket
    body: dict[str, Any] = {"step": step, "bytes": sum(map(len, files.values()))}
    if durable_root is not None:
        body["durable_root"] = str(durable_root)
    status, res = await http_json(sock, "POST", f"/v1/ram-tier/jobs/{JOB}/reserve", body)
    assert 200 == status, res
    write_step(Path(res["path"]), step, files)
    status, answer = await http_json(
        sock, "POST", f"/v1/ram-tier/jobs/{JOB}/steps/{step}/commit", {"reservation": res["reservation"]}
    )
    assert 200 == status, answer
    return answer


async def drained(tier: Any, step: int = STEP, uid: int | None = None) -> Drain:
    drain: Drain = tier.drains.records[(os.getuid() if uid is None else uid, JOB, step)]
    await asyncio.wait_for(drain.done.wait(), 60)
    return drain


@needs_torch
@pytest.mark.slow
async def test_a_step_split_over_two_hosts_is_committed_once_both_parts_are_in(
    base: Path, other: Path
) -> None:
    durable = base / "durable"
    files = await asyncio.to_thread(dcp_files, base / "saved")
    async with tier_agent(base) as (agent_a, tier_a), tier_agent(other) as (agent_b, tier_b):
        await hold(agent_a, {".metadata": files[".metadata"]}, durable)
        first = await drained(tier_a)
        committed_early = await asyncio.to_thread((durable / f"step-{STEP:012d}").exists)
        await hold(agent_b, {"__0_0.distcp": files["__0_0.distcp"]}, durable)
        last = await drained(tier_b)
        _, status_b = await http_json(agent_b.config.socket, "GET", "/v1/status")
    assert ("waiting", ["rank 0"], False) == (first.state, first.missing, committed_early)
    assert ("committed", str(durable / f"step-{STEP:012d}")) == (last.state, last.path)
    assert {"state": "committed", "copied_bytes": len(files["__0_0.distcp"])}.items() <= status_b["ram_tier"][
        "drains"
    ][f"{os.getuid()}/{JOB}/{STEP}"].items()
    loaded = python(
        f"""
        import json, torch, torch.distributed.checkpoint as dcp
        from agent.client.dcp import latest_committed
        found = latest_committed({str(durable)!r})
        state = {{"w": torch.zeros(12)}}
        dcp.load(state, checkpoint_id=found.path, no_dist=True)
        print(json.dumps({{"step": found.step, "w": state["w"].tolist()}}))
        """
    )
    assert {"step": STEP, "w": [float(i) for i in range(12)]} == json.loads(loaded)


@needs_torch
@pytest.mark.slow
async def test_a_durable_step_frees_the_older_steps_of_the_job_from_ram(base: Path) -> None:
    files = await asyncio.to_thread(dcp_files, base / "saved")
    async with tier_agent(base) as (agent, tier):
        await hold(agent, files, None, step=1)
        await hold(agent, files, base / "durable", step=2)
        drain = await drained(tier, step=2)
        _, job = await http_json(agent.config.socket, "GET", f"/v1/ram-tier/jobs/{JOB}")
    assert ("committed", [2]) == (drain.state, [s["step"] for s in job["steps"]])


async def test_a_damaged_ram_copy_fails_its_drain_and_commits_nothing(base: Path) -> None:
    durable = base / "durable"
    async with tier_agent(base, drain_rate_mb_s=0) as (agent, tier):
        sock = agent.config.socket
        files = {".metadata": b"meta", "__0_0.distcp": b"tensor bytes"}
        _, res = await http_json(
            sock, "POST", f"/v1/ram-tier/jobs/{JOB}/reserve", {"step": STEP, "bytes": 20}
        )
        write_step(Path(res["path"]), STEP, files)
        (Path(res["path"]) / "__0_0.distcp").write_bytes(b"TENSOR BYTES")  # after tier.json: same size
        await http_json(
            sock,
            "POST",
            f"/v1/ram-tier/jobs/{JOB}/steps/{STEP}/commit",
            {"reservation": res["reservation"], "durable_root": str(durable)},
        )
        drain = await drained(tier)
        leftovers = await asyncio.to_thread(lambda: sorted(p.name for p in durable.rglob("*")))
    assert "failed" == drain.state
    assert "the RAM copy is damaged" in str(drain.error)
    assert f"step-{STEP:012d}" not in leftovers


async def test_a_durable_root_that_is_not_absolute_is_a_400(base: Path) -> None:
    async with tier_agent(base) as (agent, _):
        status, body = await http_json(
            agent.config.socket,
            "POST",
            f"/v1/ram-tier/jobs/{JOB}/reserve",
            {"step": 1, "bytes": 1, "durable_root": "ckpt"},
        )
    assert 400 == status
    assert "field 'durable_root' must be the absolute path" in body["error"]


async def test_the_drain_writes_as_the_jobs_user_not_as_the_agent(base: Path) -> None:
    """A root agent copies with the job's uid: a durable root that user may not write is refused to it."""
    if os.geteuid() != 0:
        pytest.skip("needs root to act as another user")
    os.chmod(base, 0o755)
    locked = base / "locked"
    locked.mkdir(mode=0o755)  # root's: uid 65534 may not write in it
    async with tier_agent(base, agent_settings={"socket_mode": 0o666}) as (agent, tier):
        sock = agent.config.socket
        _, res = await request_as(
            sock, 65534, "POST", f"/v1/ram-tier/jobs/{JOB}/reserve", {"step": STEP, "bytes": 4}
        )
        with as_user(65534):
            write_step(Path(res["path"]), STEP, {".metadata": b"meta"})
        status, _ = await request_as(
            sock,
            65534,
            "POST",
            f"/v1/ram-tier/jobs/{JOB}/steps/{STEP}/commit",
            {"reservation": res["reservation"], "durable_root": str(locked / "ckpt")},
        )
        drain = await drained(tier, uid=65534)
    assert (200, "failed") == (status, drain.state)
    assert f"Permission denied: '{locked / 'ckpt'}'" in str(drain.error)
    assert not (locked / "ckpt").exists()
