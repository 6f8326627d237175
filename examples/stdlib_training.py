#!/usr/bin/env python3
"""A fault-tolerant training loop on preemptd with the standard library alone (no PyTorch, no numpy): resume
from the newest checkpoint that verifies and loads, checkpoint periodically at the agent's advised interval (a
fixed one until the agent has advice), flush an emergency checkpoint when the host gets a notice (or the
process gets SIGTERM/SIGUSR1), and exit with status 75 so the scheduler requeues the job.

    python examples/stdlib_training.py --checkpoint-dir /ckpt --steps 1000

The model is a linear regression trained by minibatch SGD with momentum on synthetic data, in pure Python; its
weights and momentum go through the client's real ``CheckpointStore`` as one JSON file. The batches depend
only on (seed, step), so a resumed run continues exactly where the saved one stopped. ``preemptd demo`` runs
it when PyTorch is not installed (``examples/fault_tolerant_training.py`` is the same harness on PyTorch, for
several ranks). It takes that example's options and prints the same progress lines, JSON on stdout.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import signal
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from agent.client import (
    EXIT_PREEMPTED,
    Checkpoint,
    CheckpointError,
    CheckpointSchedule,
    CheckpointStore,
    Watcher,
)

STATE_FILE = "state.json"
BATCH = 64
LEARNING_RATE = 0.05
MOMENTUM = 0.9


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--checkpoint-dir", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=1000, help="train until this many steps are done")
    parser.add_argument("--interval-s", type=float, default=600.0, help="periodic interval without advice")
    parser.add_argument("--keep", type=int, default=3, help="checkpoints to keep (0: all)")
    parser.add_argument("--every", type=int, default=1, help="look for a notice every this many steps")
    parser.add_argument(
        "--step-time", type=float, default=0.0, help="extra seconds per step (simulated work)"
    )
    parser.add_argument(
        "--socket", default=None, help="the agent's socket (default: PREEMPTD_SOCKET or auto)"
    )
    parser.add_argument("--no-signals", action="store_true", help="do not treat SIGTERM/SIGUSR1 as a notice")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--width", type=int, default=16, help="input features of the regression")
    return parser.parse_args(argv)


def emit(event: str, **fields: Any) -> None:
    # One write() of the whole line, as in the PyTorch example: a reader never sees half a line.
    line = (json.dumps({"event": event, **fields}) + "\n").encode()
    while line:
        line = line[os.write(sys.stdout.fileno(), line) :]


def fresh_state(width: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    return {
        "weights": [rng.gauss(0.0, 0.1) for _ in range(width)],
        "bias": 0.0,
        "velocity": [0.0] * width,
        "velocity_bias": 0.0,
    }


def batch(seed: int, step: int, width: int) -> list[tuple[list[float], float]]:
    """The step's samples: x ~ N(0, 1), y = a fixed linear function of x plus noise (sd 0.1), so the loss falls
    towards 0.01 as the weights approach it."""
    rng = random.Random(seed * 1_000_003 + step)
    truth = [(i % 5 - 2) / 4 for i in range(width)]
    samples = []
    for _ in range(BATCH):
        x = [rng.gauss(0.0, 1.0) for _ in range(width)]
        samples.append((x, sum(t * xi for t, xi in zip(truth, x, strict=True)) + 0.5 + rng.gauss(0.0, 0.1)))
    return samples


def train_step(state: dict[str, Any], samples: list[tuple[list[float], float]]) -> float:
    """One SGD-with-momentum step on the mean squared error; returns the loss before the step."""
    weights, bias = state["weights"], state["bias"]
    grad = [0.0] * len(weights)
    grad_bias = loss = 0.0
    for x, y in samples:
        error = sum(w * xi for w, xi in zip(weights, x, strict=True)) + bias - y
        loss += error * error
        for i, xi in enumerate(x):
            grad[i] += error * xi
        grad_bias += error
    scale = 2.0 / len(samples)
    state["velocity"] = [MOMENTUM * v + scale * g for v, g in zip(state["velocity"], grad, strict=True)]
    state["velocity_bias"] = MOMENTUM * state["velocity_bias"] + scale * grad_bias
    state["weights"] = [w - LEARNING_RATE * v for w, v in zip(weights, state["velocity"], strict=True)]
    state["bias"] = bias - LEARNING_RATE * state["velocity_bias"]
    return loss / len(samples)


def digest(state: dict[str, Any]) -> str:
    """A fingerprint of the weights and momentum, to compare runs bit for bit (JSON keeps every float exact)."""
    return hashlib.sha256(json.dumps(state, sort_keys=True).encode()).hexdigest()


def state_writer(state: dict[str, Any]) -> Any:
    """A store writer: the state as one JSON file (the store fsyncs it, sums it and commits the step)."""
    data = json.dumps(state, sort_keys=True).encode()

    def write(directory: Path) -> None:
        (directory / STATE_FILE).write_bytes(data)

    return write


def load_state(width: int) -> Any:
    """A store loader for :meth:`CheckpointStore.load_latest`: a step it cannot read is skipped for the one
    before; a state of another width does not fit, and no older step would either."""

    def load(checkpoint: Checkpoint) -> dict[str, Any]:
        path = checkpoint.file(STATE_FILE)
        try:
            state = json.loads(path.read_bytes())
            shapes = (len(state["weights"]), len(state["velocity"]), float(state["bias"]))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{path}: cannot load it: {exc}", reason="unreadable") from exc
        if shapes[:2] != (width, width):
            raise CheckpointError(
                f"{path}: {shapes[0]} weights, the model has {width} (--width)", reason="mismatch"
            )
        return dict(state)

    return load


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    store = CheckpointStore(args.checkpoint_dir, keep=args.keep, socket_path=args.socket)
    signals = None if args.no_signals else (signal.SIGTERM, signal.SIGUSR1)
    watcher = Watcher(args.socket, signals=signals).start()
    schedule = CheckpointSchedule(args.interval_s, args.socket)

    start = 0
    found = store.load_latest(load_state(args.width))  # the newest step that verifies and loads
    if found is not None:
        resumed, state = found
        start = resumed.step
        # A notice still active when we come back (a drill, or a rerun on the same host) already has its
        # emergency checkpoint: it does not stop this run again.
        watcher.mark_handled([resumed.notice_id])
        emit("resumed", rank=0, step=resumed.step, next_step=start, digest=digest(state))
    else:
        state = fresh_state(args.width, args.seed)
        emit("fresh", rank=0)

    status = 0
    was_connected = False
    try:
        for step in range(start, args.steps):
            loss = train_step(state, batch(args.seed, step, args.width))
            if args.step_time:
                time.sleep(args.step_time)
            if watcher.connected != was_connected:
                was_connected = watcher.connected
                emit("agent_connected" if was_connected else "agent_disconnected", rank=0, step=step + 1)

            if (step + 1) % args.every:
                continue
            trigger = watcher.trigger  # a notice or a signal, not yet acknowledged
            emergency = trigger is not None
            if not (emergency or schedule.due()):
                continue
            notice_id = trigger.notice_id if trigger is not None else None
            known = (trigger.deadline if trigger is not None else None, watcher.deadline)
            deadline = min((d for d in known if d is not None), default=None)
            try:
                checkpoint = store.save(
                    step + 1,
                    state_writer(state),
                    emergency=emergency,
                    notice_id=notice_id,
                    metadata={"loss": loss},
                )
            except CheckpointError as exc:
                # A failed emergency save (a full disk) hands the notice to the newest earlier step, which the
                # store recorded for `preemptd exec`: exit 75 all the same, so the job is requeued from there.
                if not emergency or exc.fallback is None:
                    raise
                emit("preempted", rank=0, step=exc.fallback.step, notice_id=notice_id,
                     failed_step=step + 1, error=str(exc)[:1000])  # fmt: skip
                status = EXIT_PREEMPTED
                break
            if emergency:
                watcher.acknowledge()
            schedule.mark()
            now = datetime.now(timezone.utc)
            left = None if deadline is None else max(0.0, (deadline - now).total_seconds())
            emit(
                "checkpoint",
                rank=0,
                step=checkpoint.step,
                emergency=emergency,
                seconds=round(checkpoint.duration_s or 0.0, 4),
                bytes=checkpoint.bytes,
                time_left=left,
                before_deadline=deadline is None or now < deadline,
                digest=digest(state),
                interval_s=schedule.interval_s,
                advised=schedule.advised,
                loss=round(loss, 6),
            )
            if emergency:
                emit("preempted", rank=0, step=checkpoint.step, notice_id=notice_id)
                status = EXIT_PREEMPTED
                break
        else:
            emit("done", rank=0, step=args.steps, digest=digest(state))
    finally:
        store.close(timeout=5.0)  # deferred checksums of an emergency save, queued reports
        watcher.stop()
    return status


if __name__ == "__main__":
    sys.exit(main())
