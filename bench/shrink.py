#!/usr/bin/env python3
"""Shrink benchmark (issue 37): the survivors' halt after a notice on one of three hosts — from the drill to the
first completed step at world size 2 — when the job shrinks in place (``torchrun --nnodes 2:3``, c10d
rendezvous, :mod:`agent.client.elastic`), against stopping and relaunching the two other hosts at once (an
ideal scheduler) from the evacuated step in the peers' RAM and from the durable disk.

    .venv/bin/python bench/shrink.py [--rounds 1] [--step-time 0.02]

Simulated hosts on one machine, as the tests do it: one real agent per host (own socket, state and RAM tier),
one ``preemptd exec -- torchrun`` of examples/sharded_training.py per host over loopback (gloo, CPU, the
example's 1.85 MB state). Times are when each JSON line of progress reached this process. The drill goes to a
host whose torchrun does not serve the c10d store (a notice there stops the job: see docs/elastic.md). Prints
one JSON object (per mode: the halt and its parts, medians over the rounds, the machine); figures go to
bench/RESULTS.md, nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from evacuate import free_port, machine, simulated_hosts  # noqa: E402

EXAMPLE = REPO / "examples" / "sharded_training.py"
JOB = "bench-shrink"


class Run:
    """One host's ``preemptd exec -- torchrun …``: its progress lines with their arrival times."""

    def __init__(self, command: list[str], env: dict[str, str], log: Path) -> None:
        self.log = log.with_name("events.log").open("ab", buffering=0)
        with log.open("ab") as err:
            self.proc = subprocess.Popen(command, env=env, cwd=str(REPO), stdout=subprocess.PIPE, stderr=err)
        self.events: list[tuple[float, dict[str, Any]]] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.log.write(line)
            if line.startswith(b"{"):
                with self._lock:
                    self.events.append((time.monotonic(), json.loads(line)))

    def first(self, event: str, since: float = 0.0, **match: Any) -> float | None:
        with self._lock:
            for at, doc in self.events:
                if at >= since and doc["event"] == event and all(doc.get(k) == v for k, v in match.items()):
                    return at
        return None

    def wait(self, event: str, since: float = 0.0, timeout: float = 300.0, **match: Any) -> float:
        deadline = time.monotonic() + timeout
        while (at := self.first(event, since, **match)) is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {event} {match} within {timeout} s")
            time.sleep(0.005)
        return at

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()  # exec's keeper takes the whole tree with it
        self.proc.wait()


def start(sock: Path, ckpt: Path, launcher: list[str], tier: str, step_time: float, job: str) -> Run:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREEMPTD_", "TORCHELASTIC_"))}
    env.update(
        {"PYTHONPATH": str(REPO), "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "PREEMPTD_JOB_ID": job}
    )
    command = [
        sys.executable,
        "-m",
        "agent",
        "exec",
        "--",
        sys.executable,
        "-m",
        "torch.distributed.run",
        *launcher,
        "--nproc-per-node",
        "1",
        str(EXAMPLE),
        "--checkpoint-dir",
        str(ckpt),
        "--socket",
        str(sock),
        "--tier",
        tier,
        "--steps",
        "1000000",
        "--step-time",
        str(step_time),
        "--log-every",
        "1",
    ]
    return Run(command, env, sock.with_name("run.log"))


def store_host(runs: list[Run], port: int) -> int:
    import psutil

    for index, run in enumerate(runs):
        for proc in psutil.Process(run.proc.pid).children(recursive=True):
            try:
                if any(
                    c.status == psutil.CONN_LISTEN and c.laddr.port == port
                    for c in proc.net_connections("tcp")
                ):
                    return index
            except psutil.Error:
                continue
    raise RuntimeError(f"no torchrun listens on {port}")


def drill(sock: Path, *args: str) -> tuple[float, str]:
    """Inject a drill (or, with ``--clear ID``, clear one); when it was asked for and its notice id."""
    at = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "agent", "drill", "--socket", str(sock), "--json", *(args or ("--in", "60s"))],
        check=True,
        stdout=subprocess.PIPE,
        cwd=str(REPO),
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    if args:  # cleared
        return at, ""
    return at, str(json.loads(done.stdout)["id"])


def static(port: int, nodes: int, rank: int) -> list[str]:
    return [
        "--nnodes",
        str(nodes),
        "--node-rank",
        str(rank),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(port),
    ]


