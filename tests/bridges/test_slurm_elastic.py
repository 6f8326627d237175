"""The Slurm bridge and elastic jobs (docs/slurm.md, "Elastic jobs"), against the real one-node Slurm of
tests/slurm_cluster.py: a job whose ranks registered as elastic (``client.min_nodes``) is requeued only when
its ranks say it stopped, or said nothing by the latest moment; a job that goes on without this node (its ranks
here ``left``) stays running, and status says why. The reports are parsed as the agent parses those it
receives. tests/bridges/test_slurm_shrink.py runs the same with torchrun inside the Slurm job."""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import pytest

from agent.bridges.slurm import SlurmBridge
from agent.core.notice import EventType, Notice, utcnow
from agent.core.reports import parse_report
from tests.actions_support import event, make_notice
from tests.bridges.slurm import bridge_for, drained_for_a_notice, running, until
from tests.slurm_cluster import SlurmCluster

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]


def report(job_id: int, kind: str, phase: str, **membership: Any) -> Any:
    """A report of the job's rank 0 on this host, as a client under ``preemptd exec -- torchrun --nnodes 2:3``
    inside Slurm job ``job_id`` sends it."""
    client = {"pid": 4242, "rank": 0, "slurm_job_id": str(job_id), "min_nodes": 2, "max_nodes": 3}
    doc: dict[str, Any] = {"kind": kind, "phase": phase, "client": {**client, "participant": True}}
    if membership:
        doc.update(step=1234, membership=membership)
    return parse_report(doc, utcnow())


