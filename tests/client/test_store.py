"""The checkpoint store: atomic durable saves, manifest, keep-last-N, skipping bad checkpoints on resume."""

from __future__ import annotations

import json
import os
import socket
import zlib
from collections.abc import Callable
from pathlib import Path

import pytest

from agent.checkpoint.manifest import crc32_combine
from agent.client import CheckpointError, CheckpointStore, CheckpointWarning


def write_files(files: dict[str, bytes]) -> Callable[[Path], None]:
    def writer(directory: Path) -> None:
        for name, data in files.items():
            (directory / name).parent.mkdir(parents=True, exist_ok=True)
            (directory / name).write_bytes(data)

    return writer


def store(root: Path, keep: int = 3, checksum: bool = True) -> CheckpointStore:
    return CheckpointStore(root, keep, checksum=checksum, report=False)


def test_save_commits_a_step_directory_with_a_manifest(tmp_path: Path) -> None:
    checkpoint = store(tmp_path).save(
        7, write_files({"a.bin": b"abc", "sub/b.bin": b"de"}), metadata={"lr": 0.1}
    )
    manifest = json.loads((tmp_path / "step-000000000007" / "manifest.json").read_text())
    files = {f["path"]: (f["bytes"], f["crc32"]) for f in manifest["files"]}
    assert (7, 5, {"a.bin": (3, zlib.crc32(b"abc")), "sub/b.bin": (2, zlib.crc32(b"de"))}, {"lr": 0.1}) == (
        manifest["step"], manifest["bytes"], files, manifest["metadata"],
    )  # fmt: skip
    assert checkpoint.path == tmp_path / "step-000000000007"


def test_save_leaves_no_temporary_directory(tmp_path: Path) -> None:
    store(tmp_path).save(1, write_files({"a": b"x"}))
    assert ["step-000000000001"] == sorted(p.name for p in tmp_path.iterdir())


def test_failing_writer_leaves_nothing_and_raises_a_checkpoint_error_naming_it(tmp_path: Path) -> None:
    def broken(directory: Path) -> None:
        (directory / "half").write_bytes(b"x")
        raise RuntimeError("disk on fire")

    with pytest.raises(
        CheckpointError, match=r"save of step 1 .* failed: RuntimeError: disk on fire"
    ) as caught:
        store(tmp_path).save(1, broken)
    assert ([], RuntimeError) == (list(tmp_path.iterdir()), type(caught.value.__cause__))


def test_writer_that_writes_nothing_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="no files"):
        store(tmp_path).save(1, lambda directory: None)


def test_latest_is_the_highest_step(tmp_path: Path) -> None:
    s = store(tmp_path)
    for step in (3, 5, 10):
        s.save(step, write_files({"a": str(step).encode()}))
    latest = s.latest()
    assert latest is not None
    assert (10, b"10") == (latest.step, latest.file("a").read_bytes())


def test_latest_of_an_empty_store_is_none(tmp_path: Path) -> None:
    assert store(tmp_path / "missing").latest() is None


def test_corrupt_checkpoint_is_skipped_with_a_warning(tmp_path: Path) -> None:
    s = store(tmp_path)
    s.save(1, write_files({"a": b"good"}))
    s.save(2, write_files({"a": b"good"}))
    (tmp_path / "step-000000000002" / "a").write_bytes(b"evil")
    with pytest.warns(CheckpointWarning, match="checksum mismatch"):
        latest = s.latest()
    assert latest is not None
    assert 1 == latest.step


def test_truncated_file_is_skipped_with_a_warning(tmp_path: Path) -> None:
    s = store(tmp_path)
    s.save(1, write_files({"a": b"good"}))
    s.save(2, write_files({"a": b"good"}))
    (tmp_path / "step-000000000002" / "a").write_bytes(b"go")
    with pytest.warns(CheckpointWarning, match="manifest says 4"):
        latest = s.latest(verify="size")
    assert latest is not None
    assert 1 == latest.step


def test_directory_without_manifest_is_skipped_with_a_warning(tmp_path: Path) -> None:
    s = store(tmp_path)
    s.save(1, write_files({"a": b"good"}))
    (tmp_path / "step-000000000009").mkdir()
    with pytest.warns(CheckpointWarning, match="incomplete"):
        latest = s.latest()
    assert latest is not None
    assert 1 == latest.step