def grow(runs: list[Run], stay: list[int], newcomer: Run) -> dict[str, float]:
    """From a host joining the shrunk job (its exec started) to the first completed step at world size 3 on
    every host: torchrun stops the staying workers (they save into their hosts' RAM), the round of 3 forms,
    every worker loads (the newcomer's shards from the peers' RAM)."""
    joined = time.monotonic()
    runs.append(newcomer)  # stopped with the others
    grown = [runs[i] for i in stay] + [newcomer]
    saved = max(runs[i].wait("checkpoint", joined, emergency=True) for i in stay)
    loaded = max(run.wait("resumed", joined, world_size=3) for run in grown)
    stepped = max(run.wait("step", joined, world_size=3) for run in grown)
    return {
        "grow_s": stepped - joined,
        "join_to_saved_s": saved - joined,
        "saved_to_loaded_s": loaded - saved,
        "grow_loaded_to_step_s": stepped - loaded,
    }


def one_round(socks: list[Path], base: Path, mode: str, step_time: float) -> dict[str, float]:
    ckpt = base / f"ckpt-{mode}-{time.monotonic_ns()}"
    job = f"{JOB}-{ckpt.name}"  # a job of its own in the RAM tiers
    port = free_port()
    tier = "durable" if mode == "relaunch_disk" else "peer"
    if mode == "shrink":
        launcher = [
            "--nnodes",
            "2:3",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"127.0.0.1:{port}",
            "--rdzv-id",
            f"{JOB}-{port}",
            "--max-restarts",
            "3",
            "--monitor-interval",
            "0.1",
        ]
        runs = [start(sock, ckpt, launcher, tier, step_time, job) for sock in socks]
    else:
        runs = [start(sock, ckpt, static(port, 3, i), tier, step_time, job) for i, sock in enumerate(socks)]
    relaunched: list[Run] = []
    notice = ""
    try:
        for run in runs:  # every host trains at the full size (a late joiner restarts the first round)
            run.wait("step", step=20, world_size=3)
        leaving = 1 if mode != "shrink" else next(i for i in range(3) if i != store_host(runs, port))
        stay = [i for i in range(3) if i != leaving]
        at, notice = drill(socks[leaving])
        flushed = max(runs[i].wait("checkpoint", at, emergency=True) for i in range(3))
        if mode == "shrink":
            reformed = max(runs[i].wait("reform", at) for i in stay)
            resumed = max(runs[i].wait("resumed", at) for i in stay)
            stepped = max(runs[i].wait("step", at, world_size=2) for i in stay)
            figures = {
                "halt_s": stepped - at,
                "notice_to_flush_s": flushed - at,
                "flush_to_reform_s": reformed - flushed,
                "reform_to_loaded_s": resumed - reformed,
                "loaded_to_step_s": stepped - resumed,
            }
            # Grow back: the notified host joins again (its agent, its drill cleared, a new exec of the launch).
            drill(socks[leaving], "--clear", notice)
            notice = ""
            newcomer = start(socks[leaving], ckpt, launcher, tier, step_time, job)
            return {**figures, **grow(runs, stay, newcomer)}
        for run in runs:
            run.proc.wait(timeout=120)
        exited = time.monotonic()
        port2 = free_port()
        relaunched = [
            start(socks[i], ckpt, static(port2, 2, n), tier, step_time, job) for n, i in enumerate(stay)
        ]
        resumed = max(run.wait("resumed", at) for run in relaunched)
        stepped = max(run.wait("step", at, world_size=2) for run in relaunched)
        return {
            "halt_s": stepped - at,
            "notice_to_flush_s": flushed - at,
            "flush_to_exit_s": exited - flushed,
            "exit_to_loaded_s": resumed - exited,
            "loaded_to_step_s": stepped - resumed,
        }
    finally:
        for run in runs + relaunched:
            run.stop()
        if notice:  # the next round starts without it
            drill(socks[leaving], "--clear", notice)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--step-time", type=float, default=0.02)
    args = parser.parse_args()
    with simulated_hosts(3, "pd-shrink-") as (base, socks):
        results: dict[str, list[dict[str, float]]] = {"shrink": [], "relaunch_ram": [], "relaunch_disk": []}
        for _ in range(args.rounds):
            for mode, rounds in results.items():
                rounds.append(one_round(socks, base, mode, args.step_time))
        medians = {
            mode: {k: round(statistics.median(r[k] for r in rounds), 3) for k in rounds[0]}
            for mode, rounds in results.items()
        }
        ratios = {
            f"shrink/{m}": round(medians["shrink"]["halt_s"] / medians[m]["halt_s"], 3)
            for m in ("relaunch_ram", "relaunch_disk")
        }
        print(
            json.dumps(
                {
                    "machine": machine(),
                    "rounds": args.rounds,
                    "medians": medians,
                    "ratios": ratios,
                    "load_average": os.getloadavg(),
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
