"""An elastic job under Slurm keeps its allocation when one host leaves (issue 37, "Schedulers keep the job,
lose the node"; docs/slurm.md, "Elastic jobs"). One real Slurm job (tests/slurm_cluster.py) runs two simulated
hosts' ``preemptd exec -- torchrun --nnodes 1:2 --rdzv-backend etcd-v2`` of examples/sharded_training.py (a
real etcd, as in tests/e2e/test_shrink.py); host 0's agent has the Slurm bridge. A drill there: host 0's ranks
evacuate and leave (exec exits 75), host 1's re-form at world size 1 and train on, and the bridge drains the
node. Launched by ``srun --no-kill``, the job is kept running: its ranks told the agent it is elastic
(``min_nodes``, set by exec) and that it went on without this node. As a batch job whose script runs on this
node it is requeued, since Slurm ends a batch job with its batch host."""

from __future__ import annotations

import asyncio
import contextlib
import json
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.bridges.slurm import agent_settings, slurm_status
from tests.hosts import EXAMPLE, JOB, LONG_RUN, Host, drill_host, elastic_flags, hosts
from tests.lazy import HAS_TORCH
from tests.slurm_cluster import SlurmCluster
from tests.support import REPO, http_json

pytestmark = [
    pytest.mark.slow,
    pytest.mark.torch_mp,
    pytest.mark.service,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed"),
]


def _script(group: list[Host], launcher: list[str], ckpt: Path, out: Path) -> str:
    """The batch script: each host's exec in the background, its JSON progress in ``out/<i>.jsonl`` and its
    exit status in ``out/<i>.exit``."""
    lines = [
        f"echo $SLURM_JOB_ID > {out / 'job'}",
        f"cd {shlex.quote(str(REPO))}",
        f"export PYTHONPATH={shlex.quote(str(REPO))} GLOO_SOCKET_IFNAME=lo OMP_NUM_THREADS=1 PREEMPTD_JOB_ID={JOB}",
    ]
    for host in group:
        example = [
            str(EXAMPLE),
            "--checkpoint-dir",
            str(ckpt),
            "--socket",
            str(host.socket),
            "--tier",
            "peer",
        ]
        torchrun = [sys.executable, "-m", "torch.distributed.run", *launcher, "--nproc-per-node", "1"]
        command = [sys.executable, "-m", "agent", "exec", "--", *torchrun, *example, *LONG_RUN]
        progress, errors = out / f"{host.index}.jsonl", out / f"{host.index}.err"
        lines.append(
            f"(PREEMPTD_SOCKET={host.socket} {shlex.join(command)} > {progress} 2> {errors}; "
            f"echo $? > {out / f'{host.index}.exit'}) &"
        )
    lines.append("wait")
    return "\n".join(lines)


def events(out: Path, index: int) -> list[dict[str, Any]]:
    try:
        text = (out / f"{index}.jsonl").read_text()
    except OSError:
        return []
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


async def until(check: Callable[[], Any], what: str, out: Path, timeout: float = 150.0) -> Any:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        found = check()
        if found:
            return found
        await asyncio.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}: {_errors(out)}")


def _errors(out: Path) -> dict[str, str]:
    """Each host's stderr (the end of it)."""
    return {p.name: p.read_text()[-3000:] for p in sorted(out.glob("*.err"))}


async def _bridge_done(host: Host, timeout: float = 60.0) -> dict[str, Any]:
    """The Slurm bridge's work on the host's one notice, once it is done."""
    end = time.monotonic() + timeout
    while True:
        _, doc = await http_json(host.socket, "GET", "/v1/status")
        work = next(iter(slurm_status(doc)["notices"].values()), None)
        if work and work["phase"] == "done":
            return dict(work)
        assert time.monotonic() < end, slurm_status(doc)
        await asyncio.sleep(0.2)


@contextlib.contextmanager
def launched(cluster: SlurmCluster, how: str, script: str, out: Path) -> Iterator[None]:
    """The script as a batch job (``sbatch --requeue --no-kill``), or as the one task of ``srun --no-kill``'s
    own allocation (no batch script)."""
    proc = None
    if how == "sbatch":
        cluster.submit(script, "--requeue", "--no-kill")
    else:
        path = out / "job.sh"
        path.write_text(script + "\n")
        argv = ["srun", "--no-kill", "-N1", "-n1", "bash", str(path)]
        proc = subprocess.Popen(argv, env=cluster.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield
    finally:
        cluster.cancel_all()
        if proc is not None:
            proc.wait(timeout=60)


@pytest.mark.parametrize("how", ["srun", "sbatch"])
async def test_a_drill_on_one_node_of_an_elastic_slurm_job_drains_it_and_the_job_goes_on_unless_it_cannot(
    cluster: SlurmCluster, etcd: int, tmp_path: Path, how: str
) -> None:
    """srun's allocation outlives the node: the job is kept, still running with host 1's ranks at world size
    1. A batch job's script runs on this node (the only one here), so Slurm would end the job with it: the
    bridge requeues it although it shrank, and says why."""
    out = tmp_path / "out"
    out.mkdir()
    async with hosts(2, {0: agent_settings(cluster)}) as group:
        script = _script(group, elastic_flags(etcd, "1:2", "etcd-v2"), tmp_path / "ckpt", out)
        with launched(cluster, how, script, out):
            await _shrunk(group, out)
            job_id = int((out / "job").read_text())
            work = await _bridge_done(group[0])
            [job] = work["jobs"]
            assert (job["job_id"], job["elastic"]) == (job_id, {"min_nodes": 1, "max_nodes": 2})
            assert (work["drain"], job["membership"]["phase"]) == ("drained", "left")
            if how == "srun":
                assert job["outcome"] == (
                    "kept: elastic, this node left and the job goes on at world size 1 on its other nodes"
                )
                found = cluster.job(job_id)
                assert (found["state"], found["restart_cnt"]) == ("RUNNING", 0)
                assert not (out / "1.exit").exists()  # host 1's exec still runs, in the same allocation
            else:
                assert (job["outcome"], job["elastic_note"][:35]) == (
                    "requeued",
                    "not kept: its batch script runs on ",
                )
                found = await asyncio.to_thread(
                    cluster.wait_job, job_id, lambda j: j["restart_cnt"] == 1, 60.0
                )
                assert found["state"] in ("PENDING", "COMPLETING"), found


async def _shrunk(group: list[Host], out: Path) -> None:
    """Both hosts train; a drill on host 0: its exec exits 75, host 1's ranks re-form at world size 1."""
    for index in (0, 1):
        await until(lambda i=index: [e for e in events(out, i) if e["event"] == "step"], "training", out)
    await drill_host(group[0])
    await until((out / "0.exit").exists, "host 0's exec to exit", out)
    assert "75" == (out / "0.exit").read_text().strip()
    [reform] = [e for e in events(out, 1) if e["event"] == "reform"]
    assert ("continue", 1) == (reform["action"], reform["world_size"]), reform
    await until(
        lambda: [e for e in events(out, 1) if e["event"] == "step" and e["world_size"] == 1],
        "host 1 training at world size 1",
        out,
    )