@contextmanager
def allocation(cluster: SlurmCluster) -> Iterator[int]:
    """A job run by ``srun --no-kill`` itself (an interactive allocation, no batch script): Slurm keeps it when
    one of its nodes fails, whichever; the job's id."""
    name = f"elastic-{time.monotonic_ns()}"
    argv = ["srun", "--no-kill", "-J", name, "-N1", "-n1", "sleep", "300"]
    proc = subprocess.Popen(argv, env=cluster.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        end = time.monotonic() + 30
        while not (ids := cluster.run("squeue", "-h", "-n", name, "-t", "R", "-o", "%i").stdout.split()):
            assert time.monotonic() < end and proc.poll() is None, "srun's job never ran"
            time.sleep(0.2)
        yield int(ids[0])
    finally:
        proc.terminate()
        proc.wait(timeout=30)


async def acting(bridge: SlurmBridge, notice: Notice) -> None:
    bridge.handle(event(EventType.READY, notice, {"notice_id": notice.id}))
    await until(lambda: bridge.status()["notices"][notice.id]["phase"] in ("acting", "done"), what="acting")


def job_entry(bridge: SlurmBridge, notice: Notice, job_id: int) -> dict[str, Any]:
    return next(j for j in bridge.status()["notices"][notice.id]["jobs"] if j["job_id"] == job_id)


async def test_an_elastic_job_that_goes_on_without_this_node_is_not_requeued(cluster: SlurmCluster) -> None:
    """Ready comes with the flush; the bridge waits for the job's word past ``stop_wait_s`` (the job runs on);
    ``left`` keeps the job running, and status names why; the node stays drained."""
    with allocation(cluster) as job_id:
        await _kept(cluster, job_id)


async def _kept(cluster: SlurmCluster, job_id: int) -> None:
    bridge = bridge_for(cluster, stop_wait_s=0.5)
    bridge.on_report(report(job_id, "participant", "registered"))
    notice = await drained_for_a_notice(cluster, bridge)
    await acting(bridge, notice)
    await asyncio.sleep(2.0)  # four times stop_wait_s: a plain job would have been requeued by now
    assert bridge.status()["notices"][notice.id]["phase"] == "acting"
    assert cluster.job(job_id)["restart_cnt"] == 0
    bridge.on_report(report(job_id, "membership", "left", world_size=2, previous_world_size=3))
    await until(lambda: bridge.status()["notices"][notice.id]["phase"] == "done", what="the requeue step")
    job = job_entry(bridge, notice, job_id)
    assert (
        job["outcome"]
        == "kept: elastic, this node left and the job goes on at world size 2 on its other nodes"
    )
    assert job["elastic"] == {"min_nodes": 2, "max_nodes": 3}
    assert (job["membership"]["phase"], job["membership"]["previous_world_size"]) == ("left", 3)
    found = cluster.job(job_id)
    assert (found["state"], found["restart_cnt"]) == ("RUNNING", 0)
    assert cluster.node_state()["states"] & {"DRAIN", "DRAINED", "DRAINING"}
    (skipped,) = [a for a in bridge.status()["actions"] if a["action"] == "requeue"]
    assert (skipped["outcome"], skipped["target"]) == ("skipped", str(job_id))
    await bridge.stop(1)


async def test_an_elastic_job_that_could_not_shrink_is_requeued(cluster: SlurmCluster) -> None:
    """``stopped`` (below MIN, or the store on this node): every rank flushed and stops: today's requeue."""
    job_id = running(cluster, "--requeue")
    bridge = bridge_for(cluster, stop_wait_s=0.5)
    bridge.on_report(report(job_id, "participant", "registered"))
    notice = await drained_for_a_notice(cluster, bridge)
    await acting(bridge, notice)
    bridge.on_report(
        report(job_id, "membership", "stopped", world_size=2, previous_world_size=2, reason="below MIN")
    )
    requeued = await asyncio.to_thread(cluster.wait_job, job_id, lambda j: j["state"] == "PENDING")
    assert requeued["restart_cnt"] == 1
    await until(lambda: bridge.status()["notices"][notice.id]["phase"] == "done", what="the requeue step")
    job = job_entry(bridge, notice, job_id)
    assert (job["outcome"], job["membership"]["phase"]) == ("requeued", "stopped")
    await bridge.stop(1)


async def test_an_elastic_job_that_says_nothing_is_acted_on_at_the_latest_moment(
    cluster: SlurmCluster,
) -> None:
    """No word since the notice (a ``left`` from an earlier shrink does not count): the bridge waits until the
    deadline minus the margin, not longer, then acts as for any job (srun's is not a batch job: left alone)."""
    with allocation(cluster) as job_id:
        bridge = bridge_for(cluster, stop_wait_s=0.5, margin_s=594.0)
        bridge.on_report(report(job_id, "participant", "registered"))
        bridge.on_report(report(job_id, "membership", "left", world_size=2, previous_world_size=3))
        notice = make_notice(deadline_in=600)
        bridge.handle(event(EventType.NOTICE, notice))
        await acting(bridge, notice)
        assert notice.deadline is not None
        latest = notice.deadline - timedelta(seconds=594.0)
        await until(lambda: bridge.status()["notices"][notice.id]["phase"] == "done", what="the requeue step")
        assert utcnow() >= latest
        job = job_entry(bridge, notice, job_id)
        assert job["outcome"] == "left alone: not a batch job (Slurm requeues only jobs that sbatch started)"
        assert "membership" not in job
        await bridge.stop(1)


async def test_an_elastic_batch_job_whose_script_runs_here_is_requeued(cluster: SlurmCluster) -> None:
    """A batch job's script runs on its batch host: Slurm ends the job when that node fails, --no-kill or not,
    so the bridge requeues it even though its ranks here left and the others went on, and says why."""
    job_id = running(cluster, "--requeue", "--no-kill")
    bridge = bridge_for(cluster, stop_wait_s=0.5)
    bridge.on_report(report(job_id, "participant", "registered"))
    notice = await drained_for_a_notice(cluster, bridge)
    await acting(bridge, notice)
    bridge.on_report(report(job_id, "membership", "left", world_size=2, previous_world_size=3))
    requeued = await asyncio.to_thread(cluster.wait_job, job_id, lambda j: j["state"] == "PENDING")
    assert requeued["restart_cnt"] == 1
    await until(lambda: bridge.status()["notices"][notice.id]["phase"] == "done", what="the requeue step")
    job = job_entry(bridge, notice, job_id)
    assert job["outcome"] == "requeued"
    assert job["elastic_note"].startswith("not kept: its batch script runs on "), job
    await bridge.stop(1)


async def test_a_job_that_never_registered_as_elastic_is_requeued_after_stop_wait(
    cluster: SlurmCluster,
) -> None:
    """Reports without ``min_nodes`` (a static launch): no waiting for a word, today's requeue."""
    job_id = running(cluster, "--requeue")
    bridge = bridge_for(cluster, stop_wait_s=0.5)
    plain = parse_report(
        {
            "kind": "participant",
            "phase": "registered",
            "client": {"participant": True, "slurm_job_id": str(job_id)},
        },
        utcnow(),
    )
    bridge.on_report(plain)
    notice = await drained_for_a_notice(cluster, bridge)
    await acting(bridge, notice)
    requeued = await asyncio.to_thread(cluster.wait_job, job_id, lambda j: j["state"] == "PENDING")
    assert requeued["restart_cnt"] == 1
    assert "elastic" not in job_entry(bridge, notice, job_id)
    await bridge.stop(1)
