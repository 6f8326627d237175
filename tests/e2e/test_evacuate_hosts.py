"""Evacuate, don't flush (issue 24 items 2 and 4), end to end: simulated hosts on this machine, each with its own
agent (own socket, state directory and RAM-tier directory) and its own ``preemptd exec -- torchrun --nnodes N
--node-rank i`` of examples/sharded_training.py with ``--tier peer`` over loopback (gloo on CPU). A drill on
one host puts its shard into another host's RAM tier; nothing is written under the durable root; every
``exec`` exits 75. With that host gone, the job resumes from the other hosts' RAM on 2 hosts, or on 2 and a
new empty one, at the next step with the same full-state digest.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import textwrap
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from agent.client import EXIT_PREEMPTED
from tests.hosts import JOB, Host, HostRun, file_tree, hosts, train
from tests.lazy import HAS_TORCH
from tests.support import http_json

# torch runs in the ranks' processes (and one test imports it itself): collecting this module imports none.
pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed"),
]


async def _evacuated(three: list[Host], ckpt: Path) -> tuple[list[HostRun], list[int], dict[str, Any]]:
    """Train on the three hosts until a drill on host 1: the runs, their exit codes, the tree of the
    durable root before the drill."""
    runs = await train(three, ckpt, "--steps", "100000", "--step-time", "0.02")
    for run in runs:
        await run.until("agent_connected")
    before = file_tree(ckpt)
    status, body = await http_json(three[1].socket, "POST", "/v1/drills", {"kind": "termination", "in_s": 60})
    assert status == 201, body
    return runs, [await run.finish() for run in runs], before


@dataclass
class Evacuation:
    """One evacuation on hosts 0-2 (a drill on host 1), as the tests below find it: what it left right after
    the exits, and the hosts (a fourth, new and empty, idles for the resume at world size 3)."""

    every: list[Host]
    ckpt: Path
    runs: list[HostRun]
    codes: list[int]
    before: dict[str, Any]
    held: list[list[Any]]
    left: list[bool]
    tier_files: list[dict[str, Any]]
    saved: tuple[int, str]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def evacuated(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Evacuation]:
    """The evacuation the tests of this module share (each costs ~30 s of nine processes starting, six of
    them importing torch): what it left is read at once, then host 1 is gone (its agent stopped, its RAM tier
    deleted). The resumes that follow add to hosts 0 and 2's tiers (a host receives the files its ranks
    lack) but leave the evacuated step the newest one, so each resumes from it whatever ran before."""
    ckpt = tmp_path_factory.mktemp("evacuated") / "ckpt"
    async with hosts(4) as every:
        runs, codes, before = await _evacuated(every[:3], ckpt)
        steps = {(e["step"], e["digest"]) for run in runs for e in run.of("checkpoint")}
        assert len(steps) == 1, steps
        [saved] = steps
        held = [host.tier.holdings.steps_of(os.getuid(), JOB) for host in every[:3]]
        left = [host.step_dir(saved[0]).exists() for host in every[:3]]
        tier_files = [json.loads((every[i].step_dir(saved[0]) / "tier.json").read_text()) for i in (0, 2)]
        await every[1].stop()
        shutil.rmtree(every[1].ram)
        yield Evacuation(every, ckpt, runs, codes, before, held, left, tier_files, saved)


@pytest.mark.asyncio(loop_scope="module")
async def test_a_drill_on_one_host_moves_its_shard_into_the_next_hosts_ram_and_every_exec_exits_75(
    evacuated: Evacuation,
) -> None:
    """3 hosts of 1 rank, a drill on host 1: its shard is in host 2's RAM tier (the next host in the ring
    without a notice), host 0 keeps its own shard and DCP's .metadata, host 1's RAM copy is freed, each
    surviving host's tier.json is committed to its agent, the durable root is untouched, every exec exits 75."""
    e = evacuated
    step = e.saved[0]
    assert [EXIT_PREEMPTED] * 3 == e.codes, [run.stderr[-3000:] for run in e.runs]
    assert e.before == file_tree(e.ckpt)
    assert [[step], [], [step]] == [[record.step for record in records] for records in e.held]
    assert {".metadata", "__0_0.distcp"} == set(e.held[0][0].files)
    assert {"__1_0.distcp", "__2_0.distcp"} == set(e.held[2][0].files)
    assert [True, False, True] == e.left
    assert [True, True] == [doc["complete"] for doc in e.tier_files]
    # The step carries the notified host's notice on the hosts that hold it, so a resume marks it handled.
    assert [True, True] == [str(doc["notice_id"]).startswith("drill-") for doc in e.tier_files]
    assert {".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp"} == set(e.tier_files[0]["step_files"])
    # Where host 1's shards went, and why: the agents' status shows it (ram_tier.jobs.<job>.newest.placement).
    [(notified, where)] = e.tier_files[0]["placement"].items()
    assert ("ring", True) == (where["rule"], where["holder"].endswith(str(e.every[2].ram.resolve())))
    assert {notified: {"holder": where["holder"], "rule": "ring"}} == dict(e.held[2][0].placement)


