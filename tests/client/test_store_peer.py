"""The full-state store's peer tier (issue 24 item 7): ``PeerCheckpointStore(tier="peer")`` on simulated hosts
(one real agent each, its RAM tier in its own directory) and real torch ranks over loopback gloo. An
emergency save leaves one whole copy in the RAM tier of each host without a notice and nothing on the
notified host or under the durable root; the job resumes from a survivor's copy at another world size, a new
host receiving it through the group; a damaged copy, a stale one and a job whose every host has a notice
fall back as documented."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from tests.client.support import JOB, STEP, peer_ranks, steps_held
from tests.hosts import Host, hosts
from tests.lazy import HAS_TORCH, Lazy

# Resolved by the first test that uses them (tests/lazy.py): collecting this module imports no torch.
Copy = Lazy("agent.client.peer.store", "Copy")
newest_copy = Lazy("agent.client.peer.store", "newest_copy")


pytestmark = [
    pytest.mark.slow,
    pytest.mark.torch_mp,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed"),
]


def test_the_newest_step_held_whole_by_some_host_wins_one_copy_per_host() -> None:
    copies = [Copy("a", 7, 0, {}, {}), Copy("b", 7, 0, {}, {}), Copy("a", 5, 0, {}, {})]
    assert [("a", 7), ("b", 7)] == [(c.host, c.step) for c in newest_copy(copies, durable=(0, 6))]


def test_a_ram_step_not_newer_than_the_durable_one_is_never_chosen_newer_being_by_run_then_step() -> None:
    copies = [Copy("a", 9, 0, {}, {})]
    assert ([], [("a", 9)]) == (
        newest_copy(copies, durable=(1, 2)),
        [(c.host, c.step) for c in newest_copy(copies, durable=(0, 8))],
    )


def _durable(tmp: Path) -> list[str]:
    root = tmp / "ckpt"
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


@dataclass
class Saved:
    """One peer save on hosts 0-2 with a notice on host 1, as the tests below find it: what it left right
    after, then host 1 gone (agent stopped, RAM deleted); a fourth host, new and empty, idles."""

    every: list[Host]
    tmp: Path
    out: list[dict[str, Any]]
    held: list[list[int]]
    docs: list[dict[str, Any]]
    notified_dir: bool
    durable: list[str]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def saved_full(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Saved]:
    """The save the tests of this module share (three ranks that each import torch). A resume adds a copy to a
    host that lacked one and a damaged copy is repaired by the resume that finds it, so each test finds the
    step whole on hosts 0 and 2 whatever ran before."""
    tmp = tmp_path_factory.mktemp("saved")
    async with hosts(4) as every:
        out = await peer_ranks(every[:3], tmp, "save", noticed=[1])
        held = [steps_held(host) for host in every[:3]]
        docs = [
            json.loads((h.ram / str(os.getuid()) / JOB / str(STEP) / "tier.json").read_text())
            for h in (every[0], every[2])
        ]
        notified_dir = (every[1].ram / str(os.getuid()) / JOB).exists()
        durable = _durable(tmp)
        await every[1].stop()
        shutil.rmtree(every[1].ram)
        yield Saved(every, tmp, out, held, docs, notified_dir, durable)


@pytest.mark.asyncio(loop_scope="module")
async def test_a_peer_save_leaves_one_whole_copy_on_each_host_without_a_notice_and_none_on_the_notified_one(
    saved_full: Saved,
) -> None:
    """3 hosts, a notice on host 1: hosts 0 and 2 each hold the step whole (tier.json: the full-state layout,
    every file of the step), host 1 never reserved anything, nothing is under the durable root, and every
    rank's checkpoint is a peer one (host 1's rank names host 0's copy)."""
    s, out = saved_full, saved_full.out
    assert [[STEP], [], [STEP]] == s.held
    assert [("full", {"state.pt"}, {"state.pt"})] * 2 == [
        (d["layout"], set(d["files"]), set(d["step_files"])) for d in s.docs
    ]
    assert (False, []) == (s.notified_dir, s.durable)
    assert [("peer", STEP)] * 3 == [(o["tier"], o["step"]) for o in out]
    assert out[0]["path"] == out[1]["path"] != out[2]["path"]
    assert [[]] * 3 == [o["warnings"] for o in out]


