#!/usr/bin/env python3
"""Peer snapshot benchmark (issue 38): what background snapshots cost the training step, and what they save
when a host is lost without a notice.

    .venv/bin/python bench/snapshots.py [--rounds 3] [--steps 300] [--every 20] [--step-time 0.02]

Two simulated hosts on one machine, as the tests do it: one real agent per host (own socket, state and RAM
tier), one ``preemptd exec -- torchrun --nnodes 2`` of examples/sharded_training.py per host over loopback
(gloo, CPU, the example's 1.85 MB state). Each mode runs ``--steps`` steps; the step time is the median gap
between consecutive ``step`` lines (after the first 20 steps), and the overhead is its ratio to the run without
snapshots measured in the same round. Modes: no snapshots, one every ``--every`` steps (the interval under
test), one every step (the most the hazard can ask). Then the loss: host 1 is killed without a notice after
``--steps`` steps with snapshots every ``--every``, and host 0, relaunched alone, resumes from the newest
committed snapshot (host 1's shard is in host 0's RAM): the steps lost are the last step reached minus the step
resumed from, against every step for the same job with only durable checkpoints (the example's 600 s interval:
none taken yet). Prints one JSON object; figures go to bench/RESULTS.md, nothing is asserted.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from evacuate import free_port, machine, simulated_hosts  # noqa: E402
from shrink import EXAMPLE, Run, static  # noqa: E402

JOB = "bench-snapshots"


def start(sock: Path, ckpt: Path, port: int, nodes: int, rank: int, extra: list[str]) -> Run:
    """One host's exec of the example; the job's RAM tier id is the checkpoint directory's name, so that no
    run resumes from another's snapshots."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREEMPTD_", "TORCHELASTIC_"))}
    env.update(
        {
            "PYTHONPATH": str(REPO),
            "GLOO_SOCKET_IFNAME": "lo",
            "OMP_NUM_THREADS": "1",
            "PREEMPTD_JOB_ID": ckpt.name,
        }
    )
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *static(port, nodes, rank),
        "--nproc-per-node",
        "1",
    ]
    example = [str(EXAMPLE), "--checkpoint-dir", str(ckpt), "--socket", str(sock), "--tier", "peer"]
    command = [sys.executable, "-m", "agent", "exec", "--", *torchrun, *example, "--log-every", "1", *extra]
    return Run(command, env, sock.with_name("run.log"))


def step_times(run: Run, skip: int = 20) -> list[float]:
    """The gaps between consecutive ``step`` lines of ``run``, after the first ``skip`` steps."""
    times = [at for at, doc in run.events if doc["event"] == "step" and doc["step"] > skip]
    return [b - a for a, b in itertools.pairwise(times)]


def one_mode(socks: list[Path], base: Path, steps: int, step_time: float, every: int) -> dict[str, float]:
    """Both hosts train ``steps`` steps with a snapshot every ``every`` (0: none); the median step time."""
    ckpt = base / f"{JOB}-{time.monotonic_ns()}"
    port = free_port()
    extra = ["--steps", str(steps), "--step-time", str(step_time), "--snapshot-every", str(every)]
    runs = [start(sock, ckpt, port, len(socks), rank, extra) for rank, sock in enumerate(socks)]
    try:
        for run in runs:
            run.wait("done", timeout=600)
    finally:
        for run in runs:
            run.stop()
    gaps = [gap for run in runs for gap in step_times(run)]
    blocked = [doc["blocked_s"] for run in runs for _, doc in run.events if doc["event"] == "snapshot"]
    found = {"step_s": statistics.median(gaps), "snapshots": float(len(blocked) // len(runs))}
    if blocked:
        found["blocked_s"] = statistics.median(blocked)
    return found


def loss(socks: list[Path], base: Path, steps: int, step_time: float, every: int) -> dict[str, float]:
    """Train with snapshots every ``every`` steps, kill host 1's whole tree after ``steps`` steps (no notice),
    relaunch host 0 alone: the steps lost (last step reached minus the step resumed from)."""
    ckpt = base / f"{JOB}-{time.monotonic_ns()}"
    port = free_port()
    extra = ["--steps", "1000000", "--step-time", str(step_time), "--snapshot-every", str(every)]
    runs = [start(sock, ckpt, port, 2, rank, extra) for rank, sock in enumerate(socks)]
    try:
        runs[0].wait("step", step=steps, timeout=600)
        runs[1].stop()  # the host is gone: its rank, its exec, its torchrun
    finally:
        for run in runs:
            run.stop()
    reached = max(doc["step"] for run in runs for _, doc in run.events if doc["event"] == "step")
    again = start(socks[0], ckpt, free_port(), 1, 0, ["--steps", str(reached + 1)])
    try:
        again.wait("done", timeout=600)
    finally:
        again.stop()
    [resumed] = [doc for _, doc in again.events if doc["event"] == "resumed"]
    return {
        "reached": reached,
        "resumed_from": resumed["next_step"],
        "lost_steps": reached - resumed["next_step"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--every", type=int, default=20)
    parser.add_argument("--step-time", type=float, default=0.02)
    args = parser.parse_args()
    with simulated_hosts(2, "pd-snap-") as (base, socks):
        modes = {"none": 0, f"every_{args.every}": args.every, "every_1": 1}
        results: dict[str, list[dict[str, float]]] = {mode: [] for mode in modes}
        for _ in range(args.rounds):
            for mode, every in modes.items():
                results[mode].append(one_mode(socks, base, args.steps, args.step_time, every))
        medians = {
            mode: {k: round(statistics.median(r[k] for r in rounds), 4) for k in rounds[0]}
            for mode, rounds in results.items()
        }
        ratios = {
            f"{mode}/none": round(
                statistics.median(
                    r["step_s"] / n["step_s"] for r, n in zip(rounds, results["none"], strict=True)
                ),
                3,
            )
            for mode, rounds in results.items()
            if mode != "none"
        }
        lost: dict[str, Any] = loss(socks, base, args.steps, args.step_time, args.every)
        lost["durable_only_lost_steps"] = lost["reached"]  # no durable step since the start: all of them
        print(
            json.dumps(
                {
                    "machine": machine(),
                    "rounds": args.rounds,
                    "steps": args.steps,
                    "medians": medians,
                    "overhead": ratios,
                    "unannounced_loss": lost,
                    "load_average": os.getloadavg(),
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
