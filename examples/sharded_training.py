#!/usr/bin/env python3
"""Sharded training on preemptd: a small transformer-like model under FSDP2 (``fully_shard``) that resumes
from the newest committed sharded checkpoint — at any world size — checkpoints periodically at the agent's
advised interval, flushes an emergency checkpoint when the host gets a notice (or SIGTERM/SIGUSR1), and exits
75 so the scheduler requeues it.

    torchrun --nproc-per-node 2 examples/sharded_training.py --checkpoint-dir /shared/ckpt --steps 1000
    preemptd exec -- torchrun --nproc-per-node 2 examples/sharded_training.py --checkpoint-dir /shared/ckpt

CPU with gloo anywhere, CUDA with NCCL when GPUs are present. Every rank writes its own shard through
``torch.distributed.checkpoint`` into one step directory (``agent.client.dcp.ShardedStore``), committed once
for all ranks. The global batch depends only on (seed, step) and each rank trains on its slice, so a run can
resume on another number of ranks. Progress goes to stdout as JSON lines; ``checkpoint``, ``resumed`` and
``done`` carry ``world_size`` and a ``digest`` of the full (unsharded) model and optimizer state, which is the
same whatever the world size.

Under ``torchrun --nnodes MIN:MAX`` (an elastic rendezvous) with ``--tier peer``, a notice shrinks the job
instead of stopping it: the notified hosts leave with 75, the others rebuild the model on a group of the
staying ranks and go on from the evacuated step (``agent.client.elastic``, docs/elastic.md), printing
``reform`` and ``resumed`` with the new world size.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
import time
import warnings
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.fsdp import fully_shard

from agent.client import EXIT_PREEMPTED, CheckpointError, CheckpointSchedule, Watcher
from agent.client.dcp import Progress, ShardedStore, TrainState
from agent.client.elastic import Elastic, Reform
from agent.client.hazard import Hazard, combined, hazard_of, rate_report, steps_between
from agent.client.peer.ramtier import RamTier
from agent.client.torch import Coordinator, Decision

GLOBAL_BATCH = 16
SEQUENCE = 8


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--checkpoint-dir", type=Path, required=True, help="shared by all ranks")
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
    parser.add_argument(
        "--async-saves", action="store_true", help="periodic saves in the background (dcp.async_save)"
    )
    parser.add_argument(
        "--tier", choices=("durable", "peer"), default="durable",
        help="peer: evacuate an emergency save into the RAM of the hosts without a notice (PREEMPTD_JOB_ID)",
    )  # fmt: skip
    parser.add_argument(
        "--drain", action="store_true", help="with --tier peer: the agents copy it to the root"
    )
    parser.add_argument(
        "--collective-timeout-s",
        type=float,
        default=0.0,
        help="the job's collectives fail after this long (0: torch's default, 30 min for gloo): a host lost "
        "without a notice then stops the job in seconds rather than leaving the others blocked",
    )
    parser.add_argument(
        "--snapshot-every",
        type=int,
        default=0,
        help="with --tier peer: a peer snapshot (this host's RAM and the next host's) every this many steps",
    )
    parser.add_argument(
        "--log-every", type=int, default=0, help="a 'step' line every this many steps (0: none)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--width", type=int, default=32, help="model width (a multiple of --heads)")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    return parser.parse_args(argv)


def emit(event: str, **fields: Any) -> None:
    # One write() of the whole line: under torchrun every rank shares stdout, and print() hands the text and
    # its newline to the pipe separately, so another rank's line can land in between. A write of at most
    # PIPE_BUF (4096) bytes to a pipe is atomic, and one write() to a file moves the shared offset once.
    line = (json.dumps({"event": event, **fields}) + "\n").encode()
    while line:
        line = line[os.write(sys.stdout.fileno(), line) :]


class Block(nn.Module):
    """Pre-norm self-attention and MLP, as in a transformer layer."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(batch, length, 3, self.heads, -1).unbind(2)
        attended = nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, length, width))
        return x + self.mlp(self.norm2(x))


class TinyTransformer(nn.Module):
    def __init__(self, width: int, heads: int, layers: int, vocab: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))  # type: ignore[no-any-return]


def build(args: argparse.Namespace, device: torch.device) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(args.seed)  # the same initial weights on every rank before sharding
    model = TinyTransformer(args.width, args.heads, args.layers).to(device)
    if dist.is_initialized():
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, optimizer


