"""Peer snapshots (issue 38), end to end: three simulated hosts (one agent and RAM tier each) run
examples/sharded_training.py under ``preemptd exec -- torchrun --nnodes 3`` with ``--tier peer
--snapshot-every K``. Every K steps each host's shard lands in its own RAM tier and the next host's; the
newest two snapshots are kept. Host 1 then dies without a notice in the middle of a snapshot (its rank
SIGKILLed as it starts sending, its agent stopped, its RAM tier deleted): the job relaunched on hosts 0 and 2
resumes from the newest snapshot that was committed, with the digest it had when it was taken, never from the
torn one, though nothing was ever written under the durable root."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from agent.client import EXIT_PREEMPTED
from tests.hosts import JOB, Host, finished, hosts, train
from tests.lazy import HAS_TORCH
from tests.support import http_json

pytestmark = [
    pytest.mark.slow,
    pytest.mark.torch_mp,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed"),
]

EVERY = 10
TORN = 6 * EVERY  # the snapshot host 1 dies in

# The example, except that the rank dies as soon as the snapshot of step TORN starts sending its files.
_DIE_IN_SNAPSHOT = """
import os, runpy, sys
from agent.client.peer import snapshot

exchange = snapshot.Snapshot._exchange

def dying(self, the_plan, directory, *args):
    if int(directory.name) >= {torn}:
        os._exit(9)
    return exchange(self, the_plan, directory, *args)

snapshot.Snapshot._exchange = dying
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def committed(host: Host) -> list[int]:
    """The job's steps the host's agent holds, committed (newest first)."""
    return [record.step for record in host.tier.holdings.steps_of(os.getuid(), JOB)]


def tier_doc(host: Host, step: int) -> dict[str, Any]:
    return dict(json.loads((host.step_dir(step) / "tier.json").read_text()))


async def test_snapshots_land_in_two_hosts_and_a_host_lost_mid_snapshot_costs_only_the_steps_since_the_last(
    tmp_path: Path,
) -> None:
    ckpt = tmp_path / "ckpt"
    wrapper = tmp_path / "die_in_snapshot.py"
    wrapper.write_text(_DIE_IN_SNAPSHOT.format(torn=TORN))
    # Host 1's death can leave a survivor blocked in a training collective (gloo's default: 30 min): 60 s here.
    args = (
        "--steps",
        "100000",
        "--step-time",
        "0.02",
        "--snapshot-every",
        str(EVERY),
        "--collective-timeout-s",
        "60",
    )
    async with hosts(3) as three:
        runs = await train(three, ckpt, *args, wrappers={1: wrapper})
        codes = await finished(runs)
        assert all(code != 0 for code in codes), codes  # the job cannot go on without host 1
        taken = {(e["step"], e["digest"]) for run in runs for e in run.of("snapshot")}
        digests = dict(taken)
        assert len(digests) == len(taken), taken  # one digest per step on every rank
        held = [committed(host) for host in three]
        # Each snapshot that was committed is on every host, the newest two kept, the torn one on none.
        assert held[0] == held[1] == held[2], held
        assert held[0] == [TORN - EVERY, TORN - 2 * EVERY]
        # Host i holds its own files and host i-1's: every file of the step on two hosts.
        docs = [tier_doc(host, held[0][0]) for host in three]
        owners = [sorted({entry["rank"] for entry in doc["files"].values()}) for doc in docs]
        assert [[0, 2], [0, 1], [1, 2]] == owners, owners
        assert all(doc["snapshot"] is True for doc in docs)
        # Each agent's status says where the copies are: the ranks held here, and every host's holder and why.
        _, status = await http_json(three[0].socket, "GET", "/v1/status")
        newest = status["ram_tier"]["jobs"][f"{os.getuid()}/{JOB}"]["newest"]
        assert (held[0][0], "snapshot", [0, 2]) == (newest["step"], newest["kind"], newest["ranks_here"])
        order = sorted(newest["placement"])  # hosts by name here; each one's holder is the next in the ring
        assert 3 == len(order) and {e["rule"] for e in newest["placement"].values()} == {"ring"}, newest
        assert [] == list(ckpt.glob("step-*"))

        await three[1].stop()  # host 1 is gone, and its RAM with it
        shutil.rmtree(three[1].ram)
        again = await train([three[0], three[2]], ckpt, "--steps", str(TORN + 2))
        restarted = await finished(again)
    assert [0, 0] == restarted, [run.stderr[-3000:] for run in again]
    starts = [(e["next_step"], e["world_size"], e["digest"]) for run in again for e in run.of("resumed")]
    newest = TORN - EVERY
    assert [(newest, 2, digests[newest])] * 2 == starts


