"""The full-state peer tier drained to durable storage (issue 24 items 3 and 7): ``PeerCheckpointStore(root,
ram_tier=RamTier(drain_to=root))`` on 3 simulated hosts (one real agent each) with real gloo ranks; a notice
on host 1, so hosts 0 and 2 each hold the step whole and both drain it. The step appears in the root once, as
an ordinary CheckpointStore step that ``CheckpointStore.load_latest`` and plain ``torch.load`` read with the
saved digest, and the older RAM step is freed once a newer one is durable."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from tests.client.support import JOB, STEP, peer_ranks, steps_held
from tests.hosts import Host, hosts
from tests.lazy import HAS_TORCH
from tests.support import REPO

# torch runs in the ranks' processes and in one reader process: collecting this module imports none.
pytestmark = [
    pytest.mark.slow,
    pytest.mark.torch_mp,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed"),
]

# Reads the root as a user of the durable tier would: the store's resume, and a bare torch.load of each step.
_READ = textwrap.dedent(
    """
    import json, sys, zlib
    import torch
    from agent.client.store import CheckpointStore
    from agent.client.torch import load_torch

    def digest(state):
        return zlib.crc32(state["w"].numpy().tobytes()) ^ state["step"]

    store = CheckpointStore(sys.argv[1], report=False)
    checkpoint, state = store.load_latest(load_torch)
    plain = {step: digest(torch.load(store.path_of(step) / "state.pt", weights_only=True)) for step in store.steps()}
    print(json.dumps({"step": checkpoint.step, "digest": digest(state), "plain": plain,
                      "metadata": dict(checkpoint.metadata), "notice_id": checkpoint.notice_id}))
    """
)


async def _drained(host: Host, step: int) -> dict[str, Any]:
    """The host's drain of ``step`` once it ended (it was requested when the step was committed)."""
    drain = host.tier.drains.records[(os.getuid(), JOB, step)] if host.tier.drains else None
    assert drain is not None
    await asyncio.wait_for(drain.done.wait(), 120)
    return drain.to_json()


async def test_a_full_state_peer_step_drained_by_both_survivors_is_committed_once_and_loads_with_its_digest(
    tmp_path: Path,
) -> None:
    """Steps 7 and 8 saved into the RAM of hosts 0 and 2 (host 1 notified), drain_to the root: each step is
    committed once (one host commits, the other finds it committed), the root holds nothing else, the store's
    resume loads step 8 and torch.load reads both steps with the digests the ranks saved, and the RAM copy of
    step 7 is freed on both hosts once step 8 is durable."""
    async with hosts(3) as three:
        out = await peer_ranks(three, tmp_path, "twice", noticed=[1], drain=True)
        drains: dict[int, list[dict[str, Any]]] = {}
        for s in (STEP, STEP + 1):  # a loop: an await in a comprehension inside another is 3.11 syntax
            drains[s] = [await _drained(h, s) for h in (three[0], three[2])]
        held = [steps_held(host) for host in three]
    root = tmp_path / "ckpt"
    read = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-c", _READ, str(root)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert 0 == read.returncode, read.stderr
    found = json.loads(read.stdout)
    assert [("peer", STEP + 1)] * 3 == [(o["tier"], o["step"]) for o in out]
    for step, pair in drains.items():
        assert [("committed", str(root / f"step-{step:012d}"))] * 2 == [(d["state"], d["path"]) for d in pair]
        assert [False, True] == sorted(bool(d.get("already")) for d in pair), pair
    assert [f"step-{STEP:012d}", f"step-{STEP + 1:012d}"] == sorted(p.name for p in root.iterdir())
    assert (STEP + 1, out[0]["digest"], "n-1") == (found["step"], found["digest"], found["notice_id"])
    assert {
        str(STEP): out[0]["digests"][str(STEP)],
        str(STEP + 1): out[0]["digests"][str(STEP + 1)],
    } == found["plain"]
    assert {"drained_from": "ram_tier"} == found["metadata"]
    assert [[STEP + 1], [], [STEP + 1]] == held


async def test_ram_copies_that_went_bad_before_the_drain_are_never_committed(tmp_path: Path) -> None:
    """Both survivors' copies lose a byte after their CRC32 was taken: both drains fail saying the RAM copy
    is damaged, and the root holds no step, no claim and no staging directory."""
    async with hosts(3) as three:
        out = await peer_ranks(three, tmp_path, "damaged", noticed=[1], drain=True)
        drains = [await _drained(h, STEP) for h in (three[0], three[2])]
    root = tmp_path / "ckpt"
    assert [("peer", STEP)] * 3 == [(o["tier"], o["step"]) for o in out]
    assert ["failed"] * 2 == [d["state"] for d in drains]
    assert all("the RAM copy is damaged, nothing of it was drained" in d["error"] for d in drains), drains
    assert [] == (sorted(p.name for p in root.iterdir()) if root.exists() else [])
