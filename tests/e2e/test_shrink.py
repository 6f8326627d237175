"""Shrink, don't stop (issue 37), end to end: simulated hosts on this machine, each with its own agent and its
own ``preemptd exec -- torchrun --nnodes 2:3 --rdzv-backend c10d`` of examples/sharded_training.py with
``--tier peer`` over loopback (gloo on CPU). A drill on one host: its shard goes into the other hosts' RAM, its
exec exits 75, and the other hosts' execs keep running: their workers re-form at world size 2 in the same
processes and train on from the evacuated step with its full-state digest. Where the job cannot shrink (the
c10d store's own host has the notice, or fewer than MIN nodes would stay) every exec exits 75 as before.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path

import pytest

from agent.client import EXIT_PREEMPTED
from tests.hosts import (
    LONG_RUN,
    Host,
    HostRun,
    drill_host,
    elastic_flags,
    free_port,
    hosts,
    kill_runs,
    store_host,
)
from tests.lazy import HAS_TORCH
from tests.support import http_json

# The example with the evacuation's senders replaced, the first time only, by a death (the marker file says it
# happened): the notified rank dies as its transfer starts, and its restarted worker sends normally.
_DIE_SENDING_ONCE = """
import os, runpy, sys
import agent.client.peer._stream as evacuate_stream
import agent.client.peer.evacuate as evacuate

MARK = {mark!r}

def die(*args, **kwargs):
    open(MARK, "x").close()
    os._exit(9)

if not os.path.exists(MARK):
    evacuate.send_file = die
    evacuate_stream.send_piece = die
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""

pytestmark = [
    pytest.mark.slow,
    pytest.mark.torch_mp,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed"),
]


async def _start(
    group: Sequence[Host],
    ckpt: Path,
    nodes: str = "2:3",
    etcd: int | None = None,
    args: Sequence[str] = LONG_RUN,
) -> tuple[list[HostRun], int, list[str]]:
    """The example on every host of ``group`` under elastic torchrun (a c10d rendezvous, or etcd-v2 on the etcd
    server at port ``etcd``); the runs once every rank has its agent, the index of the host whose torchrun
    serves the c10d rendezvous store (-1 with etcd), and the launcher flags (for a host joining later)."""
    port = free_port() if etcd is None else etcd
    backend = "c10d" if etcd is None else "etcd-v2"
    runs: list[HostRun] = []
    launcher = elastic_flags(port, nodes, backend)
    try:
        for node, host in enumerate(group):
            runs.append(await HostRun.start(host, node, len(group), port, ckpt, args, launcher=launcher))
        for run in runs:
            await run.until("agent_connected")
        return runs, (-1 if etcd is not None else store_host(runs, port)), launcher
    except BaseException:
        await kill_runs(runs)
        raise


