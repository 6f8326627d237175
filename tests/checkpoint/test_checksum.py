"""The checkpoint files' CRC32 (agent/checkpoint/checksum.py): zlib-ng's where installed, zlib's otherwise, the
same values either way, whole or summed piece by piece."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zlib

from agent.checkpoint.checksum import FAST, crc32
from tests.support import REPO


def test_the_test_environment_sums_with_zlib_ng() -> None:
    assert FAST, "the test extra installs zlib-ng: the suite must run the fast CRC32"


def test_the_same_values_as_zlib_whole_and_in_pieces() -> None:
    data = os.urandom(3 * 1024 * 1024 + 17)
    pieces = 0
    for start in range(0, len(data), 1 << 20):
        pieces = crc32(data[start : start + (1 << 20)], pieces)
    assert zlib.crc32(data) == crc32(data) == pieces
    assert zlib.crc32(b"tail", 12345) == crc32(b"tail", 12345)
    assert zlib.crc32(memoryview(data)[5:99]) == crc32(memoryview(data)[5:99])
    assert 0 == crc32(b"")


def test_without_zlib_ng_the_standard_library_sums_the_same() -> None:
    probe = (
        "import sys, json; sys.modules['zlib_ng'] = None\n"
        "from agent.checkpoint.checksum import FAST, crc32\n"
        "print(json.dumps([FAST, crc32.__module__, crc32(b'preemptd', 7)]))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO, check=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert [False, "zlib", zlib.crc32(b"preemptd", 7)] == json.loads(done.stdout)
