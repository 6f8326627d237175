#!/usr/bin/env python3
"""Flush benchmark: from a notice to a durable emergency checkpoint, against a bare ``torch.save`` + fsync of
the same state in the same run.

A real agent runs as a child process on a temporary socket. Each round:
- bare: ``torch.save(state, f)``, ``f.flush()``, ``os.fsync`` — the least any durable save can cost;
- client: a training loop (``--step-ms`` per step) checks ``watcher.should_checkpoint()`` after each step;
  the clock starts when the drill is posted to the agent and stops when ``CheckpointStore.save`` returns
  (files fsynced and checksummed, manifest written, directory renamed and fsynced).
The order alternates between rounds; medians are printed with the ratio client / bare.

    python bench/flush.py --size-gb 1 --rounds 5 [--dir /path/on/the/disk/to/test]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from agent.client import CheckpointStore, Watcher  # noqa: E402
from agent.client.store import DurableFile  # noqa: E402
from agent.client.torch import torch_writer  # noqa: E402
from agent.client.transport import request_json  # noqa: E402


def make_state(size_gb: float) -> dict[str, torch.Tensor]:
    """About ``size_gb`` GB of float32 tensors in 64 MiB pieces (random, so nothing compresses)."""
    piece = 64 * 1024 * 1024 // 4
    count = max(1, round(size_gb * 1e9 / (piece * 4)))
    generator = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": torch.randn(piece, generator=generator) for i in range(count)}


def bare_save(state: dict[str, torch.Tensor], path: Path) -> float:
    started = time.perf_counter()
    with open(path, "wb") as handle:
        torch.save(state, handle)
        handle.flush()
        os.fsync(handle.fileno())
    elapsed = time.perf_counter() - started
    path.unlink()
    return elapsed


def streamed_save(state: dict[str, torch.Tensor], path: Path) -> float:
    """The same write technique the client uses (writeback while serialising), without store, manifest,
    checksum or notice: what is left between this and the client is the client's own overhead."""
    started = time.perf_counter()
    with DurableFile(path, checksum=False) as handle:
        torch.save(state, handle)  # type: ignore[arg-type]
    elapsed = time.perf_counter() - started
    path.unlink()
    return elapsed


def client_flush(
    state: dict[str, torch.Tensor], store: CheckpointStore, watcher: Watcher, socket_path: Path, step_s: float
) -> dict[str, float]:
    """Post a drill, run "training steps" until the watcher says so, save; times from the post."""
    posted = threading.Event()
    times: dict[str, float] = {}

    def post() -> None:
        times["t0"] = time.perf_counter()
        body = request_json(
            "POST", "/v1/drills", {"kind": "termination", "in_s": 60}, socket_path=socket_path
        )
        times["notice_id"] = body["notice"]["id"]
        posted.set()

    poster = threading.Thread(target=post)
    step = 0
    a = torch.randn(256, 256)
    poster.start()
    while True:
        deadline = time.perf_counter() + step_s
        while time.perf_counter() < deadline:  # a training step: busy in torch kernels, like a real one
            a = torch.tanh(a @ a)
        step += 1
        if watcher.should_checkpoint():
            break
    seen = time.perf_counter()
    trigger = watcher.trigger
    store.save(step, torch_writer(state), emergency=True, notice_id=trigger.notice_id if trigger else None)
    done = time.perf_counter()
    watcher.acknowledge()
    store.wait_checksums()  # not timed: the checkpoint is durable; its manifest gains CRCs afterwards
    poster.join()
    request_json("DELETE", f"/v1/drills/{times['notice_id']}", socket_path=socket_path)
    for checkpoint in store.steps():
        shutil.rmtree(store.path_of(checkpoint))
    return {"total": done - times["t0"], "notice": seen - times["t0"], "save": done - seen}


def start_agent(base: Path) -> subprocess.Popen[bytes]:
    log = (base / "agent.log").open("ab")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREEMPTD_", "NOTIFY_SOCKET"))}
    env["PYTHONPATH"] = str(REPO)
    args = [sys.executable, "-m", "agent", "run", "--socket", str(base / "a.sock"), "--state-dir",
            str(base / "state"), "--cloud", "none", "--log-format", "json"]  # fmt: skip
    return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(REPO))