@pytest.mark.asyncio
async def test_a_drill_on_one_host_of_three_makes_it_leave_the_others_train_on_and_a_new_host_grows_it_back(
    tmp_path: Path,
) -> None:
    """3 hosts, ``--nnodes 2:3``, a drill on a host that does not serve the rendezvous store: that host's exec
    exits 75 and the others' keep running; their workers say ``reform`` ``continue`` 3 → 2, resume at world size
    2 from the evacuated step (its next step, the checkpoint's full-state digest) and train past it; nothing
    is written under the durable root. Then a fourth host joins the rendezvous: every torchrun restarts its
    workers at world size 3, which resume from the step saved (into the hosts' RAM) when they were stopped, with
    its digest, and the staying hosts' execs are still the same processes. With peer snapshots on (so rare that
    only the departure asks for one), the staying hosts take one at once and raise their rate: a notice on
    another host of the job is a hazard (agent.client.hazard.Siblings)."""
    ckpt = tmp_path / "ckpt"
    async with hosts(4) as four:
        three = four[:3]
        runs, store, launcher = await _start(three, ckpt, args=[*LONG_RUN, "--snapshot-every", "100000"])
        try:
            leaving = next(i for i in range(3) if i != store)
            await drill_host(three[leaving])
            code = await runs[leaving].finish(timeout=120)
            assert EXIT_PREEMPTED == code, runs[leaving].stderr[-4000:]
            staying = [run for i, run in enumerate(runs) if i != leaving]
            for run in staying:
                await run.until("resumed", timeout=120)
            [saved] = {(e["step"], e["digest"]) for e in runs[leaving].of("checkpoint") if e["emergency"]}
            for run in staying:
                [reform] = run.of("reform")
                assert ("continue", 3, 2, 2) == (
                    reform["action"],
                    reform["previous_world_size"],
                    reform["world_size"],
                    reform["nodes"],
                ), reform
                [resumed] = run.of("resumed")
                assert (saved[0], 2, saved[1], True) == (
                    resumed["next_step"],
                    resumed["world_size"],
                    resumed["digest"],
                    resumed["reformed"],
                )
            for run in staying:  # training goes on at world size 2, in the same execs
                while not [e for e in run.of("step") if e["world_size"] == 2 and e["step"] >= saved[0] + 10]:
                    await run.until_more(timeout=120)
                assert run.proc.returncode is None
                [rate] = run.of("snapshot_rate")
                assert (4.0, 50000) == (rate["hazard"], rate["every"]), rate
                assert any("left with a notice" in reason for reason in rate["reasons"]), rate
                assert saved[0] + 1 == run.of("snapshot")[0]["step"]  # at once, on the group of two
            [left] = runs[leaving].of("reform")
            assert ("leave", 2) == (left["action"], left["world_size"]), left
            # Each host's agent heard it from its ranks: preemptd status shows the job's size, the change and, on
            # the staying hosts, the snapshot rate it raised.
            for index, host in enumerate(three):
                _, doc = await http_json(host.socket, "GET", "/v1/status")
                [entry] = doc["jobs"].values()
                phases = ["left"] if index == leaving else ["reformed", "raised"]
                assert (2, phases) == (entry["world_size"], [h["phase"] for h in entry["history"]]), entry
            assert [] == list(ckpt.glob("step-*"))

            newcomer = await HostRun.start(four[3], 3, 3, 0, ckpt, LONG_RUN, launcher=launcher)
            runs.append(newcomer)
            grown = [*staying, newcomer]
            for run in grown:
                while not [e for e in run.of("resumed") if e["world_size"] == 3]:
                    await run.until_more(timeout=180)
            stopped = {
                (e["step"], e["digest"]) for run in staying for e in run.of("checkpoint") if e["emergency"]
            }
            stopped -= {saved}
            assert 1 == len(stopped), stopped  # the save when torchrun stopped the workers to grow
            [(step, digest)] = stopped
            starts = [e for run in grown for e in run.of("resumed") if e["world_size"] == 3]
            assert [(step, digest)] * 3 == [(e["next_step"], e["digest"]) for e in starts]
            assert all(run.proc.returncode is None for run in grown)
            # torchrun stopped the workers, exec got no signal: the hosts stayed, so the step went into their own
            # RAM and the newcomer's shards came from there, never through the durable root.
            assert [] == list(ckpt.glob("step-*"))
        finally:
            await kill_runs(runs)


@pytest.mark.asyncio
async def test_an_evacuation_torn_by_a_dying_rank_is_never_loaded_and_the_retry_of_the_notice_shrinks_the_job(
    tmp_path: Path,
) -> None:
    """A durable step first; then a drill on a host whose rank dies as its transfer starts: nothing is committed
    to any RAM tier, every staying rank falls back to the durable step, and torchrun restarts the workers at
    world size 3 from it (its digest on every rank: never a mixed state). The notice is still up: the restarted
    workers evacuate again, the host leaves and the others shrink to 2 from that step."""
    ckpt = tmp_path / "ckpt"
    wrapper = tmp_path / "die_sending_once.py"
    wrapper.write_text(_DIE_SENDING_ONCE.format(mark=str(tmp_path / "died")))
    args = ["--steps", "100000", "--step-time", "0.02", "--interval-s", "0.5", "--log-every", "5"]
    async with hosts(3) as three:
        port = free_port()
        launcher = elastic_flags(port)
        runs: list[HostRun] = []
        try:
            for node, host in enumerate(three):
                runs.append(await HostRun.start(host, node, 3, port, ckpt, args, wrapper, launcher))
            for run in runs:
                await run.until("checkpoint")
            leaving = next(i for i in range(3) if i != store_host(runs, port))
            await drill_host(three[leaving])
            assert EXIT_PREEMPTED == await runs[leaving].finish(timeout=150), runs[leaving].stderr[-4000:]
            [saved] = {(e["step"], e["digest"]) for e in runs[leaving].of("checkpoint") if e["emergency"]}
            staying = [run for i, run in enumerate(runs) if i != leaving]
            for run in staying:
                while not [e for e in run.of("resumed") if e["world_size"] == 2]:
                    await run.until_more(timeout=150)
            durable = {
                (e["step"], e["digest"]) for run in runs for e in run.of("checkpoint") if not e["emergency"]
            }
            for run in staying:
                [fell] = run.of("preempted")
                assert fell["failed_step"] > fell["step"], fell
                first, again = run.of("resumed")
                assert (3, fell["step"]) == (first["world_size"], first["next_step"])
                assert (fell["step"], first["digest"]) in durable
                assert (2, saved) == (again["world_size"], (again["next_step"], again["digest"]))
                assert run.proc.returncode is None
        finally:
            await kill_runs(runs)


