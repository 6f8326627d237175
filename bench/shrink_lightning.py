#!/usr/bin/env python3
"""Lightning shrink benchmark (issue 37): the survivors' halt after a notice on one of three hosts of a Lightning
DDP job (tests/lightning_elastic_job.py, ``PreemptdCallback(tier="peer")``) under ``torchrun --nnodes 2:3``,
from the drill to the first completed step at world size 2 on both other hosts. Lightning owns its process
group, so the staying workers restart under torchrun (``Elastic.restart_workers``) and most of the halt is
torchrun's rendezvous: the baseline is torchrun's default waits (a departed node's heartbeat expires after
5 s x 3, a round of MIN nodes waits 30 s of last call), against the short ones docs/elastic.md names.

    .venv/bin/python bench/shrink_lightning.py [--rounds 2] [--step-time 0.05]

Simulated hosts on one machine as in bench/shrink.py (one real agent per host, one ``preemptd exec -- torchrun``
per host over loopback, gloo, CPU). Prints one JSON object: each mode's halts and median, the ratio of the
short waits to the defaults, the machine; figures go to bench/RESULTS.md, nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from evacuate import free_port, machine, simulated_hosts  # noqa: E402
from shrink import Run, drill, store_host  # noqa: E402

JOB_SCRIPT = REPO / "tests" / "lightning_elastic_job.py"
SHORT_WAITS = "last_call_timeout=3,keep_alive_interval=1,keep_alive_max_attempt=5"


def start(sock: Path, ckpt: Path, launcher: list[str], step_time: float, job: str) -> Run:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREEMPTD_", "TORCHELASTIC_"))}
    env.update(
        {"PYTHONPATH": str(REPO), "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "PREEMPTD_JOB_ID": job}
    )
    command = [sys.executable, "-m", "agent", "exec", "--", sys.executable, "-m", "torch.distributed.run"]
    command += [*launcher, "--nproc-per-node", "1", str(JOB_SCRIPT), "--checkpoint-dir", str(ckpt)]
    command += ["--socket", str(sock), "--tier", "peer", "--step-time", str(step_time), "--log-every", "1"]
    return Run(command, env, sock.with_name("run.log"))


def one_round(socks: list[Path], base: Path, short: bool, step_time: float) -> float:
    port = free_port()
    job = f"bench-lightning-{time.time_ns()}"
    launcher = ["--nnodes", "2:3", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}"]
    launcher += ["--rdzv-id", job, "--max-restarts", "3", "--monitor-interval", "0.1"]
    if short:
        launcher += ["--rdzv-conf", SHORT_WAITS]
    runs = [start(sock, base / job, launcher, step_time, job) for sock in socks]
    try:
        for run in runs:
            run.wait("step", world_size=3)
        leaving = next(i for i in range(3) if i != store_host(runs, port))
        at, _ = drill(socks[leaving])
        return (
            max(run.wait("step", since=at, world_size=2) for i, run in enumerate(runs) if i != leaving) - at
        )
    finally:
        for run in runs:
            run.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--step-time", type=float, default=0.05)
    args = parser.parse_args()
    halts: dict[str, list[float]] = {"default_waits": [], "short_waits": []}
    for _ in range(args.rounds):
        for short in (True, False):  # a fresh set of hosts each time: no drill left active
            with simulated_hosts(3, "pd-bench-lightning-") as (base, socks):
                halts["short_waits" if short else "default_waits"].append(
                    one_round(socks, base, short, args.step_time)
                )
    medians = {mode: statistics.median(found) for mode, found in halts.items()}
    doc = {
        "halt_s": {mode: [round(h, 2) for h in found] for mode, found in halts.items()},
        "median_s": {mode: round(m, 2) for mode, m in medians.items()},
        "short_over_default": round(medians["short_waits"] / medians["default_waits"], 3),
        "machine": machine(),
    }
    print(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