@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.parametrize(("new_hosts", "restart"), [(0, False), (1, False), (0, True)])
async def test_with_the_notified_host_gone_the_job_resumes_from_the_other_hosts_ram_at_the_next_step(
    evacuated: Evacuation, new_hosts: int, restart: bool
) -> None:
    """After the evacuation, host 1 is gone (its agent stopped, its RAM tier deleted): the job resumes on
    hosts 0 and 2 (world size 2), or on them and a new empty host (world size 3), from their RAM tiers
    (each host receives the files its ranks need) at the next step with the checkpoint's full-state digest;
    the durable root holds no step. With ``restart``, host 2's agent restarts before the resume: it reads its
    inventory back (CRCs checked) and the resume finds the step there."""
    e = evacuated
    if restart:
        await e.every[2].stop()
        await e.every[2].start()
    group = [e.every[0], e.every[2], *e.every[3 : 3 + new_hosts]]
    resumed = await train(group, e.ckpt, "--steps", str(e.saved[0] + 2))
    codes = [await run.finish() for run in resumed]
    assert [0] * len(group) == codes, [run.stderr[-3000:] for run in resumed]
    starts = [event for run in resumed for event in run.of("resumed")]
    assert [(e.saved[0], len(group), e.saved[1])] * len(group) == [
        (s["next_step"], s["world_size"], s["digest"]) for s in starts
    ]
    assert [] == list(e.ckpt.glob("step-*"))


# Run the example with the evacuation's senders replaced by a death: the rank dies as its transfer starts
# (the files sent after the save, or the shard streamed during it).
_DIE_SENDING = textwrap.dedent(
    """
    import os, runpy, sys
    import agent.client.peer.evacuate as evacuate

    def die(*args, **kwargs):
        os._exit(9)

    evacuate.send_file = die
    import agent.client.peer._stream as evacuate_stream
    evacuate_stream.send_piece = die  # every frame a notified rank streams goes through it
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
    """
)