@pytest.mark.asyncio
async def test_a_notice_during_a_grow_back_leaves_the_job_at_the_same_size_with_one_digest(
    tmp_path: Path,
) -> None:
    """``--nnodes 2:4`` on 3 hosts; a 4th host joins and, as every torchrun stops its workers to grow, a drill
    comes on a host that does not serve the store: whichever comes first, the noticed host leaves (its exec
    exits 75) and the three others train on at world size 3, all from the same step with the same digest."""
    ckpt = tmp_path / "ckpt"
    async with hosts(4) as four:
        runs, store, launcher = await _start(four[:3], ckpt, nodes="2:4")
        try:
            leaving = next(i for i in range(3) if i != store)
            newcomer = await HostRun.start(four[3], 3, 4, 0, ckpt, LONG_RUN, launcher=launcher)
            runs.append(newcomer)
            await drill_host(four[leaving])
            assert EXIT_PREEMPTED == await runs[leaving].finish(timeout=180), runs[leaving].stderr[-4000:]
            staying = [run for i, run in enumerate(runs) if i != leaving]
            # The three started fresh (no "resumed"): a start at world size 3 comes only after the change.
            for run in staying:
                while not [e for e in run.of("resumed") if e["world_size"] == 3]:
                    await run.until_more(timeout=180)
            last = [[e for e in run.of("resumed") if e["world_size"] == 3][-1] for run in staying]
            assert 1 == len({(e["next_step"], e["digest"]) for e in last}), last
            assert all(run.proc.returncode is None for run in staying)
        finally:
            await kill_runs(runs)


@pytest.mark.asyncio
async def test_a_drill_on_the_host_serving_the_c10d_store_stops_the_job_on_every_host(tmp_path: Path) -> None:
    """The c10d rendezvous store lives in one torchrun: a notice on its host cannot shrink the job (the others'
    torchrun would lose the rendezvous). Every exec exits 75 after the evacuation and says why."""
    async with hosts(3) as three:
        runs, store, _ = await _start(three, tmp_path / "ckpt")
        try:
            await drill_host(three[store])
            codes = [await run.finish(timeout=120) for run in runs]
            assert [EXIT_PREEMPTED] * 3 == codes, [run.stderr[-3000:] for run in runs]
            reforms = [e for run in runs for e in run.of("reform")]
            assert ["stop"] * 3 == [r["action"] for r in reforms]
            assert all("rendezvous store" in r["reason"] for r in reforms), reforms
        finally:
            await kill_runs(runs)


