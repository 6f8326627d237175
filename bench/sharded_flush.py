#!/usr/bin/env python3
"""Sharded flush benchmark: an emergency save through ``agent.client.dcp.ShardedStore`` against a bare
``dcp.save`` + fsync of the same DTensor state, the disk's sequential write bandwidth measured in the same run,
and how long an async periodic save blocks training against a synchronous one.

    .venv/bin/python -m torch.distributed.run --standalone --nproc-per-node 2 bench/sharded_flush.py \\
        --dir /var/tmp/preemptd-bench --gib 2 --rounds 5 [--thread-count 2]

Every rank holds 1/world of the state as DTensors (256 MiB weight matrices sharded on their rows) on a CPU
mesh (gloo). Rank 0 prints one JSON object: medians over the rounds, each round's flush against the same
round's disk figure, CPU seconds and the load average. Figures go to bench/RESULTS.md; nothing here is
asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agent.client.dcp import ShardedStore
from agent.client.store import fsync_dir

PIECE = 64 * 1024 * 1024  # elements per tensor of float32: 256 MiB
# Each piece is a weight matrix of this many columns, sharded on its rows as FSDP2 shards. Not 1-D: torch
# 2.13's DTensor planning (compute_local_shape_and_global_offset) builds an index as long as the shard's
# first dimension, which for a 1-D 64M-element shard is 512 MiB of int64 and 1.3 s per tensor and save.
COLUMNS = 4096


CPU: dict[str, list[float]] = {}


def timed_collectively(fn: Any, *args: Any, label: str = "", **kwargs: Any) -> float:
    """Wall time of ``fn(*args, **kwargs)`` on all ranks together: from a common start to the slowest
    rank's end. With ``label``, the CPU time (user + system) all ranks spent in it is kept under it."""
    dist.barrier()
    before = resource.getrusage(resource.RUSAGE_SELF)
    start = time.perf_counter()
    fn(*args, **kwargs)
    mine = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_SELF)
    dist.barrier()
    elapsed = time.perf_counter() - start
    if label:
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        every = [(0.0, 0.0)] * dist.get_world_size()
        dist.all_gather_object(every, (cpu, mine))
        CPU.setdefault(label, []).append(sum(c for c, _ in every))
    return elapsed


def bare_save(state: dict[str, Any], directory: Path, rank: int) -> None:
    """What the client is compared with: DCP's own save with fsynced files, then the directories fsynced."""
    dcp_save(state, storage_writer=FileSystemWriter(directory, sync_files=True))
    if rank == 0:
        fsync_dir(directory)
        fsync_dir(directory.parent)


def sequential_write(path: Path, nbytes: int) -> None:
    """What the disk takes: one large file written in 64 MiB blocks and fsynced, on every rank at once."""
    block = memoryview(os.urandom(64 * 1024 * 1024))  # sliced without a copy
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        left = nbytes
        while left > 0:
            left -= os.write(fd, block[: min(left, len(block))])
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_dir(path.parent)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", type=Path, default=Path("/var/tmp/preemptd-bench"))
    parser.add_argument("--gib", type=float, default=2.0, help="total state over all ranks, GiB")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--thread-count", type=int, default=1, help="the store's FileSystemWriter threads")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    per_rank = int(args.gib * 2**30 / world)
    pieces = max(1, per_rank // (PIECE * 4))
    rows = per_rank // 4 // pieces // COLUMNS
    generator = torch.Generator().manual_seed(rank)
    state = {
        f"layer{i}": DTensor.from_local(
            torch.rand(rows, COLUMNS, generator=generator), mesh, [Shard(0)], run_check=False
        )
        for i in range(pieces)
    }
    nbytes = pieces * rows * COLUMNS * 4
    total = nbytes * world
    root = args.dir
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
    dist.barrier()
    store = ShardedStore(root / "store", keep=1, report=False, thread_count=args.thread_count)
    load_before = os.getloadavg()

    results: dict[str, list[float]] = {
        "disk": [],
        "bare": [],
        "client": [],
        "sync_periodic": [],
        "async_blocked": [],
    }
    # The first large write of a process here takes 4-5x longer than the next ones (1 GiB: 5.0 s, then
    # 0.8-1.0 s, whatever the writer), which would count against whichever measure comes first.
    warm = root / f"warm-{rank}"
    sequential_write(warm, nbytes)
    warm.unlink()
    for round_ in range(args.rounds):
        target = root / f"seq-{rank}"
        results["disk"].append(timed_collectively(sequential_write, target, nbytes, label="disk"))
        target.unlink()

        bare_dir = root / f"bare-{round_}"
        results["bare"].append(timed_collectively(bare_save, state, bare_dir, rank, label="bare"))
        dist.barrier()
        if rank == 0:
            shutil.rmtree(bare_dir)

        results["client"].append(
            timed_collectively(store.save, round_ * 10 + 1, state, emergency=True, label="client")
        )
        store.wait_checksums()
        results["sync_periodic"].append(timed_collectively(store.save, round_ * 10 + 2, state))
        dist.barrier()
        start = time.perf_counter()
        store.save_async(round_ * 10 + 3, state)
        blocked = [0.0] * world
        dist.all_gather_object(blocked, time.perf_counter() - start)
        results["async_blocked"].append(max(blocked))
        store.wait_async()
        dist.barrier()

    medians = {key: statistics.median(values) for key, values in results.items()}
    # Each round's flush against the same round's disk figure: the disk of a shared VM varies by 3x from
    # one minute to the next, so a ratio of medians taken minutes apart says less than a paired one.
    paired = [disk / client for disk, client in zip(results["disk"], results["client"], strict=True)]
    if rank == 0:
        disk_bw = total / medians["disk"]
        client_bw = total / medians["client"]
        print(
            json.dumps(
                {
                    "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} CPUs, "
                    f"Python {platform.python_version()}, torch {torch.__version__}",
                    "world_size": world,
                    "state_gib": round(total / 2**30, 3),
                    "rounds": args.rounds,
                    "seconds_median": {k: round(v, 3) for k, v in medians.items()},
                    "seconds_all": {k: [round(x, 3) for x in v] for k, v in results.items()},
                    "disk_gib_s": round(disk_bw / 2**30, 3),
                    "client_gib_s": round(client_bw / 2**30, 3),
                    "overhead_vs_bare_pct": round(100 * (medians["client"] / medians["bare"] - 1), 2),
                    "share_of_disk_pct": round(100 * client_bw / disk_bw, 1),
                    "share_of_disk_paired_pct": [round(100 * r, 1) for r in paired],
                    "share_of_disk_paired_median_pct": round(100 * statistics.median(paired), 1),
                    "thread_count": args.thread_count,
                    "cpu_s_all_ranks_median": {k: round(statistics.median(v), 2) for k, v in CPU.items()},
                    "load_average_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
                    "async_blocked_vs_sync_pct": round(
                        100 * medians["async_blocked"] / medians["sync_periodic"], 1
                    ),
                },
                indent=1,
            ),
            flush=True,
        )
    store.close()
    dist.barrier()
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
