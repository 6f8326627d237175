"""The drain of a full-state step (tier.json's ``"layout": "full"``, as PeerCheckpointStore writes it): every
host holding a whole copy drains it, one host commits it as an ordinary CheckpointStore step (two real
agents, their RAM tiers in their own directories, one durable root), the others copy nothing; a damaged copy is
never committed; a claim left by a host lost mid-copy is taken over."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import threading
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.checkpoint.manifest import Checkpoint
from agent.client.peer.ramtier import RamTier, write_tier_file
from agent.client.store import CheckpointStore
from agent.ramtier.drain import claim_file, drain, final_dir
from agent.ramtier.drains import Drain
from tests.ramtier.support import JOB, tier_agent
from tests.support import short_tmp

STEP = 5
STATE = os.urandom(300_000)


@pytest.fixture
def other() -> Iterator[Path]:
    """A second host's directory (socket, state, RAM tier)."""
    path = short_tmp()
    yield path
    shutil.rmtree(path, ignore_errors=True)


def hold_whole(sock: Path, durable: Path, data: bytes = STATE, damaged: bool = False) -> None:
    """What PeerCheckpointStore's emergency save does on a host without a notice: reserve, write the whole
    step, tier.json with the full-state layout, commit with the durable root (``damaged``: the file loses a
    byte after tier.json was written)."""
    tier = RamTier(sock, drain_to=durable)
    reservation = tier.reserve(JOB, STEP, len(data))
    (reservation.path / "state.pt").write_bytes(data)
    files = {"state.pt": {"size": len(data), "crc32": zlib.crc32(data), "rank": 0}}
    write_tier_file(
        reservation.path, job=JOB, step=STEP, run=2, world_size=3, files=files, complete=True,
        extra={"layout": "full", "step_files": {"state.pt": len(data)}, "notice_id": "n-1",
               "metadata": {"epoch": 4}},
    )  # fmt: skip
    if damaged:
        (reservation.path / "state.pt").write_bytes(bytes([data[0] ^ 0xFF]) + data[1:])
    tier.commit(JOB, STEP, reservation.id)


async def drained(tier: Any) -> Drain:
    drain: Drain = tier.drains.records[(os.getuid(), JOB, STEP)]
    await asyncio.wait_for(drain.done.wait(), 60)
    return drain


