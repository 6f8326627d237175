"""A damaged step is never resumed (security issue "Trust II", "damaged emergency step"): a step whose file lost
a byte, whose CRCs are missing (an emergency save's deferred sidecars or manifest entries never written, a file
the manifest does not list) or that torch's reader cannot read is skipped with a warning naming the step and
why, and the next older complete step loads — in the plain store, the sharded one (two real gloo ranks, one of
them holding the damage: both load the same older step) and the peer tier's RAM steps (a real agent). When no
step is left, the resume starts as with none, with one warning listing what was skipped."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import textwrap
import zlib
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from agent.client import CheckpointError, CheckpointStore, CheckpointWarning
from agent.client.peer.ramtier import read_tier_file, write_tier_file
from agent.ramtier import RamTierComponent
from agent.service.daemon import Agent
from tests.lazy import HAS_TORCH, Lazy
from tests.support import REPO, agent_config, short_tmp

# torch and the modules that import it are imported by the first test that uses them (tests/lazy.py).
torch = Lazy("torch")
load_torch = Lazy("agent.client.torch", "load_torch")
torch_writer = Lazy("agent.client.torch", "torch_writer")
ShardedStore = Lazy("agent.client.dcp", "ShardedStore")
CRC_SIDECAR = Lazy("agent.client.dcp", "CRC_SIDECAR")
PeerCheckpointStore = Lazy("agent.client.peer.store", "PeerCheckpointStore")

pytestmark = pytest.mark.timeout(120)
JOB = "damaged-job"


def flip(path: Path, at: int | None = None) -> None:
    """One byte of ``path`` inverted, its size unchanged (the middle one by default: tensor data)."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2 if at is None else at] ^= 0xFF
    path.write_bytes(bytes(data))


def garble(path: Path) -> None:
    """``path`` as zeros of the same size: what a reader cannot parse."""
    path.write_bytes(bytes(path.stat().st_size))


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:012d}"


def plain(root: Path, **options: Any) -> CheckpointStore:
    return CheckpointStore(root, keep=0, report=False, **options)


def tensors(value: float) -> dict[str, Any]:
    return {"w": torch.full((1000,), value)}


# -- the plain store


def test_a_flipped_byte_in_the_newest_step_falls_back_to_the_older_step_with_a_warning_naming_both(
    tmp_path: Path,
) -> None:
    s = plain(tmp_path)
    s.save(1, torch_writer(tensors(1.0)))
    s.save(2, torch_writer(tensors(2.0)), emergency=True)
    assert s.wait_checksums(30)
    flip(step_dir(tmp_path, 2) / "state.pt")
    with pytest.warns(CheckpointWarning, match=r"skipping step 2: .*state\.pt: checksum mismatch") as seen:
        found = s.load_latest(load_torch)
    assert found is not None
    assert (1, 1.0, 1) == (found[0].step, found[1]["w"][0].item(), len(seen))


def _deferred_never_written(manifest: dict[str, Any]) -> None:
    manifest["checksum"] = "deferred"  # as an emergency save commits it, before its CRCs are added
    for entry in manifest["files"]:
        entry.pop("crc32")


def _entry_without_crc(manifest: dict[str, Any]) -> None:
    manifest["files"][0].pop("crc32")


def _entry_gone(manifest: dict[str, Any]) -> None:
    manifest["files"] = []


@pytest.mark.parametrize(
    ("damage", "why"),
    [
        (_deferred_never_written, "no CRC32 to check it against \\(the emergency save deferred its CRCs"),
        (_entry_without_crc, "no CRC32 to check it against \\(its manifest entry has none\\)"),
        (_entry_gone, "not in the manifest, so it cannot be verified"),
    ],
)
def test_a_step_whose_manifest_cannot_vouch_for_a_file_is_skipped_for_the_older_step(
    tmp_path: Path, damage: Callable[[dict[str, Any]], None], why: str
) -> None:
    """CRCs missing from the manifest (an emergency save's deferred ones never written, an entry without
    its CRC) or a file it does not list: the file could be damaged without anything telling."""
    s = plain(tmp_path)
    s.save(1, torch_writer(tensors(1.0)))
    s.save(2, torch_writer(tensors(2.0)))
    manifest = step_dir(tmp_path, 2) / "manifest.json"
    doc = json.loads(manifest.read_text())
    damage(doc)
    manifest.write_text(json.dumps(doc))
    with pytest.warns(CheckpointWarning, match=f"skipping step 2: .*state\\.pt: {why}"):
        found = s.load_latest(load_torch)
    assert found is not None
    assert (1, 1.0) == (found[0].step, found[1]["w"][0].item())


