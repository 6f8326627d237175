"""torch helpers: state-dict writers through the store, streaming durable files, local agreement."""

from __future__ import annotations

import os
import signal
import zlib
from pathlib import Path

import pytest

from agent.client import CheckpointStore, Watcher
from agent.client.store import DurableFile
from tests.lazy import Lazy

# torch and agent.client.torch are imported by the first test that uses them (tests/lazy.py).
torch = Lazy("torch")
Coordinator = Lazy("agent.client.torch", "Coordinator")
agree_latest = Lazy("agent.client.torch", "agree_latest")
load_safetensors = Lazy("agent.client.torch", "load_safetensors")
load_torch = Lazy("agent.client.torch", "load_torch")
safetensors_writer = Lazy("agent.client.torch", "safetensors_writer")
torch_writer = Lazy("agent.client.torch", "torch_writer")


def store(root: Path) -> CheckpointStore:
    return CheckpointStore(root, report=False)


def test_torch_state_round_trips_through_the_store(tmp_path: Path) -> None:
    state = {"model": {"w": torch.arange(6.0).reshape(2, 3)}, "step": 4}
    s = store(tmp_path)
    s.save(4, torch_writer(state))
    latest = s.latest()
    assert latest is not None
    loaded = load_torch(latest)
    assert (True, 4) == (torch.equal(state["model"]["w"], loaded["model"]["w"]), loaded["step"])


def test_torch_writer_records_the_crc_of_the_file_it_streamed(tmp_path: Path) -> None:
    checkpoint = store(tmp_path).save(1, torch_writer({"w": torch.randn(1000)}))
    data = checkpoint.file("state.pt").read_bytes()
    assert (zlib.crc32(data), len(data)) == (checkpoint.files[0].crc32, checkpoint.files[0].bytes)


def test_safetensors_round_trip_through_the_store(tmp_path: Path) -> None:
    pytest.importorskip("safetensors")
    tensors = {"a": torch.randn(3, 4), "b": torch.arange(5)}
    s = store(tmp_path)
    s.save(2, safetensors_writer(tensors))
    latest = s.latest()
    assert latest is not None
    loaded = load_safetensors(latest)
    assert all(torch.equal(tensors[k], loaded[k]) for k in tensors) and set(tensors) == set(loaded)


def test_durable_file_checksums_across_pieces(tmp_path: Path) -> None:
    data = os.urandom(10_000)
    with DurableFile(tmp_path / "f", piece=1024, workers=2) as handle:
        for start in range(0, len(data), 700):
            handle.write(data[start : start + 700])
    assert handle.entry is not None
    assert (zlib.crc32(data), len(data), data) == (
        handle.entry.crc32,
        handle.entry.bytes,
        (tmp_path / "f").read_bytes(),
    )


def test_durable_file_of_nothing_is_empty(tmp_path: Path) -> None:
    with DurableFile(tmp_path / "f") as handle:
        pass
    assert handle.entry is not None
    assert (0, 0) == (handle.entry.bytes, handle.entry.crc32)


def test_coordinator_without_process_group_decides_locally_every_k_steps(tmp_path: Path) -> None:
    with Watcher(tmp_path / "none.sock", signals=[signal.SIGUSR1]) as watcher:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert watcher.wait(10) is not None
        coordinator = Coordinator(watcher, every=2)
        skipped, decision = coordinator.check(3), coordinator.check(4)
        coordinator.done(decision)
        assert (False, True, True, False) == (
            skipped.checkpoint, decision.checkpoint, decision.emergency, watcher.should_checkpoint(),
        )  # fmt: skip


def test_agree_latest_without_process_group_is_the_local_latest(tmp_path: Path) -> None:
    s = store(tmp_path)
    s.save(3, torch_writer({"w": torch.zeros(1)}))
    latest = agree_latest(s)
    assert latest is not None
    assert 3 == latest.step


def test_emergency_torch_save_gets_its_crc_after_returning(tmp_path: Path) -> None:
    s = store(tmp_path)
    saved = s.save(1, torch_writer({"w": torch.randn(1000)}), emergency=True)
    assert s.wait_checksums(10)
    latest = s.latest()
    assert latest is not None
    data = latest.file("state.pt").read_bytes()
    assert (None, zlib.crc32(data)) == (saved.files[0].crc32, latest.files[0].crc32)
