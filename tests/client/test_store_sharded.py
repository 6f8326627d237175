"""The sharded store (agent.client.dcp) on its edges, in a real gloo group of one: a root holding another
run's higher steps, a full disk (torch's CheckpointException becomes a CheckpointError naming the cause),
malformed manifests and CRC sidecars, and a step that verifies by size but does not load."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.client import CheckpointError, CheckpointWarning
from agent.client.preempted import ENV, read_records
from tests.lazy import Lazy
from tests.store_fs import fill, small_fs

__all__ = ["small_fs"]  # the fixture, used by name

# torch and agent.client.dcp are imported by the first test that uses them (tests/lazy.py).
torch = Lazy("torch")
CRC_SIDECAR = Lazy("agent.client.dcp", "CRC_SIDECAR")
ShardedStore = Lazy("agent.client.dcp", "ShardedStore")
latest_committed = Lazy("agent.client.dcp", "latest_committed")

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def group_of_one() -> Iterator[None]:
    dist = pytest.importorskip("torch.distributed")  # a skip, as every torch test here, without torch

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def state(value: float, size: int = 1000) -> dict[str, Any]:
    return {"w": torch.full((size,), value)}


def test_a_lower_step_than_an_older_runs_starts_a_new_run_that_is_kept_and_resumed(
    group_of_one: None, tmp_path: Path
) -> None:
    s = ShardedStore(tmp_path, keep=3, report=False)
    for step in (100, 101, 102):
        s.save(step, state(0.0))
    with pytest.warns(
        CheckpointWarning, match="step 5 into .*newest checkpoint is step 102: this starts run 1"
    ):
        s.save(5, state(5.0))
    loaded = state(-1.0)
    resumed = s.load_latest(loaded)
    assert resumed is not None
    assert (5, 5.0, [5, 102, 101]) == (resumed.step, loaded["w"][0].item(), s.steps())
    s.save(6, state(6.0))
    s.save(7, state(7.0))
    assert [7, 6, 5] == s.steps()


def test_start_run_begins_a_new_run_on_purpose_without_a_warning(group_of_one: None, tmp_path: Path) -> None:
    old = ShardedStore(tmp_path, keep=3, report=False)
    for step in (100, 101, 102):
        old.save(step, state(0.0))
    s = ShardedStore(tmp_path, keep=3, report=False)
    s.start_run()
    first = s.save(1, state(1.0))  # filterwarnings=error: a warning would fail here
    assert (1, [1, 102, 101]) == (first.checkpoint.run, s.steps())


def test_a_save_that_fills_the_disk_is_a_checkpoint_error_naming_the_space_not_torchs_exception(
    group_of_one: None, small_fs: Path
) -> None:
    s = ShardedStore(small_fs, report=False)
    s.save(1, state(1.0))
    with pytest.raises(CheckpointError) as caught:
        s.save(2, state(2.0, 1 << 19))  # 2 MiB into a 1 MiB file system
    error = caught.value
    assert ("no_space", "CheckpointException", [1]) == (
        error.reason, type(error.__cause__).__name__, s.steps(),
    )  # fmt: skip
    assert re.search(
        rf"save of step 2 under {small_fs} failed: no space left on the file system of {small_fs} "
        r"\(the writer reported rank 0: RuntimeError: .*\): \d+ bytes .* were free when the save started",
        str(error),
    ), str(error)
    assert [] == [p.name for p in small_fs.glob(".tmp-*")]


def test_a_failed_emergency_save_falls_back_to_the_committed_step_for_exec(
    group_of_one: None, small_fs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    channel = tmp_path / "exec"
    channel.mkdir()
    monkeypatch.setenv(ENV, str(channel))
    s = ShardedStore(small_fs, report=False)
    s.save(1, state(1.0))
    with pytest.raises(CheckpointError) as caught:
        s.save(2, state(2.0, 1 << 19), emergency=True, notice_id="n-2")
    [record] = read_records(channel)
    fallback = caught.value.fallback
    assert fallback is not None
    assert (1, 1, True, True, 2, "n-2") == (
        fallback.step, record["step"], record["sharded"], record["fallback"], record["failed_step"],
        record["notice_id"],
    )  # fmt: skip


@pytest.mark.parametrize(
    ("field", "value", "why"),
    [
        ("metadata", 12345, "'metadata' must be dict"),
        ("step", 1e300, "'step' must be a whole number"),
        ("metadata", {"world_size": "2"}, "'metadata.world_size' must be a whole number"),
    ],
)
def test_a_malformed_manifest_is_skipped_with_a_warning_by_the_store_and_latest_committed(
    group_of_one: None, tmp_path: Path, field: str, value: Any, why: str
) -> None:
    s = ShardedStore(tmp_path, report=False)
    s.save(1, state(1.0))
    s.save(2, state(2.0))
    manifest = tmp_path / "step-000000000002" / "manifest.json"
    doc = json.loads(manifest.read_text())
    doc[field] = value
    manifest.write_text(json.dumps(doc))
    with pytest.warns(CheckpointWarning, match=f"{re.escape(str(manifest))}: malformed: {why}"):
        latest = s.latest()
    with pytest.warns(CheckpointWarning, match=f"{re.escape(str(manifest))}: malformed: {why}"):
        committed = latest_committed(tmp_path)
    assert latest is not None and committed is not None
    assert (1, 1) == (latest.step, committed.step)


def test_a_step_that_verifies_by_size_but_does_not_load_falls_back_to_the_previous(
    group_of_one: None, tmp_path: Path
) -> None:
    """A store saving without CRCs (``checksum=False``): its steps verify by size, and DCP's reader fails."""
    s = ShardedStore(tmp_path, report=False, checksum=False)
    s.save(1, state(1.0))
    s.save(2, state(2.0), emergency=True)
    step = tmp_path / "step-000000000002"
    for shard in step.glob("*.distcp"):
        shard.write_bytes(bytes(shard.stat().st_size))  # the right size, unreadable to torch
    loaded = state(-1.0)
    with pytest.warns(CheckpointWarning, match=f"skipping step 2: {re.escape(str(step))} cannot be loaded"):
        resumed = s.load_latest(loaded)
    assert resumed is not None
    assert (1, 1.0) == (resumed.step, loaded["w"][0].item())