def test_an_emergency_step_is_verified_with_its_deferred_crcs_once_they_are_written(tmp_path: Path) -> None:
    """The other side of the rule: the store's own deferred CRCs, waited for, make the step whole."""
    s = plain(tmp_path)
    s.save(1, torch_writer(tensors(1.0)), emergency=True)
    found = s.load_latest(load_torch)  # filterwarnings=error: a skip would fail here
    manifest = json.loads((step_dir(tmp_path, 1) / "manifest.json").read_text())
    assert found is not None
    assert (1, "crc32", True) == (
        found[0].step, manifest["checksum"], all("crc32" in f for f in manifest["files"]),
    )  # fmt: skip


_EXIT_WITHOUT_CLOSE = textwrap.dedent(
    """
    import sys
    from agent.client import CheckpointStore

    def writer(directory):
        (directory / "state.bin").write_bytes(bytes(range(256)) * (1 << 18))  # 64 MiB

    CheckpointStore(sys.argv[1], report=False).save(1, writer, emergency=True)
    sys.exit(75)  # at once, the store never closed
    """
)


def test_an_emergency_step_of_a_store_never_closed_gets_its_deferred_crcs_at_exit_and_resumes(
    tmp_path: Path,
) -> None:
    """The exit waits for the deferred CRCs (as close() would), so the step verifies at the next resume."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-c", _EXIT_WITHOUT_CLOSE, str(tmp_path)]
    done = subprocess.run(command, check=False, env=env, timeout=60)
    found = plain(tmp_path).latest()  # filterwarnings=error: a skip would fail here
    manifest = json.loads((step_dir(tmp_path, 1) / "manifest.json").read_text())
    assert found is not None
    assert (75, 1, "crc32") == (done.returncode, found.step, manifest["checksum"])


def test_when_no_step_loads_the_resume_finds_none_and_one_warning_lists_what_was_skipped(
    tmp_path: Path,
) -> None:
    s = plain(tmp_path)
    s.save(1, torch_writer(tensors(1.0)))
    s.save(2, torch_writer(tensors(2.0)))
    flip(step_dir(tmp_path, 1) / "state.pt")
    flip(step_dir(tmp_path, 2) / "state.pt")
    with pytest.warns(CheckpointWarning) as seen:
        found = s.load_latest(load_torch)
    said = [str(w.message) for w in seen]
    assert (None, 3) == (found, len(said))
    assert re.match(
        rf"no checkpoint in {re.escape(str(tmp_path))} could be loaded, so none is resumed .*skipped: "
        r"step 2 \(.*checksum mismatch.*\); step 1 \(.*checksum mismatch.*\)",
        said[2],
    ), said[2]


def test_asking_for_a_damaged_step_by_its_number_is_an_error_naming_the_file_and_why(tmp_path: Path) -> None:
    s = plain(tmp_path)
    s.save(1, torch_writer(tensors(1.0)))
    flip(step_dir(tmp_path, 1) / "state.pt")
    with pytest.raises(
        CheckpointError, match=rf"{re.escape(str(step_dir(tmp_path, 1)))}/state\.pt: checksum"
    ):
        s.get(1)


# -- the sharded store, one rank


@pytest.fixture
def group_of_one() -> Iterator[None]:
    dist = pytest.importorskip("torch.distributed")  # a skip, as every torch test here, without torch

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_sharded_emergency_step_without_its_crc_sidecars_is_skipped_for_the_older_step(
    group_of_one: None, tmp_path: Path
) -> None:
    s = ShardedStore(tmp_path, report=False)
    s.save(1, tensors(1.0))
    s.save(2, tensors(2.0), emergency=True)
    assert s.wait_checksums(30)
    for sidecar in step_dir(tmp_path, 2).glob(CRC_SIDECAR.format(rank="*")):
        sidecar.unlink()  # as when the process ended before its deferred checksums were written
    loaded = tensors(-1.0)
    with pytest.warns(
        CheckpointWarning, match=r"skipping step 2: .*no CRC32 for .*crc32-rank-0\.json missing"
    ):
        resumed = s.load_latest(loaded)
    assert resumed is not None
    assert (1, 1.0) == (resumed.step, loaded["w"][0].item())


def test_a_sharded_emergency_step_with_a_flipped_byte_is_skipped_for_the_older_step(
    group_of_one: None, tmp_path: Path
) -> None:
    s = ShardedStore(tmp_path, report=False)
    s.save(1, tensors(1.0))
    s.save(2, tensors(2.0), emergency=True)
    assert s.wait_checksums(30)
    flip(step_dir(tmp_path, 2) / "__0_0.distcp")
    loaded = tensors(-1.0)
    with pytest.warns(CheckpointWarning, match=r"skipping step 2: .*__0_0\.distcp: checksum mismatch"):
        resumed = s.load_latest(loaded)
    assert resumed is not None
    assert (1, 1.0) == (resumed.step, loaded["w"][0].item())


def test_a_dcp_file_the_manifest_does_not_list_skips_its_step(group_of_one: None, tmp_path: Path) -> None:
    s = ShardedStore(tmp_path, report=False)
    s.save(1, tensors(1.0))
    s.save(2, tensors(2.0))
    manifest = step_dir(tmp_path, 2) / "manifest.json"
    doc = json.loads(manifest.read_text())
    doc["files"] = [f for f in doc["files"] if f["path"] != "__0_0.distcp"]
    manifest.write_text(json.dumps(doc))
    loaded = tensors(-1.0)
    with pytest.warns(CheckpointWarning, match=r"skipping step 2: .*__0_0\.distcp: not in the manifest"):
        resumed = s.load_latest(loaded)
    assert resumed is not None
    assert (1, 1.0) == (resumed.step, loaded["w"][0].item())


def test_when_no_sharded_step_loads_the_resume_finds_none_and_one_warning_lists_them(
    group_of_one: None, tmp_path: Path
) -> None:
    s = ShardedStore(tmp_path, report=False)
    s.save(1, tensors(1.0))
    flip(step_dir(tmp_path, 1) / "__0_0.distcp")
    with pytest.warns(CheckpointWarning) as seen:
        resumed = s.load_latest(tensors(-1.0))
    said = [str(w.message) for w in seen]
    assert (None, 2) == (resumed, len(said))
    assert said[1].startswith(f"no checkpoint in {tmp_path} could be loaded"), said
    assert "skipped: step 1 (" in said[1], said


# -- the sharded store, two real ranks: the damage on one of them

_TWO_RANKS = textwrap.dedent(
    """
    import json, os, sys, warnings
    import torch, torch.distributed as dist
    from agent.client.dcp import ShardedStore

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    out = {}
    for name, checksum, damage in (("flipped", True, "flip"), ("sidecar", True, "sidecar"),
                                   ("unreadable", False, "zeros")):
        root = f"{sys.argv[1]}/{name}"
        store = ShardedStore(root, report=False, checksum=checksum)
        store.save(1, {f"w{rank}": torch.full((4096,), 1.0)})  # a key per rank: a shard each
        store.save(2, {f"w{rank}": torch.full((4096,), 2.0)}, emergency=True)
        assert store.wait_checksums(30)
        step = f"{root}/step-000000000002"
        if rank == 1 and damage == "sidecar":  # rank 1 ended before its deferred CRCs were written
            os.unlink(f"{step}/crc32-rank-1.json")
        elif rank == 1:  # only rank 1's shard of step 2 is damaged; rank 0's is whole
            data = bytearray(open(f"{step}/__1_0.distcp", "rb").read())
            if damage == "flip":
                data[len(data) // 2] ^= 0xFF
            else:
                data = bytearray(len(data))
            open(f"{step}/__1_0.distcp", "wb").write(bytes(data))
        dist.barrier()
        state = {f"w{rank}": torch.full((4096,), -1.0)}
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            resumed = store.load_latest(state)
        out[name] = {"step": resumed.step, "value": state[f"w{rank}"][0].item(),
                     "warnings": [str(w.message) for w in seen]}
        store.close()
    print(json.dumps(out), flush=True)
    dist.destroy_process_group()
    """
)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Two gloo ranks save step 1 and emergency step 2 (each rank its own shard) into three roots; then, on
    rank 1 only, step 2's shard loses a byte, or its CRC sidecar is gone, or (a root saved without CRCs) its
    shard reads as zeros, which torch's reader fails on; both ranks resume each root. Each rank's outcome,
    by root."""
    if not HAS_TORCH:
        pytest.skip("torch is not installed")
    tmp = tmp_path_factory.mktemp("two-ranks")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREEMPTD_", "TORCHELASTIC_"))}
    env.update(PYTHONPATH=str(REPO), GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port), WORLD_SIZE="2")  # fmt: skip
    procs = []
    for rank in (0, 1):
        command = [sys.executable, "-c", _TWO_RANKS, str(tmp)]
        out = subprocess.PIPE
        procs.append(
            subprocess.Popen(command, env={**env, "RANK": str(rank)}, stdout=out, stderr=out, text=True)
        )
    outs = [proc.communicate(timeout=100) for proc in procs]
    assert [0, 0] == [proc.returncode for proc in procs], [err[-3000:] for _out, err in outs]
    return [json.loads(out.strip().splitlines()[-1]) for out, _err in outs]


