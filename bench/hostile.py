"""Hostile clients: a real agent under 2000 idle connections, 200 slowloris clients and 200 event streams
that never read, then a notice. Records what a well-behaved client still gets (drill delivery latency to a
good subscriber, ``/v1/status`` latency) and what the agent holds (RSS, descriptors, connections), before the
hostile clients connect, while they are connected, and after the agent's idle timeout has run.

    python bench/hostile.py                     # the sizes of the issue; ~1 minute
    python bench/hostile.py --idle 500 --slowloris 50 --never-reading 50 --json out.json

The agent is ``python -m agent run`` as deployed (defaults, JSON logs to a file) in its own process; this
process is every client, on one asyncio loop. A slowloris client sends its request head one byte a second
and never finishes it; a never-reading client sends ``GET /v1/events`` and never reads a byte. A round of the
good client: ``t0`` just before ``POST /v1/drills`` is written, ``t1`` when the notice frame has arrived on its
event stream; the drill is then cleared. ``/v1/status`` is timed from connect to the last byte of the answer,
one request per connection like ``preemptd status``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parent.parent
DRILLS = 20
STATUS_REQUESTS = 100
STATUS = b"GET /v1/status HTTP/1.1\r\nHost: agent\r\nConnection: close\r\n\r\n"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


async def http(path: Path, request: bytes) -> bytes:
    reader, writer = await asyncio.open_unix_connection(str(path))
    writer.write(request)
    answer = await reader.read()
    writer.close()
    return answer


async def status_latencies(path: Path, count: int) -> list[float]:
    times = []
    for _ in range(count):
        t0 = time.perf_counter()
        answer = await http(path, STATUS)
        times.append((time.perf_counter() - t0) * 1000)
        if not answer.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(f"status answered {answer[:80]!r}")
    return times


class GoodSubscriber:
    """An event stream read as it arrives; ``wait_for(b'event: notice')`` returns when a frame lands."""

    def __init__(self) -> None:
        self.buffer = b""
        self.arrived = asyncio.Event()
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.task: asyncio.Task[None] | None = None

    async def connect(self, path: Path) -> None:
        self.reader, self.writer = await asyncio.open_unix_connection(str(path))
        self.writer.write(b"GET /v1/events HTTP/1.1\r\nHost: agent\r\n\r\n")
        self.task = asyncio.ensure_future(self._read())
        await self.wait_for(b"event: snapshot")

    async def _read(self) -> None:
        assert self.reader is not None
        while chunk := await self.reader.read(65536):
            self.buffer += chunk
            self.arrived.set()

    async def wait_for(self, marker: bytes, timeout: float = 30.0) -> None:
        end = time.monotonic() + timeout
        while marker not in self.buffer:
            self.arrived.clear()
            await asyncio.wait_for(self.arrived.wait(), max(0.001, end - time.monotonic()))
        self.buffer = self.buffer[self.buffer.index(marker) + len(marker) :]

    async def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task
        if self.writer is not None:
            self.writer.close()


async def drill_latencies(path: Path, sub: GoodSubscriber, rounds: int) -> list[float]:
    times = []
    body = b'{"kind": "termination", "in_s": 600}'
    for _ in range(rounds):
        t0 = time.perf_counter()
        answer_task = asyncio.ensure_future(
            http(
                path,
                b"POST /v1/drills HTTP/1.1\r\nHost: agent\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s"
                % (len(body), body),
            )
        )
        await sub.wait_for(b"event: notice")
        times.append((time.perf_counter() - t0) * 1000)
        answer = await answer_task
        notice_id = json.loads(answer.split(b"\r\n\r\n", 1)[1])["notice"]["id"]
        await http(
            path,
            f"DELETE /v1/drills/{notice_id} HTTP/1.1\r\nHost: agent\r\nConnection: close\r\n\r\n".encode(),
        )
        await sub.wait_for(b"event: cleared")
        await asyncio.sleep(0.02)
    return times


def holdings(pid: int) -> dict[str, Any]:
    proc = psutil.Process(pid)
    return {"rss_mib": round(proc.memory_info().rss / 2**20, 1), "fds": proc.num_fds()}


async def measure(path: Path, pid: int, sub: GoodSubscriber, label: str) -> dict[str, Any]:
    held = holdings(pid)
    drills = await drill_latencies(path, sub, DRILLS)
    status = await status_latencies(path, STATUS_REQUESTS)
    doc = json.loads((await http(path, STATUS)).split(b"\r\n\r\n", 1)[1])
    row = {
        "phase": label,
        "drill_p50_ms": statistics.median(drills),
        "drill_max_ms": max(drills),
        "status_p50_ms": statistics.median(status),
        "status_p99_ms": percentile(status, 99),
        **held,
        "connections": doc.get("connections", {}).get("open"),
        "subscribers": doc["subscribers"]["connected"],
    }
    print(
        f"  {label:<7} drill p50 {row['drill_p50_ms']:7.2f} max {row['drill_max_ms']:7.2f} ms | status p50"
        f" {row['status_p50_ms']:6.2f} p99 {row['status_p99_ms']:6.2f} ms | RSS {row['rss_mib']:6.1f} MiB |"
        f" fds {row['fds']:5d} | connections {row['connections'] or '-':>5} | subscribers {row['subscribers']}",
        flush=True,
    )
    return row


class Hostile:
    """The hostile clients: connections held open, slow heads, streams never read."""

    def __init__(self) -> None:
        self.idle: list[socket.socket] = []
        self.slow: list[socket.socket] = []
        self.deaf: list[socket.socket] = []
        self.task: asyncio.Task[None] | None = None

    def connect(self, path: Path, idle: int, slowloris: int, never_reading: int) -> None:
        def one() -> socket.socket:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(str(path))
            sock.setblocking(False)
            return sock

        self.idle = [one() for _ in range(idle)]
        self.slow = [one() for _ in range(slowloris)]
        self.deaf = [one() for _ in range(never_reading)]
        for sock in self.deaf:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.send(b"GET /v1/events HTTP/1.1\r\nHost: agent\r\n\r\n")
        self.task = asyncio.ensure_future(self._trickle())

    async def _trickle(self) -> None:
        head = b"GET /v1/status HTTP/1.1\r\nHost: agent\r\nX-Slow: " + b"a" * 100_000
        for byte in head:
            for sock in self.slow:
                with contextlib.suppress(OSError):
                    sock.send(bytes([byte]))
            await asyncio.sleep(1.0)

    def closed_by_agent(self) -> dict[str, int]:
        """How many of each kind the agent has closed (EOF or reset on a read)."""

        def closed(sock: socket.socket) -> bool:
            try:
                while data := sock.recv(65536, socket.MSG_DONTWAIT | socket.MSG_PEEK):
                    sock.recv(len(data))  # drain what was answered; EOF shows next
                return True
            except BlockingIOError:
                return False
            except OSError:
                return True

        return {
            "idle": sum(closed(s) for s in self.idle),
            "slowloris": sum(closed(s) for s in self.slow),
        }

    async def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task
        for sock in (*self.idle, *self.slow, *self.deaf):
            sock.close()


async def run(args: argparse.Namespace) -> dict[str, Any]:
    base = Path(tempfile.mkdtemp(prefix="pd-hostile-", dir="/tmp"))
    path = base / "a.sock"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREEMPTD_", "NOTIFY_", "LISTEN_"))}
    env["PYTHONPATH"] = str(args.agent_tree)
    notify_path = base / "notify.sock"
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(notify_path))
    notify.settimeout(30)
    argv = [
        sys.executable, "-m", "agent", "run", "--socket", str(path), "--state-dir", str(base / "state"),
        "--cloud", "none", "--log-format", "json", *args.agent_args,
    ]  # fmt: skip
    with (base / "agent.log").open("wb") as log:
        agent = subprocess.Popen(  # noqa: ASYNC220 - once, before any client
            argv,
            env={**env, "NOTIFY_SOCKET": str(notify_path)},
            stdout=log,
            stderr=log,
            cwd=args.agent_tree,  # `python -m` puts the working directory first on the path
        )
    try:
        while b"READY=1" not in notify.recv(4096).split(b"\n"):
            pass
        notify.close()
        sub = GoodSubscriber()
        await sub.connect(path)
        rows = [await measure(path, agent.pid, sub, "before")]
        hostile = Hostile()
        hostile.connect(path, args.idle, args.slowloris, args.never_reading)
        await asyncio.sleep(1.0)  # the agent has accepted them and the never-reading streams are subscribed
        rows.append(await measure(path, agent.pid, sub, "during"))
        doc = json.loads((await http(path, STATUS)).split(b"\r\n\r\n", 1)[1])
        # An agent from before the idle timeout existed: wait as long as the default would.
        idle_timeout = float(doc.get("connections", {}).get("idle_timeout_s", 15.0))
        await asyncio.sleep(idle_timeout + 2.0)
        closed = hostile.closed_by_agent()
        print(f"  after the idle timeout ({idle_timeout:g} s) the agent had closed: {closed}", flush=True)
        rows.append(await measure(path, agent.pid, sub, "after"))
        await hostile.close()
        await sub.close()
        with (base / "agent.log").open("rb") as handle:
            log_bytes = sum(len(line) for line in handle)
        return {
            "rows": rows,
            "closed_by_agent": closed,
            "idle_timeout_s": idle_timeout,
            "log_bytes": log_bytes,
        }
    finally:
        agent.terminate()
        agent.wait(30)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--idle", type=int, default=2000, help="connections that never send (default 2000)")
    parser.add_argument("--slowloris", type=int, default=200, help="slow request heads (default 200)")
    parser.add_argument("--never-reading", type=int, default=200, help="streams never read (default 200)")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument(
        "--agent-tree",
        type=Path,
        default=REPO,
        help="run the agent package from this source tree (to compare commits: git worktree add DIR REV)",
    )
    parser.add_argument("agent_args", nargs="*", help="extra `preemptd run` arguments (after --)")
    args = parser.parse_args()
    needed = args.idle + args.slowloris + args.never_reading + 512
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < needed:
        if hard != resource.RLIM_INFINITY and hard < needed:
            sys.exit(f"RLIMIT_NOFILE hard limit {hard} is below the {needed} descriptors needed")
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))
    print(
        f"hostile-client benchmark: CPython {platform.python_version()}, {os.cpu_count()} CPUs, "
        f"{platform.system()} {platform.release()}; {args.idle} idle, {args.slowloris} slowloris, "
        f"{args.never_reading} never-reading clients",
        flush=True,
    )
    result = asyncio.run(run(args))
    print(
        "\n| phase | drill p50 ms | drill max ms | status p50 ms | status p99 ms | RSS MiB | fds | connections |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for row in result["rows"]:
        print(
            f"| {row['phase']} | {row['drill_p50_ms']:.2f} | {row['drill_max_ms']:.2f} | {row['status_p50_ms']:.2f} |"
            f" {row['status_p99_ms']:.2f} | {row['rss_mib']:.1f} | {row['fds']} | {row['connections'] or '-'} |"
        )
    print(f"\nagent log: {result['log_bytes']} bytes")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