async def test_a_notified_rank_that_dies_mid_transfer_commits_nothing_and_the_others_exit_75_with_the_earlier_step(
    tmp_path: Path,
) -> None:
    """A periodic durable step first; then a drill on host 1, whose rank dies as it starts sending: no host
    commits the step to its RAM tier, hosts 0 and 2 fall back to the durable step (their execs exit 75, the
    ranks say which step failed), and host 1's exec fails. The job started again resumes from that durable
    step, with its digest."""
    ckpt = tmp_path / "ckpt"
    wrapper = tmp_path / "die_sending.py"
    wrapper.write_text(_DIE_SENDING)
    async with hosts(3) as three:
        args = ("--steps", "100000", "--step-time", "0.02", "--interval-s", "0.5")
        runs = await train(three, ckpt, *args, wrappers={1: wrapper})
        for run in runs:
            await run.until("checkpoint")
        status, body = await http_json(
            three[1].socket, "POST", "/v1/drills", {"kind": "termination", "in_s": 60}
        )
        assert status == 201, body
        codes = [await run.finish() for run in runs]
        held = [host.tier.holdings.steps_of(os.getuid(), JOB) for host in three]
        durable = [(c["step"], c["digest"]) for c in runs[0].of("checkpoint") if not c["emergency"]]
        drill = body["notice"]["id"]
        assert 200 == (await http_json(three[1].socket, "DELETE", f"/v1/drills/{drill}"))[0]  # host 1 stays
        again = await train(three, ckpt, "--steps", str(durable[-1][0] + 1))
        restarted = [await run.finish() for run in again]
    assert (EXIT_PREEMPTED, EXIT_PREEMPTED) == (codes[0], codes[2]), [run.stderr[-3000:] for run in runs]
    assert EXIT_PREEMPTED != codes[1]
    assert [[], [], []] == held
    fell = [
        (p["step"], p["failed_step"] > p["step"]) for run in (runs[0], runs[2]) for p in run.of("preempted")
    ]
    assert [(durable[-1][0], True)] * 2 == fell
    assert [0, 0, 0] == restarted, [run.stderr[-3000:] for run in again]
    starts = [(e["next_step"], e["digest"]) for run in again for e in run.of("resumed")]
    assert [durable[-1]] * 3 == starts


async def _drain_committed(group: Sequence[Host], key: str, timeout: float = 120.0) -> None:
    """Until one of these hosts' agents says the drain of ``key`` ("job/step") committed the step."""

    async def committed() -> None:
        while True:
            for host in group:
                status, body = await http_json(host.socket, "GET", "/v1/status")
                assert status == 200, body
                drain = body["ram_tier"].get("drains", {}).get(key) or {}
                assert drain.get("state") != "failed", drain
                if drain.get("state") == "committed":
                    return
            await asyncio.sleep(0.1)  # the drains are child processes of the agents: their state is polled

    await asyncio.wait_for(committed(), timeout)


async def test_with_drain_the_evacuated_step_becomes_a_durable_step_that_plain_dcp_loads(
    tmp_path: Path,
) -> None:
    """--drain (RamTier(drain_to=root)): after the evacuation, hosts 0 and 2 copy their parts of the step into
    the durable root and the last one commits it; it verifies as a committed sharded step and
    ``torch.distributed.checkpoint.load`` reads every tensor of it in one process."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from agent.client.dcp import latest_committed

    ckpt = tmp_path / "ckpt"
    async with hosts(3) as three:
        runs = await train(three, ckpt, "--steps", "100000", "--step-time", "0.02", "--drain")
        for run in runs:
            await run.until("agent_connected")
        status, body = await http_json(
            three[1].socket, "POST", "/v1/drills", {"kind": "termination", "in_s": 60}
        )
        assert status == 201, body
        codes = [await run.finish() for run in runs]
        [step] = {event["step"] for run in runs for event in run.of("checkpoint")}
        await _drain_committed([three[0], three[2]], f"{os.getuid()}/{JOB}/{step}")
    assert [EXIT_PREEMPTED] * 3 == codes, [run.stderr[-3000:] for run in runs]
    drained = latest_committed(ckpt)
    assert drained is not None and (step, 3) == (drained.step, drained.world_size)
    metadata = FileSystemReader(drained.path).read_metadata()
    tensors = {
        name: torch.empty(meta.size, dtype=meta.properties.dtype)
        for name, meta in metadata.state_dict_metadata.items()
        if isinstance(meta, TensorStorageMetadata)
    }
    with pytest.warns(UserWarning, match="load in a single process"):  # torch's word that it is one process
        dcp.load(tensors, checkpoint_id=str(drained.path), no_dist=True)
    assert tensors and all(torch.isfinite(t).all() for t in tensors.values())