@pytest.mark.slow
@pytest.mark.torch_mp
def test_two_ranks_skip_the_step_whose_shard_lost_a_byte_on_one_of_them_and_load_the_same_older_step(
    two_ranks: list[dict[str, Any]],
) -> None:
    """Rank 0 checks the CRC of rank 1's shard (the files are shared out by index): both skip step 2."""
    outcomes = [r["flipped"] for r in two_ranks]
    assert [(1, 1.0), (1, 1.0)] == [(o["step"], o["value"]) for o in outcomes]
    assert all(
        re.match(r"skipping step 2: .*__1_0\.distcp: checksum mismatch", o["warnings"][0]) for o in outcomes
    ), outcomes


@pytest.mark.slow
@pytest.mark.torch_mp
def test_two_ranks_skip_the_step_whose_crc_sidecar_is_missing_on_one_of_them_and_load_the_same_older_step(
    two_ranks: list[dict[str, Any]],
) -> None:
    outcomes = [r["sidecar"] for r in two_ranks]
    assert [(1, 1.0), (1, 1.0)] == [(o["step"], o["value"]) for o in outcomes]
    assert all(
        re.match(
            r"skipping step 2: .*no CRC32 for __1_0\.distcp: crc32-rank-1\.json missing", o["warnings"][0]
        )
        for o in outcomes
    ), outcomes