def test_keep_prunes_all_but_the_newest(tmp_path: Path) -> None:
    s = store(tmp_path, keep=2)
    for step in range(1, 6):
        s.save(step, write_files({"a": b"x"}))
    assert [5, 4] == s.steps()


def test_keep_zero_keeps_everything(tmp_path: Path) -> None:
    s = store(tmp_path, keep=0)
    for step in range(1, 6):
        s.save(step, write_files({"a": b"x"}))
    assert [5, 4, 3, 2, 1] == s.steps()


def test_saving_a_step_again_replaces_it(tmp_path: Path) -> None:
    s = store(tmp_path)
    s.save(4, write_files({"a": b"old"}))
    s.save(4, write_files({"a": b"new", "b": b"extra"}), emergency=True)
    latest = s.latest()
    assert latest is not None
    assert (b"new", True, ["step-000000000004"]) == (
        latest.file("a").read_bytes(), latest.emergency, sorted(p.name for p in tmp_path.iterdir()),
    )  # fmt: skip


def test_save_removes_temporary_directories_of_dead_processes(tmp_path: Path) -> None:
    dead = os.fork()
    if dead == 0:
        os._exit(0)
    os.waitpid(dead, 0)
    stale = tmp_path / f".tmp-{socket.gethostname()}-{dead}-abcd1234"
    stale.mkdir(parents=True)
    store(tmp_path).save(1, write_files({"a": b"x"}))
    assert not stale.exists()


def test_large_file_checksum_matches_zlib_across_pieces(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("agent.checkpoint.manifest.HASH_PIECE", 1000)
    data = os.urandom(4567)
    checkpoint = store(tmp_path).save(1, write_files({"big": data}))
    assert zlib.crc32(data) == checkpoint.files[0].crc32


@pytest.mark.parametrize(("left", "right"), [(0, 5), (5, 0), (1, 1), (100, 3), (70000, 12345)])
def test_crc32_combine_equals_crc_of_the_concatenation(left: int, right: int) -> None:
    a, b = os.urandom(left), os.urandom(right)
    assert zlib.crc32(a + b) == crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b))


def test_without_checksums_sizes_are_still_verified(tmp_path: Path) -> None:
    s = store(tmp_path, checksum=False)
    s.save(1, write_files({"a": b"abc"}))
    latest = s.latest()
    assert latest is not None
    assert (None, 3) == (latest.files[0].crc32, latest.files[0].bytes)


def test_emergency_save_returns_before_its_checksums_and_adds_them_later(tmp_path: Path) -> None:
    s = store(tmp_path)
    saved = s.save(3, write_files({"a": b"abc"}), emergency=True)
    assert s.wait_checksums(10)
    latest = s.latest()
    assert latest is not None
    assert (None, zlib.crc32(b"abc")) == (saved.files[0].crc32, latest.files[0].crc32)


def test_emergency_checksums_can_be_taken_before_returning(tmp_path: Path) -> None:
    s = CheckpointStore(tmp_path, report=False, defer_emergency_checksum=False)
    saved = s.save(3, write_files({"a": b"abc"}), emergency=True)
    assert zlib.crc32(b"abc") == saved.files[0].crc32


def test_saving_a_step_again_right_after_an_emergency_keeps_the_new_manifest(tmp_path: Path) -> None:
    s = store(tmp_path)
    s.save(3, write_files({"a": b"first"}), emergency=True)
    s.save(3, write_files({"a": b"second"}))
    assert s.wait_checksums(10)
    latest = s.latest()
    assert latest is not None
    assert (b"second", zlib.crc32(b"second"), False) == (
        latest.file("a").read_bytes(), latest.files[0].crc32, latest.emergency,
    )  # fmt: skip


def test_emergency_save_leaves_pruning_to_the_next_save(tmp_path: Path) -> None:
    s = store(tmp_path, keep=1)
    s.save(1, write_files({"a": b"x"}))
    s.save(2, write_files({"a": b"x"}), emergency=True)
    kept_after_emergency = s.steps()
    s.save(3, write_files({"a": b"x"}))
    assert ([2, 1], [3]) == (kept_after_emergency, s.steps())