@pytest.mark.asyncio
async def test_a_drill_that_would_leave_fewer_than_min_nodes_stops_the_job_on_every_host(
    tmp_path: Path,
) -> None:
    """``--nnodes 2:3`` on 2 hosts: one leaving would leave 1 < MIN. Every exec exits 75 (torchrun stopped, not
    restarting its workers into the window), as a static job does."""
    async with hosts(2) as two:
        runs, store, _ = await _start(two, tmp_path / "ckpt")
        try:
            await drill_host(two[1 - store])
            codes = [await run.finish(timeout=120) for run in runs]
            assert [EXIT_PREEMPTED] * 2 == codes, [run.stderr[-3000:] for run in runs]
            reforms = [e for run in runs for e in run.of("reform")]
            assert [("stop", 2)] * 2 == [(r["action"], r["world_size"]) for r in reforms]
            assert all("below --nnodes MIN 2" in r["reason"] for r in reforms), reforms
            assert all(len(run.of("fresh")) == 1 for run in runs)  # no worker was restarted
        finally:
            await kill_runs(runs)


@pytest.mark.service
@pytest.mark.asyncio
async def test_with_an_etcd_rendezvous_any_host_can_leave_even_rank_0s(tmp_path: Path, etcd: int) -> None:
    """``--rdzv-backend etcd-v2``: no torchrun holds the rendezvous, so a notice on the host of rank 0 (which
    serves the workers' first store, and the c10d store under c10d) shrinks the job like any other."""
    async with hosts(3) as three:
        runs, _, _ = await _start(three, tmp_path / "ckpt", etcd=etcd)
        try:
            leaving = next(i for i, run in enumerate(runs) if run.of("fresh")[0]["rank"] == 0)
            await drill_host(three[leaving])
            assert EXIT_PREEMPTED == await runs[leaving].finish(timeout=120), runs[leaving].stderr[-4000:]
            staying = [run for i, run in enumerate(runs) if i != leaving]
            for run in staying:
                await run.until("resumed", timeout=120)
                [reform] = run.of("reform")
                assert ("continue", 2) == (reform["action"], reform["world_size"]), reform
                while not [e for e in run.of("step") if e["world_size"] == 2]:
                    await run.until_more(timeout=120)
                assert run.proc.returncode is None
        finally:
            await kill_runs(runs)


@pytest.mark.asyncio
async def test_a_host_lost_without_a_notice_shrinks_the_elastic_job_from_the_newest_snapshot(
    tmp_path: Path,
) -> None:
    """Issue 38, "Recovery without a notice", for an elastic job: 3 hosts under ``--nnodes 2:3`` take a peer
    snapshot every 10 steps; one host (not the rendezvous store's) dies with no warning: its ranks and agent
    killed, its RAM tier gone. The survivors' collectives fail, torchrun restarts their workers at world size 2
    (a restart it had left), and they resume from the newest snapshot that is complete on the surviving hosts,
    with the digest it had when it was taken: at most one snapshot interval lost, nothing read from disk."""
    every = 10
    ckpt = tmp_path / "ckpt"
    args = [*LONG_RUN, "--snapshot-every", str(every), "--collective-timeout-s", "30"]
    async with hosts(3) as three:
        runs, store, _ = await _start(three, ckpt, args=args)
        try:
            lost = next(i for i in range(3) if i != store)
            for run in runs:  # two snapshots taken, so that one is committed on every host
                while len(run.of("snapshot")) < 2:
                    await run.until_more(timeout=120)
            await kill_runs([runs[lost]])
            await three[lost].stop()
            shutil.rmtree(three[lost].ram)
            before = max(e["step"] for run in runs for e in run.of("step"))
            taken = {e["step"]: e["digest"] for run in runs for e in run.of("snapshot")}
            staying = [run for i, run in enumerate(runs) if i != lost]
            for run in staying:
                while not [e for e in run.of("resumed") if e["world_size"] == 2]:
                    await run.until_more(timeout=180)
            starts = {(e["next_step"], e["digest"]) for run in staying for e in run.of("resumed")}
            assert 1 == len(starts), starts  # one step, one digest on every surviving rank
            [(step, digest)] = starts
            assert taken.get(step) == digest, (step, taken)  # the snapshot as it was taken
            assert before - step <= 2 * every + 5 * len(runs), (before, step)  # the interval, give or take
            for run in staying:  # and training goes on at world size 2, in the same execs
                while not [e for e in run.of("step") if e["world_size"] == 2 and e["step"] >= step + 10]:
                    await run.until_more(timeout=120)
                assert run.proc.returncode is None
            assert [] == list(ckpt.glob("step-*"))
        finally:
            await kill_runs(runs)