@pytest.mark.slow
@pytest.mark.torch_mp
def test_two_ranks_skip_the_step_torch_cannot_read_on_one_of_them_and_load_the_same_older_step(
    two_ranks: list[dict[str, Any]],
) -> None:
    outcomes = [r["unreadable"] for r in two_ranks]
    assert [(1, 1.0), (1, 1.0)] == [(o["step"], o["value"]) for o in outcomes]
    assert all(
        re.match(r"skipping step 2: .*step-000000000002 cannot be loaded", o["warnings"][0]) for o in outcomes
    ), outcomes


# -- the peer tier: RAM steps held by a real agent, one process


@asynccontextmanager
async def ram_agent() -> AsyncIterator[Path]:
    """An agent with its RAM tier on; its socket."""
    base = short_tmp()
    settings = {"ram_tier.enabled": True, "ram_tier.path": str(base / "ram"), "ram_tier.cap_bytes": 1 << 26}
    agent = Agent(agent_config(base, settings))
    await agent.start()
    try:
        tier = next(c for c in agent.components if isinstance(c, RamTierComponent))
        await asyncio.wait_for(tier.loaded.wait(), 30)
        yield base / "a.sock"
    finally:
        await agent.stop()
        shutil.rmtree(base, ignore_errors=True)


def rewrite_crc(step: Path, name: str) -> None:
    """tier.json's CRC32 of ``name`` made to match the file as it is now (damage its CRC cannot tell)."""
    doc = read_tier_file(step)
    assert doc is not None
    doc["files"][name]["crc32"] = zlib.crc32((step / name).read_bytes())
    extra = {
        k: v for k, v in doc.items() if k not in ("job", "step", "run", "world_size", "files", "complete")
    }
    write_tier_file(step, job=doc["job"], step=doc["step"], run=doc["run"], world_size=doc["world_size"],
                    files=doc["files"], complete=doc["complete"], extra=extra)  # fmt: skip


