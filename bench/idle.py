"""Idle cost: the agent watching the AWS simulator with nobody subscribed, against a bare asyncio + aiohttp
loop making one GET a second to the same simulator, side by side over the same period.

Three processes: the project's AWS simulator (``python -m agent.simulate aws`` on 127.0.0.1), the agent as
deployed (``python -m agent run --cloud aws``, defaults otherwise, JSON logs to a file), and the baseline
(this file with ``--baseline URL``: one IMDSv2 token, then ``GET spot/instance-action`` once a second on one
keep-alive session, fixed-rate). After a warm-up (start-up, the identity reads, the first host poll), each
process's CPU time is read from its Linux per-process CPU clock (``clock_gettime`` on the clock id of the
pid: nanoseconds, every thread, unlike the 10 ms ticks of ``/proc/PID/stat``) at the start and end of the
measured period; the ratio is agent ÷ baseline. RSS (``VmRSS``) of the agent is sampled every 10 s over the
whole run, and its trend over the second half says whether it levels off.

    .venv/bin/python bench/idle.py                      # 10 s warm-up + 120 s measured: about 2.5 minutes
    .venv/bin/python bench/idle.py --seconds 600        # longer, for the RSS trend
    .venv/bin/python bench/idle.py --set aws.lifecycle_interval_s=1   # settings for the agent
    # more agents measured at the same time as the first (an A/B on the same machine weather): settings,
    # and tree=DIR to run one from another checkout (`git archive COMMIT agent | tar -x -C DIR`)
    .venv/bin/python bench/idle.py --variant no-host:host.enabled=false --variant before:tree=/tmp/before

Prints a table row per agent (markdown, or ``--json``), the requests the simulator served, and the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
SPOT = "/latest/meta-data/spot/instance-action"
RSS_EVERY_S = 10.0


# --- the baseline: what a minimal poller costs -----------------------------------------------------------


async def baseline(url: str) -> None:
    """One GET a second to the spot path with an IMDSv2 token, as small as a poller can be."""
    import aiohttp

    async with aiohttp.ClientSession() as session:
        async with session.put(
            url + "/latest/api/token", headers={"X-aws-ec2-metadata-token-ttl-seconds": "21600"}
        ) as response:
            token = await response.text()
        headers = {"X-aws-ec2-metadata-token": token}
        next_tick = time.monotonic()
        while True:
            async with session.get(url + SPOT, headers=headers) as response:
                await response.read()
            next_tick += 1.0
            await asyncio.sleep(max(0.0, next_tick - time.monotonic()))


# --- measuring another process ---------------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    """The process's CPU time (all its threads, user + system) from its per-process CPU clock:
    ``MAKE_PROCESS_CPUCLOCK(pid, CPUCLOCK_SCHED)`` in the kernel's terms, nanosecond resolution."""
    return time.clock_gettime(((~pid) << 3) | 2)


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as handle:
        for line in handle:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for {pid}")


def sim_requests(url: str) -> int:
    with urllib.request.urlopen(url + "/_sim/state", timeout=5) as response:
        return int(json.loads(response.read())["requests"])


def agent_status(socket_path: Path) -> dict[str, Any]:
    out = subprocess.run(
        ["curl", "-s", "-m", "5", "--unix-socket", str(socket_path), "http://agent/v1/status"],
        capture_output=True,
        check=False,
    )
    return json.loads(out.stdout) if out.returncode == 0 and out.stdout else {}


def slope_kib_per_min(samples: list[tuple[float, int]]) -> float:
    """Least-squares slope of RSS over time, KiB a minute."""
    if len(samples) < 2:
        return 0.0
    ts = [t for t, _ in samples]
    rs = [r for _, r in samples]
    mt, mr = statistics.fmean(ts), statistics.fmean(rs)
    var = sum((t - mt) ** 2 for t in ts)
    return 60.0 * sum((t - mt) * (r - mr) for t, r in samples) / var if var else 0.0


def start_agent(base: Path, name: str, url: str, settings: list[str], tree: Path, env: dict[str, str]) -> Any:
    home = base / name
    home.mkdir()
    config = home / "config.toml"
    config.write_text("")  # the defaults, whatever /etc/preemptd holds on this machine
    argv = [
        sys.executable,
        "-m",
        "agent",
        "run",
        "--config",
        str(config),
        "--cloud",
        "aws",
        "--log-format",
        "json",
    ]
    argv += ["--socket", str(home / "a.sock"), "--state-dir", str(home / "state")]
    argv += [a for item in [f"aws.endpoint={url}", *settings] for a in ("--set", item)]
    with (home / "agent.log").open("wb") as log:
        return subprocess.Popen(
            argv,
            cwd=tree,
            env={**env, "PYTHONPATH": str(tree)},
            stdout=log,
            stderr=log,
        )