def test_a_state_that_does_not_match_is_refused_not_skipped(group_of_one: None, tmp_path: Path) -> None:
    s = ShardedStore(tmp_path, report=False)
    s.save(1, state(1.0))
    with pytest.raises(CheckpointError, match="does not match the state to load into") as caught:
        s.load_latest({"w": torch.zeros(7)})
    assert "mismatch" == caught.value.reason


def test_a_full_disk_at_start_still_lets_the_job_start_and_resume(group_of_one: None, small_fs: Path) -> None:
    """The check that the root is shared takes no space, so a requeued job on a full disk can resume."""
    ShardedStore(small_fs, report=False).save(1, state(1.0))
    fill(small_fs)
    loaded = state(-1.0)
    resumed = ShardedStore(small_fs, report=False).load_latest(loaded)
    assert resumed is not None
    assert (1, 1.0) == (resumed.step, loaded["w"][0].item())


def test_a_malformed_crc_sidecar_leaves_its_step_verifiable_by_size_only(
    group_of_one: None, tmp_path: Path
) -> None:
    """Its CRCs unknown, the step is skipped at the ``checksum`` level, and verifies by size."""
    s = ShardedStore(tmp_path, report=False)
    s.save(1, state(1.0), emergency=True)
    assert s.wait_checksums(30)
    for sidecar in (tmp_path / "step-000000000001").glob(CRC_SIDECAR.format(rank="*")):
        sidecar.write_text('{"__0_0.distcp": 1e400, "x": [1]}')
    with pytest.warns(CheckpointWarning) as seen:
        checked = s.latest()
    by_size = s.latest("size")
    assert by_size is not None
    assert (None, 1, [None, None]) == (checked, by_size.step, [f.crc32 for f in by_size.checkpoint.files])
    assert re.match(r"skipping step 1: .*crc32-rank-0\.json missing or unreadable", str(seen[0].message))


def test_a_background_save_that_fills_the_disk_fails_as_a_checkpoint_error_when_waited_for(
    group_of_one: None, small_fs: Path
) -> None:
    s = ShardedStore(small_fs, report=False)
    s.save(1, state(1.0))
    s.save_async(2, state(2.0, 1 << 19))  # 2 MiB into a 1 MiB file system, written on DCP's thread
    with pytest.raises(CheckpointError, match="no space left on the file system") as caught:
        s.wait_async(30)
    assert ("no_space", [1]) == (caught.value.reason, s.steps())