def batch(seed: int, step: int, rank: int, world_size: int, device: torch.device) -> torch.Tensor:
    """This rank's slice of the global batch of ``step`` (the global batch depends only on seed and step)."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    tokens = torch.randint(0, 64, (GLOBAL_BATCH, SEQUENCE + 1), generator=generator)
    return tokens.tensor_split(world_size)[rank].to(device)


def digest(model: nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """A fingerprint of the full (unsharded) model and optimizer state, the same at any world size; every
    rank gets rank 0's (gathering the full state is a collective)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state, optim_state = get_state_dict(model, optimizer, options=options)
    hasher = hashlib.sha256()
    for name, tensor in sorted(model_state.items()):
        hasher.update(name.encode())
        hasher.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    for name, state in sorted(optim_state.get("state", {}).items()):
        for key, value in sorted(state.items()):
            hasher.update(f"{name}.{key}".encode())
            if isinstance(value, torch.Tensor):
                hasher.update(value.detach().cpu().float().contiguous().numpy().tobytes())
            else:
                hasher.update(repr(value).encode())
    if not dist.is_initialized():
        return hasher.hexdigest()
    box = [hasher.hexdigest()]
    dist.broadcast_object_list(box, src=0)
    return str(box[0])


@dataclass
class Job:
    """What is bound to the current process group: rebuilt when the job shrinks."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    store: ShardedStore
    coordinator: Coordinator
    progress: Progress
    state: dict[str, Any]


def open_job(
    args: argparse.Namespace,
    device: torch.device,
    watcher: Watcher,
    schedule: CheckpointSchedule,
    elastic: Elastic,
    reform: Reform | None = None,
) -> tuple[Job, int]:
    """Build the model and the store on the current group and resume from the newest step every rank can load
    (a broken one is skipped); the job and its first step. ``reform``: the group was just rebuilt at a new size."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model, optimizer = build(args, device)
    # Construction checks that the root is shared by every rank.
    tiers = RamTier(args.socket, drain_to=args.checkpoint_dir if args.drain else None)
    store = ShardedStore(
        args.checkpoint_dir, keep=args.keep, socket_path=args.socket, tier=args.tier, ram_tier=tiers
    )
    progress = Progress()
    job = Job(
        model,
        optimizer,
        store,
        Coordinator(
            watcher, schedule, every=args.every, leaves=elastic.host_leaves, siblings=elastic.siblings
        ),
        progress,
        {"train": TrainState(model, optimizer), "progress": progress},
    )
    resumed = store.load_latest(job.state)
    if resumed is None:
        emit("fresh", rank=rank, world_size=world_size)
        return job, 0
    watcher.mark_handled([resumed.notice_id])
    extra = {} if reform is None else {"reformed": True, "previous_world_size": reform.previous_world_size}
    emit(
        "resumed",
        rank=rank,
        step=resumed.step,
        next_step=resumed.step,
        world_size=world_size,
        saved_world_size=resumed.world_size,
        digest=digest(model, optimizer),
        **extra,
    )
    return job, resumed.step


def train(
    args: argparse.Namespace, job: Job, start: int, watcher: Watcher, device: torch.device
) -> Decision | None:
    """Train from ``start``: None when the last step is done, the decision when an emergency checkpoint was
    committed (the caller decides whether the job stops or shrinks); raises when a save fails otherwise."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model, optimizer, store, coordinator = job.model, job.optimizer, job.store, job.coordinator
    coordinator.last_snapshot = start  # the next snapshot comes K steps after the step resumed from
    was_connected, hazard = False, 1.0
    for step in range(start, args.steps):
        tokens = batch(args.seed, step, rank, world_size, device)
        optimizer.zero_grad(set_to_none=True)
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        if args.step_time:
            time.sleep(args.step_time)
        if watcher.connected != was_connected:
            was_connected = watcher.connected
            emit("agent_connected" if was_connected else "agent_disconnected", rank=rank, step=step + 1)
        if args.log_every and (step + 1) % args.log_every == 0:
            emit("step", rank=rank, step=step + 1, world_size=world_size)

        decision = coordinator.check(step + 1)
        if args.snapshot_every and coordinator.hazard != hazard:
            hazard = coordinator.hazard
            rate_changed(job, watcher, step + 1, args.snapshot_every, hazard)
        if not decision.checkpoint:
            if args.snapshot_every and coordinator.snapshot_due(step + 1, args.snapshot_every):
                snapshot(job, step + 1, coordinator.hazard)
            continue
        job.progress.step = step + 1
        if args.async_saves and not decision.emergency:
            pending = store.save_async(step + 1, job.state, metadata={"loss": loss.detach().item()})
            coordinator.done(decision)
            emit(
                "checkpoint",
                rank=rank,
                step=pending.step,
                emergency=False,
                blocked_s=round(pending.blocked_s, 4),
                world_size=world_size,
                digest=digest(model, optimizer),
            )  # the state just staged
            continue
        try:
            saved = store.save(
                step + 1,
                job.state,
                emergency=decision.emergency,
                notice_id=decision.notice_id,
                metadata={"loss": loss.detach().item()},
                deadline=decision.deadline,
                noticed=decision.noticed,
            )
        except CheckpointError as exc:
            # A failed emergency save (a full disk) hands the notice to the newest earlier step, which the
            # store recorded for `preemptd exec`: exit 75 all the same, so the job is requeued from there.
            if not decision.emergency or exc.fallback is None:
                raise
            emit(
                "preempted",
                rank=rank,
                step=exc.fallback.step,
                notice_id=decision.notice_id,
                failed_step=step + 1,
                error=str(exc)[:1000],
            )
            raise Stopped from exc
        coordinator.done(decision)
        budget = store.last_budget
        emit(
            "checkpoint",
            rank=rank,
            step=saved.step,
            emergency=decision.emergency,
            seconds=round(saved.checkpoint.duration_s or 0.0, 4),
            bytes=saved.checkpoint.bytes,
            time_left=decision.time_left(),
            before_deadline=decision.deadline is None or datetime.now(timezone.utc) < decision.deadline,
            predicted_s=budget.predicted_s if budget else None,
            predicted_miss=budget.predicted_miss if budget else False,
            world_size=world_size,
            digest=digest(model, optimizer),
        )
        if decision.emergency:
            return decision
    store.wait_async()  # the last background save is committed before "done"
    emit("done", rank=rank, step=args.steps, world_size=world_size, digest=digest(model, optimizer))
    return None


def rate_changed(job: Job, watcher: Watcher, step: int, usual: int, factor: float) -> None:
    """Say that snapshots now come every ``steps_between(usual, factor)`` steps: a line, and (from each node's
    first local rank) a report to its agent, with this host's own reasons."""
    local = combined(hazard_of(watcher.notices, watcher.policy), job.coordinator.siblings.hazard())
    every = steps_between(usual, factor)
    emit(
        "snapshot_rate",
        rank=dist.get_rank(),
        step=step,
        every=every,
        hazard=factor,
        reasons=list(local.reasons),
    )
    if os.environ.get("LOCAL_RANK", "0") == "0" and job.store.reporter is not None:
        reporter = job.store.reporter
        reporter.send(rate_report(step, every, usual, Hazard(factor, local.reasons), reporter.client))