@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.parametrize("new_hosts", [0, 1])
async def test_with_the_notified_host_gone_the_job_resumes_from_a_survivors_copy_at_another_world_size(
    saved_full: Saved, new_hosts: int
) -> None:
    """After the save, host 1 is gone (agent stopped, RAM deleted): the job resumes on hosts 0 and 2 (world
    size 2), or on them and a new empty host (world size 3) which receives the copy through the group and
    keeps it in its own tier; the saved step and digest on every rank, nothing under the durable root."""
    every = saved_full.every
    group = [every[0], every[2], *every[3 : 3 + new_hosts]]
    resumed = await peer_ranks(group, saved_full.tmp, "resume")
    held = [steps_held(host) for host in group]
    assert [(STEP, saved_full.out[0]["digest"], "peer", [])] * len(group) == [
        (o["step"], o["digest"], o["tier"], o["warnings"]) for o in resumed
    ]
    assert [[STEP]] * len(group) == held
    assert [] == _durable(saved_full.tmp)


@pytest.mark.asyncio(loop_scope="module")
async def test_a_damaged_copy_is_freed_and_its_host_receives_a_good_one(saved_full: Saved) -> None:
    """Host 0's copy loses a byte after the save (CRC32 no longer matches tier.json): the resume on hosts 0
    and 2 loads host 2's copy on both, and host 0 holds a good copy again."""
    every = saved_full.every
    state = every[0].ram / str(os.getuid()) / JOB / str(STEP) / "state.pt"
    data = bytearray(state.read_bytes())
    data[len(data) // 2] ^= 0xFF
    state.write_bytes(bytes(data))
    resumed = await peer_ranks([every[0], every[2]], saved_full.tmp, "resume")
    repaired = state.read_bytes() != bytes(data)
    assert [(STEP, saved_full.out[0]["digest"])] * 2 == [(o["step"], o["digest"]) for o in resumed]
    assert repaired


async def test_when_every_host_has_a_notice_the_step_goes_to_the_durable_root_with_a_warning_saying_why(
    tmp_path: Path,
) -> None:
    async with hosts(2) as two:
        out = await peer_ranks(two, tmp_path, "save", noticed=[0, 1])
        held = [steps_held(host) for host in two]
    assert [[], []] == held
    assert [f"step-{STEP:012d}"] == [n for n in _durable(tmp_path) if n.startswith("step-")]
    assert [None, None] == [o["tier"] for o in out]
    assert all("every host of the job has a notice (2 of 2)" in o["warnings"][0] for o in out)


async def test_a_ram_step_older_than_a_newer_durable_step_is_ignored_by_the_resume_and_freed(
    tmp_path: Path,
) -> None:
    """A peer step 7 (host 1 notified, host 0 keeps it), then a durable step 8: the resume loads 8 from the
    root and host 0's RAM step 7 is freed."""
    async with hosts(2) as two:
        out = await peer_ranks(two, tmp_path, "stale", noticed=[1])
        held = [steps_held(host) for host in two]
    assert [(STEP + 1, None)] * 2 == [(o["step"], o["tier"]) for o in out]
    assert [[], []] == held


async def test_a_notified_rank_that_dies_as_the_save_starts_leaves_the_others_an_error_with_the_durable_step(
    tmp_path: Path,
) -> None:
    """A durable step 6 on every rank, then host 1's rank dies as the emergency save of step 7 starts: the
    other ranks raise CheckpointError whose fallback is step 6 (recorded for preemptd exec), and no RAM tier
    holds step 7."""
    async with hosts(3) as three:
        out = await peer_ranks(three, tmp_path, "die", noticed=[1], dies=[1])
        held = [steps_held(host) for host in three]
    assert [(STEP - 1, True), (STEP - 1, True)] == [
        (o["fallback"], o["error"].startswith(f"the peer save of step {STEP} failed"))
        for o in (out[0], out[2])
    ]
    assert [[], [], []] == held