def aws_polls(base: Path, name: str) -> int | None:
    polls = agent_status(base / name / "a.sock").get("sources", {}).get("aws", {}).get("polls")
    return polls if isinstance(polls, int) else None


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    """One row per agent (the default one, then each ``--variant``), each against the baseline measured over
    the same period."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREEMPTD_", "NOTIFY_SOCKET", "LISTEN_"))}
    variants: dict[str, list[str]] = {"agent": list(args.set)}
    trees = {"agent": args.agent_tree.resolve()}
    for spec in args.variant:
        name, _, settings = spec.partition(":")
        items = [item for item in settings.split(",") if item]
        trees[name] = Path(*[i[5:] for i in items if i.startswith("tree=")] or [args.agent_tree]).resolve()
        variants[name] = [*args.set, *(i for i in items if not i.startswith("tree="))]
    with tempfile.TemporaryDirectory(prefix="pd-idle-", dir="/tmp") as tmp:
        base = Path(tmp)
        sim = subprocess.Popen(
            [sys.executable, "-m", "agent.simulate", "aws"],
            cwd=REPO,
            env={**env, "PYTHONPATH": str(REPO)},
            stdout=subprocess.PIPE,
            text=True,
        )
        procs: list[subprocess.Popen[Any]] = [sim]
        try:
            assert sim.stdout is not None
            url = sim.stdout.readline().rsplit(" ", 1)[-1].strip()
            agents = {}
            for name, settings in variants.items():
                agents[name] = start_agent(base, name, url, settings, trees[name], env)
                procs.append(agents[name])
            bare = subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve()), "--baseline", url],
                env=env,
                stdout=subprocess.DEVNULL,
            )
            procs.append(bare)
            started = time.monotonic()
            pids = {name: proc.pid for name, proc in agents.items()}
            rss: dict[str, list[tuple[float, int]]] = {name: [] for name in agents}

            def sample_rss() -> None:
                for name, pid in pids.items():
                    rss[name].append((time.monotonic() - started, rss_kib(pid)))

            deadline = started + args.warmup
            while time.monotonic() < deadline:
                time.sleep(0.5)
                for proc in procs:
                    if proc.poll() is not None:
                        raise RuntimeError(f"{proc.args[:4]} exited with {proc.returncode}")
            sample_rss()
            polls0 = {name: aws_polls(base, name) for name in agents}
            t0 = time.monotonic()
            cpu0 = {name: cpu_seconds(pid) for name, pid in [*pids.items(), ("baseline", bare.pid)]}
            req0 = sim_requests(url)
            end = t0 + args.seconds
            next_sample = t0 + RSS_EVERY_S
            while (now := time.monotonic()) < end:
                time.sleep(max(0.0, min(next_sample, end) - now))
                if time.monotonic() >= next_sample:
                    sample_rss()
                    next_sample += RSS_EVERY_S
            cpu1 = {name: cpu_seconds(pid) for name, pid in [*pids.items(), ("baseline", bare.pid)]}
            elapsed = time.monotonic() - t0
            req1 = sim_requests(url)
            sample_rss()
            polls1 = {name: aws_polls(base, name) for name in agents}
            log_bytes = {name: (base / name / "agent.log").stat().st_size for name in agents}
        finally:
            for proc in reversed(procs):
                proc.terminate()
            for proc in procs:
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
    bare_cpu = cpu1["baseline"] - cpu0["baseline"]
    # Every request the simulator served in the period, less the baseline's one a second, shared out.
    requests_per_s = ((req1 - req0) - elapsed) / elapsed
    rows = []
    for name in agents:
        agent_cpu = cpu1[name] - cpu0[name]
        samples = rss[name]
        half = [s for s in samples if s[0] >= samples[-1][0] / 2]
        p0, p1 = polls0[name], polls1[name]
        rows.append(
            {
                "agent": name,
                "settings": variants[name],
                "seconds": round(elapsed, 1),
                "agent_cpu_pct": round(100 * agent_cpu / elapsed, 4),
                "baseline_cpu_pct": round(100 * bare_cpu / elapsed, 4),
                "ratio": round(agent_cpu / bare_cpu, 2) if bare_cpu else None,
                "simulator_requests_per_s": round(requests_per_s, 3),
                "agent_ticks_per_s": round((p1 - p0) / elapsed, 3)
                if p0 is not None and p1 is not None
                else None,
                "rss_start_kib": samples[0][1],
                "rss_end_kib": samples[-1][1],
                "rss_max_kib": max(r for _, r in samples),
                "rss_second_half_kib_per_min": round(slope_kib_per_min(half), 1),
                "rss_samples": len(samples),
                "log_bytes": log_bytes[name],
                "agent_tree": str(trees[name]),
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=120.0, help="the measured period (default 120)")
    parser.add_argument("--warmup", type=float, default=10.0, help="seconds before it starts (default 10)")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="passed to the agents"
    )
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME:KEY=VALUE[,KEY=VALUE]",
        help="another agent with these settings, measured at the same time (A/B on the same machine weather)",
    )
    parser.add_argument("--agent-tree", type=Path, default=REPO, help="run the agents from this source tree")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--baseline", metavar="URL", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.baseline:
        asyncio.run(baseline(args.baseline))
        return
    rows = measure(args)
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(
            "| agent | period | agent CPU | baseline CPU | ratio | RSS start → end (max) | RSS trend, 2nd half |"
        )
        print("|---|---|---|---|---|---|---|")
        for row in rows:
            print(
                f"| {row['agent']} {' '.join(row['settings'])} | {row['seconds']:g} s | {row['agent_cpu_pct']} % "
                f"| {row['baseline_cpu_pct']} % | {row['ratio']}x | {row['rss_start_kib'] / 1024:.1f} → "
                f"{row['rss_end_kib'] / 1024:.1f} ({row['rss_max_kib'] / 1024:.1f}) MiB "
                f"| {row['rss_second_half_kib_per_min']:+} KiB/min |"
            )
        print(f"\nGET/s the simulator served to the agents: {rows[0]['simulator_requests_per_s']}")
    print(
        f"\nPython {platform.python_version()} on {platform.platform()}, {len(os.sched_getaffinity(0))} CPUs,"
        f" load average {os.getloadavg()[0]:.1f}"
    )


if __name__ == "__main__":
    main()
