"""Shrink, don't stop, under Lightning (issue 37): three simulated hosts, each with its own agent and its own
``preemptd exec -- torchrun --nnodes 2:3`` of a Lightning DDP job with ``PreemptdCallback(tier="peer")``
(tests/lightning_elastic_job.py). A drill on one host: Lightning's checkpoint goes into the other hosts' RAM,
the notified host's exec exits 75, and the other hosts' execs keep running: torchrun restarts their workers at
world size 2, which resume the saved step from RAM with its digest and train on."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from agent.client import EXIT_PREEMPTED
from tests.hosts import HostRun, drill_host, elastic_flags, free_port, hosts, kill_runs, store_host
from tests.lazy import HAS_TORCH
from tests.support import REPO, http_json

pytestmark = [
    pytest.mark.slow,
    pytest.mark.torch_mp,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed"),
    pytest.mark.skipif(importlib.util.find_spec("lightning") is None, reason="lightning is not installed"),
]

JOB_SCRIPT = REPO / "tests" / "lightning_elastic_job.py"


async def _until(
    run: HostRun, wanted: Callable[[dict[str, Any]], bool], timeout: float = 180.0
) -> dict[str, Any]:
    """The first line of ``run``'s progress that is ``wanted``, reading more as it comes."""
    while not (found := [e for e in run.events if wanted(e)]):
        await run.until_more(timeout=timeout)
    return found[0]


@pytest.mark.asyncio
async def test_a_drill_under_lightning_makes_its_host_leave_and_torchrun_restarts_the_others_at_two(
    tmp_path: Path,
) -> None:
    """The notified host's worker says ``leave`` and its exec exits 75; each staying worker says ``restart``
    3 → 2, stops at the saved step, and its torchrun restarts it at world size 2 from that step with the same
    digest, in the same exec; nothing is written under the durable root; each agent's status names the job's
    new size and the change."""
    from agent.client.dcp import latest_committed

    ckpt = tmp_path / "ckpt"
    port = free_port()
    launcher = elastic_flags(port)  # with the short rendezvous waits (tests/e2e/test_shrink.py)
    args = ["--steps", "100000", "--step-time", "0.05", "--log-every", "5"]
    async with hosts(3) as three:
        runs: list[HostRun] = []
        try:
            for node, host in enumerate(three):
                runs.append(
                    await HostRun.start(host, node, 3, port, ckpt, args, launcher=launcher, script=JOB_SCRIPT)
                )
            for run in runs:  # a slow host may join after a round of two: then all restart at three
                await _until(run, lambda e: e["event"] == "step" and e["world_size"] == 3)
            leaving = next(i for i in range(3) if i != store_host(runs, port))
            await drill_host(three[leaving])
            code = await runs[leaving].finish(timeout=120)
            assert EXIT_PREEMPTED == code, runs[leaving].stderr[-4000:]
            [left] = runs[leaving].of("stopped")
            assert ("leave", 2) == (left["reform"]["action"], left["reform"]["world_size"]), left
            staying = [run for i, run in enumerate(runs) if i != leaving]
            for run in staying:
                stopped = await _until(run, lambda e: e["event"] == "stopped")
                assert ("restart", 3, 2) == (
                    stopped["reform"]["action"],
                    stopped["reform"]["previous_world_size"],
                    stopped["reform"]["world_size"],
                ), stopped
                assert (stopped["step"], stopped["digest"]) == (left["step"], left["digest"])
                resumed = await _until(run, lambda e: e["event"] == "resumed" and e["world_size"] == 2)
                assert (left["step"], left["digest"]) == (resumed["next_step"], resumed["digest"])
            for run in staying:  # training goes on at world size 2, under the same execs
                await _until(run, lambda e: e["event"] == "step" and e["world_size"] == 2)
                assert run.proc.returncode is None
            for index, host in enumerate(three):
                _, doc = await http_json(host.socket, "GET", "/v1/status")
                [entry] = doc["jobs"].values()
                assert (2, "left" if index == leaving else "reformed") == (entry["world_size"], entry["last"])
            assert latest_committed(ckpt, require_dcp=False) is None  # the step came from the hosts' RAM
        finally:
            await kill_runs(runs)
