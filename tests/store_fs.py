"""A small file system of its own for the checkpoint store's tests to fill: a real ENOSPC, not a mock."""

from __future__ import annotations

import errno
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

SMALL_FS_BYTES = 1 << 20


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs mounted at a fresh directory, unmounted after the test. Mounting needs root (or
    CAP_SYS_ADMIN): the test is skipped, saying why, where it cannot mount."""
    mount = tmp_path / "small-fs"
    mount.mkdir()
    if shutil.which("mount") is None:
        pytest.skip("no mount command to make a small tmpfs to fill")
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={SMALL_FS_BYTES}", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs to fill (needs root): {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True, check=False)


def fill(directory: Path) -> None:
    """Write a file into ``directory`` until its file system is full (a real ENOSPC)."""
    with open(directory / "filler", "wb", buffering=0) as handle:
        try:
            while True:
                handle.write(bytes(64 * 1024))
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc
        try:
            while True:  # the last few bytes, so that nothing is left
                handle.write(bytes(512))
        except OSError:
            pass