def listing(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


@pytest.mark.slow
async def test_two_hosts_holding_the_same_full_state_step_commit_it_once_as_a_checkpoint_store_step(
    base: Path, other: Path
) -> None:
    """Both hosts drain at once: one commits (the manifest CheckpointStore writes: run, notice, metadata,
    CRCs), the other finds it committed; nothing else is left in the root, and CheckpointStore loads it."""
    durable = base / "durable"
    async with tier_agent(base) as (agent_a, tier_a), tier_agent(other) as (agent_b, tier_b):
        await asyncio.gather(
            asyncio.to_thread(hold_whole, agent_a.config.socket, durable),
            asyncio.to_thread(hold_whole, agent_b.config.socket, durable),
        )
        drains = [await drained(tier_a), await drained(tier_b)]
        status = tier_a.status()["drains"][f"{os.getuid()}/{JOB}/{STEP}"]
    found = CheckpointStore(durable, report=False).load_latest(lambda c: c.file("state.pt").read_bytes())
    assert found is not None
    checkpoint, data = found
    doc = json.loads((checkpoint.path / "manifest.json").read_text())
    assert [("committed", str(final_dir(durable, STEP)))] * 2 == [(d.state, d.path) for d in drains]
    assert [False, True] == sorted(d.already for d in drains)
    assert {"state": "committed", "total_bytes": len(STATE)}.items() <= status.items()
    assert (STEP, 2, True, "n-1", {"epoch": 4, "drained_from": "ram_tier"}) == (
        checkpoint.step, checkpoint.run, checkpoint.emergency, checkpoint.notice_id, dict(checkpoint.metadata)
    )  # fmt: skip
    assert [{"path": "state.pt", "bytes": len(STATE), "crc32": zlib.crc32(STATE)}] == doc["files"]
    assert STATE == data
    assert [f"step-{STEP:012d}"] == listing(durable)


@pytest.mark.slow
async def test_a_damaged_copy_is_not_committed_and_the_other_hosts_good_copy_is(
    base: Path, other: Path
) -> None:
    """Host A's copy no longer matches its CRC32: its drain fails and leaves nothing in the root (no step, no
    claim); host B's drain then commits B's good copy."""
    durable = base / "durable"
    async with tier_agent(base) as (agent_a, tier_a), tier_agent(other) as (agent_b, tier_b):
        await asyncio.to_thread(hold_whole, agent_a.config.socket, durable, damaged=True)
        failed = await drained(tier_a)
        left = listing(durable)
        await asyncio.to_thread(hold_whole, agent_b.config.socket, durable)
        good = await drained(tier_b)
    assert ("failed", []) == (failed.state, left)
    assert "the RAM copy is damaged, nothing of it was drained" in str(failed.error)
    assert ("committed", False) == (good.state, good.already)
    assert STATE == (final_dir(durable, STEP) / "state.pt").read_bytes()
    assert [f"step-{STEP:012d}"] == listing(durable)


def _plan(source: Path, durable: Path, host: str, stale_s: float) -> dict[str, Any]:
    files = {"state.pt": {"size": len(STATE), "crc32": zlib.crc32(STATE), "rank": 0}}
    return {
        "layout": "full", "source": str(source), "durable_root": str(durable), "step": STEP, "run": 0,
        "world_size": 2, "files": files, "step_files": {"state.pt": len(STATE)}, "host": host,
        "claim_stale_s": stale_s,
    }  # fmt: skip


def test_a_claim_that_stops_moving_is_taken_over(tmp_path: Path) -> None:
    """A claim left by a host lost mid-copy (it never changes again) is taken over after claim_stale_s, and
    the step committed from this host's copy."""
    source = tmp_path / "ram"
    source.mkdir()
    (source / "state.pt").write_bytes(STATE)
    durable = tmp_path / "durable"
    durable.mkdir()
    claim = claim_file(durable, STEP)
    claim.write_text(json.dumps({"host": "lost"}))
    started = time.monotonic()
    outcome = drain(_plan(source, durable, "survivor", 0.5), lambda doc: None)
    waited = time.monotonic() - started
    assert ("committed", None) == (outcome["state"], outcome.get("already"))
    assert waited >= 0.5
    assert STATE == (final_dir(durable, STEP) / "state.pt").read_bytes()
    assert [f"step-{STEP:012d}"] == listing(durable)
    Checkpoint.load(final_dir(durable, STEP)).verify("checksum")


def test_a_host_that_finds_the_step_committed_while_it_waits_copies_nothing(tmp_path: Path) -> None:
    """Another host holds the claim (it does not go stale here) and commits the step: the waiting drain
    answers "already" and has written nothing."""
    source = tmp_path / "ram"
    source.mkdir()
    (source / "state.pt").write_bytes(STATE)
    durable = tmp_path / "durable"
    durable.mkdir()
    claim = claim_file(durable, STEP)
    claim.write_text(json.dumps({"host": "first"}))
    outcome: list[dict[str, Any]] = []
    said: list[dict[str, Any]] = []  # its progress lines: the agent shows who holds the claim it waits for
    waiting = threading.Thread(
        target=lambda: outcome.append(drain(_plan(source, durable, "second", 30), said.append))
    )
    waiting.start()
    time.sleep(0.5)
    alone = waiting.is_alive()
    CheckpointStore(durable, report=False).save(STEP, lambda d: (d / "state.pt").write_bytes(STATE))
    waiting.join(10)
    assert alone
    assert [{"state": "committed", "path": str(final_dir(durable, STEP)), "already": True}] == outcome
    assert [{"claimed_by": "first"}] == said
    assert [claim.name, f"step-{STEP:012d}"] == listing(durable)


@pytest.mark.slow
def test_a_claim_kept_alive_by_a_slow_copy_is_waited_for_not_taken_over(tmp_path: Path) -> None:
    """Host A copies slowly (rate-limited past the claim's stale time): its claim keeps moving, so host B waits
    and finds the step committed by A instead of copying it a second time."""
    source = tmp_path / "ram"
    source.mkdir()
    (source / "state.pt").write_bytes(STATE)
    durable = tmp_path / "durable"
    durable.mkdir()
    outcomes: dict[str, dict[str, Any]] = {}

    def run(host: str, rate_mb_s: float) -> None:
        plan = {**_plan(source, durable, host, 2.5), "rate_mb_s": rate_mb_s}
        outcomes[host] = drain(plan, lambda doc: None)

    slow = threading.Thread(target=run, args=("a", len(STATE) / 5e6))  # ~5 s
    slow.start()
    time.sleep(0.3)
    run("b", 0)
    slow.join(30)
    assert ("committed", None) == (outcomes["a"]["state"], outcomes["a"].get("already"))
    assert ("committed", True) == (outcomes["b"]["state"], outcomes["b"].get("already"))
    assert [f"step-{STEP:012d}"] == listing(durable)