@pytest.mark.parametrize(
    ("damage", "why"),
    [(flip, "damaged in a RAM tier: .*__0_0\\.distcp: checksum mismatch"), (garble, "cannot be loaded")],
)
async def test_a_sharded_ram_step_that_is_damaged_or_unreadable_falls_back_to_the_older_ram_step(
    group_of_one: None, tmp_path: Path, damage: Callable[[Path], None], why: str
) -> None:
    """A durable step 1, then RAM steps 2 and 3 (emergency saves, no host with a notice); step 3's shard
    loses a byte (its CRC32 in tier.json tells) or reads as zeros with a matching CRC32 (DCP's reader
    fails): step 2 loads from RAM."""
    async with ram_agent() as sock:
        store = await asyncio.to_thread(
            ShardedStore, tmp_path, report=False, socket_path=sock, tier="peer", job=JOB
        )

        def work() -> tuple[Any, float, list[str]]:
            store.save(1, tensors(1.0))
            store.save(2, tensors(2.0), emergency=True, noticed=())
            newest = store.save(3, tensors(3.0), emergency=True, noticed=())
            damage(newest.path / "__0_0.distcp")
            if damage is garble:
                rewrite_crc(newest.path, "__0_0.distcp")
            loaded = tensors(-1.0)
            with pytest.warns(CheckpointWarning, match=f"skipping RAM step 3: .*{why}") as seen:
                resumed = store.load_latest(loaded)
            store.close()
            return resumed, loaded["w"][0].item(), [str(w.message) for w in seen]

        resumed, value, said = await asyncio.to_thread(work)
    assert (2, "peer", 2.0, 1) == (resumed.step, resumed.checkpoint.metadata["tier"], value, len(said)), said


@pytest.mark.parametrize(
    ("damage", "why"),
    [(flip, "no copy of it checks out: .*checksum mismatch"), (garble, "torch cannot load it")],
)
async def test_a_full_state_ram_step_that_is_damaged_or_unreadable_falls_back_to_the_root(
    group_of_one: None, tmp_path: Path, damage: Callable[[Path], None], why: str
) -> None:
    """A durable step 1, then a RAM step 2 whose state.pt loses a byte (tier.json's CRC32 tells) or reads
    as zeros with a matching CRC32 (torch cannot read it): step 1 loads from the root."""
    async with ram_agent() as sock:
        store = await asyncio.to_thread(
            PeerCheckpointStore, tmp_path, socket_path=sock, job=JOB, report=False
        )

        def work() -> tuple[Any, list[str]]:
            store.save(1, torch_writer(tensors(1.0)))
            newest = store.save(2, torch_writer(tensors(2.0)), emergency=True, noticed=())
            damage(newest.path / "state.pt")
            if damage is garble:
                rewrite_crc(newest.path, "state.pt")
            with pytest.warns(CheckpointWarning, match=f"skipping RAM step 2: .*{why}") as seen:
                found = store.load_latest(load_torch)
            store.close()
            return found, [str(w.message) for w in seen]

        found, said = await asyncio.to_thread(work)
    assert found is not None
    assert (1, None, 1.0, 1) == (
        found[0].step, found[0].metadata.get("tier"), found[1]["w"][0].item(), len(said),
    ), said  # fmt: skip
