#!/usr/bin/env python3
"""A fault-tolerant training harness on preemptd: resume from the latest checkpoint, checkpoint periodically
at the agent's advised interval (a fixed one until the agent has advice), flush an emergency checkpoint when
the host gets a notice (or the process gets SIGTERM/SIGUSR1), and exit with status 75 so the scheduler
requeues the job.

One process:        python examples/fault_tolerant_training.py --checkpoint-dir /ckpt --steps 1000
Several (gloo/nccl): torchrun --nproc-per-node 2 examples/fault_tolerant_training.py --checkpoint-dir /ckpt

Each rank keeps its own store (``<checkpoint-dir>/rank-<r>``); all ranks agree on the step to save and on the
step to resume from. The model is a tiny regression MLP on synthetic data so the harness runs anywhere; the
batches depend only on (seed, rank, step), so a resumed run continues exactly where the saved one stopped.
Progress goes to stdout as JSON lines.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from agent.client import EXIT_PREEMPTED, CheckpointError, CheckpointSchedule, CheckpointStore, Watcher
from agent.client.torch import Coordinator, agree_load, load_torch, torch_writer


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--checkpoint-dir", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=1000, help="train until this many steps are done")
    parser.add_argument("--interval-s", type=float, default=600.0, help="periodic interval without advice")
    parser.add_argument("--keep", type=int, default=3, help="checkpoints to keep (0: all)")
    parser.add_argument("--every", type=int, default=1, help="agree across ranks every this many steps")
    parser.add_argument(
        "--step-time", type=float, default=0.0, help="extra seconds per step (simulated work)"
    )
    parser.add_argument(
        "--socket", default=None, help="the agent's socket (default: PREEMPTD_SOCKET or auto)"
    )
    parser.add_argument("--no-signals", action="store_true", help="do not treat SIGTERM/SIGUSR1 as a notice")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--width", type=int, default=32)
    return parser.parse_args(argv)


def emit(event: str, **fields: Any) -> None:
    # One write() of the whole line: under torchrun every rank shares stdout, and print() hands the text and
    # its newline to the pipe separately, so another rank's line can land in between. A write of at most
    # PIPE_BUF (4096) bytes to a pipe is atomic, and one write() to a file moves the shared offset once.
    line = (json.dumps({"event": event, **fields}) + "\n").encode()
    while line:
        line = line[os.write(sys.stdout.fileno(), line) :]


def build(width: int, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, width), nn.Tanh(), nn.Linear(width, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    return model, optimizer


def batch(seed: int, rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed * 1_000_003 + rank * 10_007 + step)
    x = torch.randn(64, 16, generator=generator)
    y = x[:, :4].sum(dim=1, keepdim=True).sin()
    return x, y


def digest(model: nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """A fingerprint of the model and optimizer state, to compare runs bit for bit."""
    hasher = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        hasher.update(name.encode())
        hasher.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    for index, state in sorted(optimizer.state_dict()["state"].items()):
        for key, value in sorted(state.items()):
            hasher.update(f"{index}.{key}".encode())
            if isinstance(value, torch.Tensor):
                hasher.update(value.detach().cpu().contiguous().numpy().tobytes())
            else:
                hasher.update(repr(value).encode())
    return hasher.hexdigest()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size > 1:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0

    model, optimizer = build(args.width, args.seed)
    trained = nn.parallel.DistributedDataParallel(model) if dist.is_initialized() else model
    store = CheckpointStore(args.checkpoint_dir / f"rank-{rank}", keep=args.keep, socket_path=args.socket)
    signals = None if args.no_signals else (signal.SIGTERM, signal.SIGUSR1)
    watcher = Watcher(args.socket, signals=signals).start()
    schedule = CheckpointSchedule(args.interval_s, args.socket)
    coordinator = Coordinator(watcher, schedule, every=args.every)

    start = 0
    found = agree_load(store, load_torch)  # the newest step every rank can load; a broken one is skipped
    if found is not None:
        resumed, state = found
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = resumed.step
        # A notice still active when we come back (a drill, or a rerun on the same host) already has its
        # emergency checkpoint: it does not stop this run again.
        watcher.mark_handled([resumed.notice_id])
        emit("resumed", rank=rank, step=resumed.step, next_step=start, digest=digest(model, optimizer))
    else:
        emit("fresh", rank=rank)

    status = 0
    was_connected = False
    try:
        for step in range(start, args.steps):
            x, y = batch(args.seed, rank, step)
            optimizer.zero_grad(set_to_none=True)
            loss = nn.functional.mse_loss(trained(x), y)
            loss.backward()
            optimizer.step()
            if args.step_time:
                time.sleep(args.step_time)
            if watcher.connected != was_connected:
                was_connected = watcher.connected
                emit("agent_connected" if was_connected else "agent_disconnected", rank=rank, step=step + 1)

            decision = coordinator.check(step + 1)
            if not decision.checkpoint:
                continue
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
            try:
                checkpoint = store.save(
                    step + 1,
                    torch_writer(state),
                    emergency=decision.emergency,
                    notice_id=decision.notice_id,
                    metadata={"rank": rank, "world_size": world_size, "loss": loss.detach().item()},
                )
            except CheckpointError as exc:
                # A failed emergency save (a full disk) hands the notice to the newest earlier step, which the
                # store recorded for `preemptd exec`: exit 75 all the same, so the job is requeued from there.
                if not decision.emergency or exc.fallback is None:
                    raise
                emit("preempted", rank=rank, step=exc.fallback.step, notice_id=decision.notice_id,
                     failed_step=step + 1, error=str(exc)[:1000])  # fmt: skip
                status = EXIT_PREEMPTED
                break
            coordinator.done(decision)
            left = decision.time_left()
            emit(
                "checkpoint",
                rank=rank,
                step=checkpoint.step,
                emergency=decision.emergency,
                seconds=round(checkpoint.duration_s or 0.0, 4),
                bytes=checkpoint.bytes,
                time_left=left,
                before_deadline=decision.deadline is None or datetime.now(timezone.utc) < decision.deadline,
                digest=digest(model, optimizer),
                interval_s=schedule.interval_s,
                advised=schedule.advised,
            )
            if decision.emergency:
                emit("preempted", rank=rank, step=checkpoint.step, notice_id=decision.notice_id)
                status = EXIT_PREEMPTED
                break
        else:
            emit("done", rank=rank, step=args.steps, digest=digest(model, optimizer))
    finally:
        store.close(timeout=5.0)  # deferred checksums of an emergency save, queued reports
        watcher.stop()
        if dist.is_initialized():
            dist.destroy_process_group()
    return status


if __name__ == "__main__":
    sys.exit(main())