def machine() -> str:
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{os.cpu_count()} cores, {mem:.0f} GiB, {platform.platform()}, Python {platform.python_version()}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--size-gb", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--step-ms", type=float, default=10.0, help="simulated training step")
    parser.add_argument("--dir", type=Path, default=None, help="where checkpoints are written (default /tmp)")
    parser.add_argument("--no-checksum", action="store_true", help="store without CRCs (sizes only)")
    parser.add_argument(
        "--sync-checksum",
        action="store_true",
        help="CRCs before the save returns (not deferred for emergencies)",
    )
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args()

    torch.set_num_threads(1)
    base = Path(tempfile.mkdtemp(prefix="pdb-", dir="/tmp"))
    data_dir = Path(tempfile.mkdtemp(prefix="preemptd-bench-", dir=args.dir))
    agent = start_agent(base)
    watcher = Watcher(base / "a.sock").start()
    try:
        if not watcher.wait_connected(30):
            raise SystemExit(f"the agent did not come up; see {base / 'agent.log'}")
        state = make_state(args.size_gb)
        size = sum(t.numel() * t.element_size() for t in state.values())
        store = CheckpointStore(
            data_dir / "store",
            keep=1,
            checksum=not args.no_checksum,
            defer_emergency_checksum=not args.sync_checksum,
            socket_path=base / "a.sock",
        )
        bare: list[float] = []
        streamed: list[float] = []
        client: list[dict[str, float]] = []
        bare_save(state, data_dir / "warmup.pt")  # first touch of the disk and the allocator
        for round_ in range(args.rounds):
            order = ("bare", "streamed", "client") if round_ % 2 == 0 else ("client", "streamed", "bare")
            for which in order:
                if which == "bare":
                    bare.append(bare_save(state, data_dir / "bare.pt"))
                elif which == "streamed":
                    streamed.append(streamed_save(state, data_dir / "streamed.pt"))
                else:
                    client.append(client_flush(state, store, watcher, base / "a.sock", args.step_ms / 1000))
            print(
                f"round {round_ + 1}: bare {bare[-1]:.3f} s, streamed {streamed[-1]:.3f} s, "
                f"client {client[-1]['total']:.3f} s "
                f"(notice {client[-1]['notice'] * 1000:.1f} ms, save {client[-1]['save']:.3f} s)",
                file=sys.stderr,
            )
        med_bare = statistics.median(bare)
        med_client = statistics.median(c["total"] for c in client)
        result: dict[str, Any] = {
            "machine": machine(),
            "bytes": size,
            "rounds": args.rounds,
            "step_ms": args.step_ms,
            "checksum": "off" if args.no_checksum else "sync" if args.sync_checksum else "deferred",
            "bare_median_s": round(med_bare, 4),
            "client_median_s": round(med_client, 4),
            "notice_median_ms": round(statistics.median(c["notice"] for c in client) * 1000, 2),
            "save_median_s": round(statistics.median(c["save"] for c in client), 4),
            "ratio": round(med_client / med_bare, 4),
            # each round's client time over the bare time measured next to it, which shares its disk weather
            "streamed_median_s": round(statistics.median(streamed), 4),
            "paired_vs_streamed_median": round(
                statistics.median(c["total"] / b for c, b in zip(client, streamed, strict=True)), 4
            ),
            "paired_ratio_median": round(
                statistics.median(c["total"] / b for c, b in zip(client, bare, strict=True)), 4
            ),
            "overhead_pct": round((med_client / med_bare - 1) * 100, 2),
        }
        if args.json:
            print(json.dumps(result))
        else:
            print(f"machine: {result['machine']}")
            print(f"state: {size / 1e9:.2f} GB, {args.rounds} rounds, {args.step_ms} ms steps")
            print(f"bare torch.save + fsync (median): {med_bare:.3f} s")
            print(
                f"notice -> durable emergency checkpoint (median): {med_client:.3f} s "
                f"(notice seen after {result['notice_median_ms']} ms, save {result['save_median_s']} s)"
            )
            print(f"ratio: {result['ratio']:.3f} ({result['overhead_pct']:+.1f} %)")
            print(f"median of per-round ratios: {result['paired_ratio_median']:.3f}")
            print(
                f"same write technique without the client (median): {result['streamed_median_s']:.3f} s; "
                f"client / that, per round (median): {result['paired_vs_streamed_median']:.3f}"
            )
        store.close()
    finally:
        watcher.stop()
        agent.send_signal(signal.SIGTERM)
        try:
            agent.wait(20)
        except subprocess.TimeoutExpired:
            agent.kill()
        shutil.rmtree(data_dir, ignore_errors=True)
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
