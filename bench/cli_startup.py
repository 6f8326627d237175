"""Start-up time of the ``preemptd`` client verbs: how long ``status``, ``watch``, ``drill`` and ``advise``
take to fail against a socket where no agent listens (the command's own start-up and imports, no waiting on
an agent), next to ``--help`` and a bare ``python -c pass`` measured in the same run, interleaved, so that
the machine's load falls on all of them alike.

    .venv/bin/python bench/cli_startup.py [--runs 15] [--json] [--before DIR]

Prints the median and the best wall time per command and its ratio to the bare interpreter. ``--before DIR``
also times the same commands (but watch, which waited forever for an agent before 0.1) from another
checkout, e.g. ``git worktree add /tmp/before c174ff2``, in the same interleaved runs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

COMMANDS: dict[str, list[str]] = {
    "python -c pass": ["-c", "pass"],
    "preemptd --help": ["-m", "agent", "--help"],
    "preemptd status": ["-m", "agent", "status"],
    "preemptd watch": ["-m", "agent", "watch"],
    "preemptd drill": ["-m", "agent", "drill", "--in", "1m"],
    "preemptd advise": ["-m", "agent", "advise"],
    "preemptd advise (offline)": ["-m", "agent", "advise", "--save-time", "4m", "--mtbp", "6h"],
}


def measure(runs: int, before: Path | None) -> dict[str, list[float]]:
    plan = [(name, args, REPO) for name, args in COMMANDS.items()]
    if before is not None:
        plan += [
            (f"before: {name}", args, before)
            for name, args in COMMANDS.items()
            if name.startswith("preemptd") and "watch" not in name
        ]
    times: dict[str, list[float]] = {name: [] for name, _, _ in plan}
    with tempfile.TemporaryDirectory(prefix="preemptd-bench-") as tmp:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PREEMPTD_")}
        env["PREEMPTD_SOCKET"] = str(Path(tmp) / "nobody.sock")
        for _ in range(runs):
            for name, args, repo in plan:
                started = time.perf_counter()
                subprocess.run(
                    [sys.executable, *args],
                    env={**env, "PYTHONPATH": str(repo)},
                    cwd=tmp,
                    capture_output=True,
                    timeout=60,
                    check=False,
                )
                times[name].append(time.perf_counter() - started)
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--before", type=Path, help="another checkout to time in the same runs")
    args = parser.parse_args()
    times = measure(args.runs, args.before)
    base = statistics.median(times["python -c pass"])
    rows = {
        name: {
            "median_s": round(statistics.median(values), 4),
            "best_s": round(min(values), 4),
            "ratio_to_python": round(statistics.median(values) / base, 1),
        }
        for name, values in times.items()
    }
    if args.json:
        print(json.dumps({"machine": machine(), "runs": args.runs, "commands": rows}, indent=2))
        return 0
    print(f"{machine()}, {args.runs} runs each, interleaved")
    print(f"{'command':<36} {'median':>8} {'best':>8} {'x python':>9}")
    for name, row in rows.items():
        print(f"{name:<36} {row['median_s']:>7.3f}s {row['best_s']:>7.3f}s {row['ratio_to_python']:>9.1f}")
    return 0


def machine() -> str:
    return f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, load {os.getloadavg()[0]:.1f}"


if __name__ == "__main__":
    sys.exit(main())