async def test_a_notice_while_snapshots_run_every_step_evacuates_cleanly_and_the_job_resumes_from_it(
    tmp_path: Path,
) -> None:
    """A snapshot every step, so one is in flight whenever the drill comes: the emergency save waits for it
    and evacuates; every exec exits 75 and the job relaunched on hosts 0 and 2 resumes from the evacuated step
    with its digest, newer than any snapshot."""
    ckpt = tmp_path / "ckpt"
    async with hosts(3) as three:
        runs = await train(three, ckpt, "--steps", "100000", "--step-time", "0.02", "--snapshot-every", "1")
        for run in runs:
            while len(run.of("snapshot")) < 5:
                await run.until_more(timeout=120)
        status, body = await http_json(
            three[1].socket, "POST", "/v1/drills", {"kind": "termination", "in_s": 60}
        )
        assert status == 201, body
        codes = await finished(runs)
        assert [EXIT_PREEMPTED] * 3 == codes, [run.stderr[-3000:] for run in runs]
        [saved] = {(e["step"], e["digest"]) for run in runs for e in run.of("checkpoint") if e["emergency"]}
        assert saved[0] >= max(e["step"] for run in runs for e in run.of("snapshot"))
        await three[1].stop()
        shutil.rmtree(three[1].ram)
        again = await train([three[0], three[2]], ckpt, "--steps", str(saved[0] + 2))
        restarted = await finished(again)
    assert [0, 0] == restarted, [run.stderr[-3000:] for run in again]
    starts = [(e["next_step"], e["digest"]) for run in again for e in run.of("resumed")]
    assert [saved] * 2 == starts


async def test_when_every_host_is_in_one_capacity_pool_each_snapshot_keeps_a_second_remote_copy(
    tmp_path: Path,
) -> None:
    """Three hosts whose agents read one AWS simulator (one instance type, zone and capacity: one pool). Each
    host's holder is in its own pool, so each snapshot also goes to the third host: every host holds every
    rank's files, and each agent's status names each host's holder and its second holder."""
    from agent.simulate import AwsSimulator

    async with AwsSimulator() as sim:
        cloud = {"cloud": "aws", "aws.endpoint": sim.url, "gpu.enabled": False, "host.enabled": False}
        async with hosts(3, dict.fromkeys(range(3), cloud)) as three:
            args = ("--steps", str(2 * EVERY + 2), "--step-time", "0.02", "--snapshot-every", str(EVERY))
            runs = await train(three, tmp_path / "ckpt", *args)
            codes = await finished(runs)
            assert [0, 0, 0] == codes, [run.stderr[-3000:] for run in runs]
            held = [committed(host) for host in three]
            assert held[0] == held[1] == held[2] and held[0], held
            docs = [tier_doc(host, held[0][0]) for host in three]
            owners = [sorted({entry["rank"] for entry in doc["files"].values()}) for doc in docs]
            assert [[0, 1, 2]] * 3 == owners, owners
            _, status = await http_json(three[0].socket, "GET", "/v1/status")
    placement = status["ram_tier"]["jobs"][f"{os.getuid()}/{JOB}"]["newest"]["placement"]
    assert 3 == len(placement) and {e["rule"] for e in placement.values()} == {"same_pool"}, placement
    for host, entry in placement.items():
        assert len({host, entry["holder"], entry["second"]}) == 3, placement