def snapshot(job: Job, step: int, hazard: float) -> None:
    """A peer snapshot of the state after ``step``: staged now, copied into two hosts' RAM in the background.
    ``hazard``: the job's agreed hazard factor (more than 1: snapshots come more often, agent.client.hazard)."""
    job.progress.step = step
    # Copies go to pools other than those of hosts the job lost lately (a reclaim burst takes more there).
    taken = job.store.snapshot(step, job.state, avoid_pools=job.coordinator.siblings.pools())
    if taken is not None:
        emit(
            "snapshot",
            rank=dist.get_rank(),
            step=step,
            blocked_s=round(taken.blocked_s, 4),
            world_size=dist.get_world_size(),
            hazard=hazard,
            digest=digest(job.model, job.optimizer),
        )


class Stopped(Exception):
    """The job stops for a notice without a committed emergency step of its own (its fallback is recorded)."""


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # FSDP2 warns, on every rank, that the model returned a view tensor (nn.Linear on a 3-D input does), as an
    # in-place op on it would skip the all-gather. This loop only reshapes the logits into the loss, never in
    # place. The filter names this model alone: a model of your own put here still gets the warning.
    warnings.filterwarnings(
        "ignore", r"FSDP2-wrapped module \(FSDPTinyTransformer\) returned a view tensor", UserWarning
    )
    torch.set_num_threads(1)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    # A one-rank run has a process group too, so that the same FSDP2 code and DCP paths run at any size.
    backend = "cpu:gloo,cuda:nccl" if cuda else "gloo"
    timeout = timedelta(seconds=args.collective_timeout_s) if args.collective_timeout_s > 0 else None
    if "RANK" in os.environ:
        dist.init_process_group(backend, timeout=timeout)
    else:  # plain `python examples/sharded_training.py`: a group of one, without a rendezvous
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)

    signals = None if args.no_signals else (signal.SIGTERM, signal.SIGUSR1)
    watcher = Watcher(args.socket, signals=signals).start()
    schedule = CheckpointSchedule(args.interval_s, args.socket)
    # Under torchrun --nnodes MIN:MAX the job shrinks at a notice instead of stopping (a no-op otherwise).
    elastic = Elastic(socket_path=args.socket, timeout=timeout)
    job: Job | None = None
    reform: Reform | None = None
    try:
        while True:
            job, start = open_job(args, device, watcher, schedule, elastic, reform)
            decision = train(args, job, start, watcher, device)
            if decision is None:
                return 0
            job.store.close(timeout=5.0)  # deferred checksums, reports: before the group is rebuilt
            reform = elastic.after_emergency(decision, watcher, step=job.progress.step)
            emit("reform", rank=reform.rank, step=job.progress.step, **reform.as_dict())
            if reform.action != "continue":
                emit("preempted", rank=reform.rank, step=job.progress.step, notice_id=decision.notice_id)
                return EXIT_PREEMPTED
    except Stopped:
        return EXIT_PREEMPTED
    finally:
        if job is not None:
            job.store.close(timeout=5.0)  # deferred checksums of an emergency save, queued reports
        watcher.stop()
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
