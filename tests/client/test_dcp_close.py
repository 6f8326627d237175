"""The sharded store's own process groups end with it: ``close()`` destroys them (their gloo worker threads
joined) and a store never closed has them destroyed at exit. A gloo group alive while the interpreter
finalizes aborted a rank now and then ("terminate called without an active exception": a worker thread
freeing a finished collective's tensors needs the GIL after finalization began), since
``destroy_process_group()`` does not join the threads of a group the store still holds. Two real gloo ranks
over loopback; the process's native threads are counted in /proc."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.client.support import dcp_job
from tests.lazy import HAS_TORCH
from tests.store_fs import small_fs

__all__ = ["small_fs"]  # the fixture, used by name

pytestmark = [
    pytest.mark.slow,
    pytest.mark.torch_mp,
    pytest.mark.timeout(180),
    pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed"),
]


async def test_close_destroys_the_stores_own_groups_and_lets_the_given_one_go(tmp_path: Path) -> None:
    for rank in await dcp_job(tmp_path, "close"):
        assert rank["store"] > rank["job"], rank  # its async and stream groups (its save group was given)
        assert rank["closed"] == rank["job"], rank  # their threads joined; the job's two groups alive
        assert "closed" in rank["save_after_close"], rank
        assert rank["given_group_sum"] == 2.0, rank
        assert rank["destroyed"] == rank["at_exit"] == rank["bare"], rank


async def test_a_store_never_closed_waits_for_its_background_save_and_destroys_its_groups_at_exit(
    tmp_path: Path,
) -> None:
    for rank in await dcp_job(tmp_path, "exit"):
        assert rank["at_exit"] == rank["bare"], rank
    newest = max((tmp_path / "ckpt").glob("step-*"))  # committed: renamed from its temporary directory
    manifest = json.loads((newest / "manifest.json").read_text())
    assert (3, 2) == (manifest["step"], manifest["metadata"]["world_size"])


async def test_a_failed_background_saves_error_does_not_keep_the_groups_alive(
    tmp_path: Path,
    small_fs: Path,
) -> None:
    # The error waits for wait_async(); its traceback's frames held the group it ran on.
    for rank in await dcp_job(tmp_path, "failed", root=small_fs):
        assert "no space left" in rank["error"], rank
        assert rank["closed"] == rank["job"], rank
        assert rank["destroyed"] == rank["at_exit"] == rank["bare"], rank


async def test_close_after_destroy_process_group_lets_the_groups_go(tmp_path: Path) -> None:
    for rank in await dcp_job(tmp_path, "destroy_first"):
        assert rank["destroyed"] == rank["at_exit"] == rank["bare"], rank
