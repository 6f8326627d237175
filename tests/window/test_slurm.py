"""The window on a real agent with ``[actions.slurm]`` on the real one-node Slurm (tests/slurm_cluster.py, whose
slurm.conf sets KillWait=5): KillWait is read with the bridge's own tools and binds when a checkpoint takes
longer; a controller that cannot be reached leaves it unknown and status still answers."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from agent.client.reporting import Reporter, client_info
from tests.slurm_cluster import SlurmCluster
from tests.support import running_agent
from tests.window.support import window_until

pytestmark = pytest.mark.timeout(120)


async def test_slurms_kill_wait_binds(slurm: SlurmCluster, base: Path) -> None:
    settings = {"actions.slurm.enabled": True, "actions.slurm.slurm_conf": str(slurm.conf)}
    sock = base / "a.sock"
    async with running_agent(base, settings):
        reporter = Reporter(sock, client=client_info(name="train.py"))
        try:
            reporter.checkpoint("finished", 1, duration_s=10.0)
            assert await asyncio.to_thread(reporter.flush, 10)
            body = await window_until(
                sock, lambda doc: doc["kinds"]["termination"]["binding"] == "slurm_kill_wait", timeout=60
            )
        finally:
            reporter.close()
    termination = body["window"]["kinds"]["termination"]
    assert (5.0, "slurm_kill_wait", 10.0, False, True) == (
        termination["effective_s"],
        termination["binding"],
        termination["predicted_flush_s"],
        termination["fits"],
        termination["window_too_short"],
    )
    [limit] = termination["limits"]
    assert limit["source"].startswith("Slurm KillWait (scontrol show config)")
    assert "raise KillWait" in termination["lengthen"]


async def test_an_unreachable_controller_leaves_kill_wait_unknown(slurm: SlurmCluster, base: Path) -> None:
    conf = base / "slurm.conf"
    conf.write_text(slurm.conf.read_text().replace(f"SlurmctldPort={slurm_port(slurm)}", "SlurmctldPort=1"))
    settings = {
        "actions.slurm.enabled": True,
        "actions.slurm.slurm_conf": str(conf),
        "actions.slurm.timeout_s": 2.0,
    }
    async with running_agent(base, settings):
        body = await window_until(
            base / "a.sock",
            lambda doc: any(limit["name"] == "slurm" for limit in doc["limits"]),
            timeout=60,
        )
    [limit] = body["window"]["limits"]
    assert (None, "unknown") == (limit["seconds"], limit["state"])
    assert "scontrol show config" in limit["detail"], limit


def slurm_port(cluster: SlurmCluster) -> str:
    for line in cluster.conf.read_text().splitlines():
        if line.startswith("SlurmctldPort="):
            return line.partition("=")[2]
    raise AssertionError("no SlurmctldPort in the test cluster's slurm.conf")
