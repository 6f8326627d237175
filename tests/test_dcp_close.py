"""The sharded store's own process groups end with it: ``close()`` destroys them (their gloo worker threads
joined) and a store never closed has them destroyed at exit. A gloo group alive while the interpreter
finalizes aborted a rank now and then ("terminate called without an active exception": a worker thread
freeing a finished collective's tensors needs the GIL after finalization began), since
``destroy_process_group()`` does not join the threads of a group the store still holds. Two real gloo ranks
over loopback; the process's native threads are counted in /proc."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from tests.lazy import HAS_TORCH
from tests.store_fs import small_fs
from tests.support import REPO
from tests.test_evacuate_hosts import _free_port

__all__ = ["small_fs"]  # the fixture, used by name

pytestmark = [
    pytest.mark.slow,
    pytest.mark.torch_mp,
    pytest.mark.timeout(180),
    pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed"),
]

# One rank: a peer-tier store (its own async and stream groups; the save group is the job's, given to it)
# saves in the background and in the foreground, then is closed or left to the exit.
_RANK = textwrap.dedent(
    """
    import atexit, json, os, sys

    def threads():
        return len(os.listdir("/proc/self/task"))

    mode, root = sys.argv[1], sys.argv[2]
    # Registered before the store's module is imported, so they run after the store's own exit handler (the
    # last registered runs first): then the job's groups are destroyed ("exit"), then the threads counted.
    atexit.register(lambda: print(json.dumps({"at_exit": threads()}), flush=True))
    import torch, torch.distributed as dist
    if mode == "exit":
        atexit.register(dist.destroy_process_group)
    from agent.client.dcp import ShardedStore

    out = {"bare": threads()}
    dist.init_process_group("gloo")
    given = dist.new_group(backend="gloo")
    out["job"] = threads()
    store = ShardedStore(root, report=False, group=given, tier="peer", job="close-test",
                         socket_path=os.path.join(root, "no-agent.sock"))
    out["store"] = threads()
    state = {"w": torch.arange(4096.0)}
    if mode == "failed":  # the root is a full file system: the background save fails on its thread
        failed = store.save_async(1, {"w": torch.ones(1 << 20)})
        try:
            store.wait_async()
        except Exception as exc:
            out["error"] = str(exc)
        mode = "close"
    else:
        store.save_async(1, state)
        store.save(2, state)
    if mode == "close":
        store.close()
        out["closed"] = threads()
        try:
            store.save(3, {"w": torch.ones(1)})
        except RuntimeError as exc:
            out["save_after_close"] = str(exc)
        total = torch.ones(1)
        dist.all_reduce(total, group=given)  # the group it was given is let go, not destroyed
        out["given_group_sum"] = total.item()
        del given
        dist.destroy_process_group()
        out["destroyed"] = threads()
    elif mode == "destroy_first":  # the job's groups destroyed before the store is closed
        del given
        dist.destroy_process_group()
        store.close()
        out["destroyed"] = threads()
    else:  # a background save left running: its commit ends before the groups go
        del given
        store.save_async(3, state)
    print(json.dumps(out), flush=True)
    """
)


async def _job(
    tmp: Path, mode: str, root: Path | None = None, rank_script: str = _RANK
) -> list[dict[str, Any]]:
    """Two ranks of ``rank_script`` in ``mode`` (its second argument: ``root``, else ``tmp``/ckpt); each
    rank's JSON lines merged into one dict."""
    script = tmp / "rank.py"
    script.write_text(rank_script)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREEMPTD_", "TORCHELASTIC_"))}
    env.update(PYTHONPATH=str(REPO), GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(_free_port()), WORLD_SIZE="2")  # fmt: skip
    procs = []
    for rank in range(2):
        proc = await asyncio.create_subprocess_exec(
            sys.executable, str(script), mode, str(root or tmp / "ckpt"), env={**env, "RANK": str(rank)},
            cwd=str(REPO), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        procs.append(proc)
    outs = [await asyncio.wait_for(proc.communicate(), 150) for proc in procs]
    results = []
    for proc, (out, err) in zip(procs, outs, strict=True):
        assert proc.returncode == 0, err.decode()[-3000:]
        merged: dict[str, Any] = {}
        for line in out.decode().splitlines():
            merged.update(json.loads(line))
        results.append(merged)
    return results


async def test_close_destroys_the_stores_own_groups_and_lets_the_given_one_go(tmp_path: Path) -> None:
    for rank in await _job(tmp_path, "close"):
        assert rank["store"] > rank["job"], rank  # its async and stream groups (its save group was given)
        assert rank["closed"] == rank["job"], rank  # their threads joined; the job's two groups alive
        assert "closed" in rank["save_after_close"], rank
        assert rank["given_group_sum"] == 2.0, rank
        assert rank["destroyed"] == rank["at_exit"] == rank["bare"], rank


async def test_a_store_never_closed_waits_for_its_background_save_and_destroys_its_groups_at_exit(
    tmp_path: Path,
) -> None:
    for rank in await _job(tmp_path, "exit"):
        assert rank["at_exit"] == rank["bare"], rank
    newest = max((tmp_path / "ckpt").glob("step-*"))  # committed: renamed from its temporary directory
    manifest = json.loads((newest / "manifest.json").read_text())
    assert (3, 2) == (manifest["step"], manifest["metadata"]["world_size"])


async def test_a_failed_background_saves_error_does_not_keep_the_groups_alive(
    tmp_path: Path,
    small_fs: Path,
) -> None:
    # The error waits for wait_async(); its traceback's frames held the group it ran on.
    for rank in await _job(tmp_path, "failed", root=small_fs):
        assert "no space left" in rank["error"], rank
        assert rank["closed"] == rank["job"], rank
        assert rank["destroyed"] == rank["at_exit"] == rank["bare"], rank


async def test_close_after_destroy_process_group_lets_the_groups_go(tmp_path: Path) -> None:
    for rank in await _job(tmp_path, "destroy_first"):
        assert rank["destroyed"] == rank["at_exit"] == rank["bare"], rank
