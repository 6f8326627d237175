"""Fan-out latency: from a drill entering the agent to its arrival at N event-stream subscribers, next to a
raw asyncio Unix-socket broadcast of the same bytes to N connections, measured back to back as a pair.

    python bench/fanout.py                      # N = 100, 1000; 8 pairs; median and spread of the pairs
    python bench/fanout.py --sizes 1,10,100,1000 --pairs 4 --json out.json

One figure from one run says little on a shared machine (a single pair's p99 ratio moves by 2x from one run
to the next), so the benchmark runs ``--pairs`` pairs, each with fresh processes, and reports per N the
median of the pairs and their spread: min-max of each side's p99, and the interquartile range and min-max
of the pairs' p99 ratios (agent ÷ raw). The order alternates: odd pairs run the raw broadcast first (with
the previous pair's notice bytes, the same length give or take a digit), so a machine that slows down
during a pair does not always weigh on the same side.

Three processes, so that the agent never shares a core's event loop with the clients:

* the agent, ``python -m agent run`` as deployed (default sources, JSON logs to a file), on a temporary socket;
* the raw server (this file with ``--raw-server``): an asyncio Unix-socket server that, when its control
  connection sends a line, calls ``transport.write(payload)`` for each connected client — the floor for any
  asyncio broadcast;
* this process, the load generator: N subscribers on raw sockets read by one synchronous ``epoll`` loop (a
  few microseconds per socket, so that the time measured is the sender's), plus one control connection.

A round: ``t0`` is taken just before the control connection writes ``POST /v1/drills`` to the agent (or the
trigger line to the raw server); each subscriber takes ``t1`` when the notice frame is complete in its
receive buffer. Both are ``time.monotonic_ns()`` in this process (CLOCK_MONOTONIC is system-wide on Linux,
so stamps from other processes would compare too; here they need not). The agent's number therefore includes
reading and parsing the HTTP request, the admin check, the notice board, history and log records, encoding
and the hub; the raw one includes reading the trigger line. The payload of the raw broadcast is the exact
bytes the agent wrote to each subscriber for the notice (its HTTP chunk: size line, SSE frame, CRLF), so the
receive side does identical work in both. After each round the drill is cleared (DELETE) and every subscriber
waits for ``cleared``; rounds are 20 ms apart, since notices are rare and a busy agent is not what is
measured. Every subscriber must get every notice: a missing one fails the run.

``--sender-side`` adds a measurement of the sending side alone, in one process with nobody reading during the
round: from ``agent.drills.drill()`` until the frame is written to all N connections, next to the loop of N
``transport.write()`` calls. ``--agent-tree`` runs the agent from another source tree, to compare commits.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import resource
import select
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
ROUNDS = {1: 200, 10: 100, 100: 50, 1000: 20}
WARMUP = 3
PAUSE_S = 0.02
ROUND_TIMEOUT_S = 30.0


# ----- the raw broadcast server (a separate process) -----


class _RawClient(asyncio.Protocol):
    def __init__(self, clients: set[asyncio.Transport]) -> None:
        self.clients = clients
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.clients.add(transport)
        transport.write(b"+\n\n")  # connected: the load generator counts these frames

    def connection_lost(self, exc: Exception | None) -> None:
        if self.transport is not None:
            self.clients.discard(self.transport)


async def raw_server(path: str, control_path: str) -> None:
    clients: set[asyncio.Transport] = set()
    loop = asyncio.get_running_loop()
    payload = b""

    async def control(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal payload
        while True:
            line = await reader.readline()
            if not line:
                return
            if line.startswith(b"payload "):
                payload = await reader.readexactly(int(line.split()[1]))
                writer.write(b"ok\n")
            elif line == b"go\n":
                started = time.monotonic_ns()
                for transport in clients:
                    transport.write(payload)
                writer.write(b"ok %d\n" % (time.monotonic_ns() - started))
            elif line == b"count\n":
                writer.write(f"{len(clients)}\n".encode())

    server = await loop.create_unix_server(lambda: _RawClient(clients), path, backlog=4096)
    ctl = await asyncio.start_unix_server(control, control_path)
    print("ready", flush=True)
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    server.close()
    ctl.close()


# ----- the load generator -----


class Fanout:
    """N subscriber sockets served by one synchronous epoll loop.

    Deliberately not asyncio: on this side only the stamping matters, and a tight ``epoll``/``recv`` loop
    costs a few microseconds per socket, so the time measured is the sender's, not the load generator's."""

    def __init__(self) -> None:
        self.epoll = select.epoll()
        self.socks: dict[int, socket.socket] = {}
        self.buffers: dict[int, bytes] = {}
        self.notice_frame: bytes | None = None

    def open(self, path: Path, n: int, request: bytes | None, first: bytes) -> None:
        """Connect n subscribers and wait until each has its first frame (``first`` is the event name, or
        ``b""`` for the raw server's hello)."""
        for _ in range(n):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(str(path))
            if request:
                sock.sendall(request)
            sock.setblocking(False)
            self.socks[sock.fileno()] = sock
            self.buffers[sock.fileno()] = b""
            self.epoll.register(sock.fileno(), select.EPOLLIN)
        self.wait(first, time.monotonic_ns())

    def close(self) -> None:
        for fd, sock in self.socks.items():
            self.epoll.unregister(fd)
            sock.close()
        self.socks.clear()
        self.buffers.clear()

    def wait(self, kind: bytes, t0: int) -> list[int]:
        """Read until every subscriber has a complete ``kind`` frame; latencies from ``t0`` in ns."""
        marker = b"event: " + kind + b"\n" if kind else b"+"
        pending = set(self.socks)
        latencies: list[int] = []
        deadline = time.monotonic() + ROUND_TIMEOUT_S
        socks, buffers = self.socks, self.buffers
        while pending:
            timeout = deadline - time.monotonic()
            if timeout <= 0:
                raise AssertionError(
                    f"only {len(socks) - len(pending)} of {len(socks)} subscribers got {kind!r}"
                )
            for fd, _ in self.epoll.poll(timeout):
                data = socks[fd].recv(262144)
                now = time.monotonic_ns()
                if not data:
                    raise AssertionError(f"a subscriber's stream was closed while waiting for {kind!r}")
                buffer = buffers[fd] + data
                at = buffer.find(marker)
                end = buffer.find(b"\n\n", at) if at >= 0 else -1
                if end >= 0 and fd in pending:
                    pending.discard(fd)
                    latencies.append(now - t0)
                    if kind == b"notice" and self.notice_frame is None:
                        self.notice_frame = buffer[buffer.rfind(b"id: ", 0, at) : end + 2]
                    buffer = buffer[end + 2 :]
                buffers[fd] = buffer
        return latencies


class HttpControl:
    """A keep-alive HTTP/1.1 connection to the agent for the drills (blocking; answers read after the round)."""

    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(str(path))
        self.file = self.sock.makefile("rb")

    def send(self, method: str, target: str, body: bytes = b"") -> None:
        head = f"{method} {target} HTTP/1.1\r\nHost: agent\r\nContent-Length: {len(body)}\r\n"
        if body:
            head += "Content-Type: application/json\r\n"
        self.sock.sendall(head.encode() + b"\r\n" + body)

    def response(self) -> tuple[int, Any]:
        status = int(self.file.readline().split(b" ", 2)[1])
        length = 0
        while (line := self.file.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            if name.strip().lower() == "content-length":
                length = int(value)
        body = self.file.read(length)
        return status, json.loads(body) if body else None

    def close(self) -> None:
        self.file.close()
        self.sock.close()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    rank = q / 100 * (len(ordered) - 1)
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summary(latencies_ns: list[int]) -> dict[str, float]:
    ms = [v / 1e6 for v in latencies_ns]
    return {
        "p50_ms": percentile(ms, 50),
        "p99_ms": percentile(ms, 99),
        "max_ms": max(ms),
        "samples": len(ms),
    }


def bench_size(n: int, rounds: int, procs: Processes, raw_first: bytes | None = None) -> dict[str, Any]:
    """One pair at size n: the agent's rounds, then the raw broadcast of the notice bytes it wrote; with
    ``raw_first`` (a notice chunk from an earlier pair), the raw broadcast of those bytes first."""
    fan = Fanout()
    if raw_first is not None:
        raw_ns, write_loop_ns, raw_delivered = raw_rounds(fan, n, rounds, procs, raw_first)
    agent_ns, delivered, payload = agent_rounds(fan, n, rounds, procs)
    if raw_first is None:
        raw_ns, write_loop_ns, raw_delivered = raw_rounds(fan, n, rounds, procs, payload)
    fan.epoll.close()
    return {
        "n": n,
        "rounds": rounds,
        "order": "raw first" if raw_first is not None else "agent first",
        "payload_bytes": len(payload),
        "payload": payload.decode("latin-1"),
        "agent": summary(agent_ns),
        "raw": summary(raw_ns),
        "raw_write_loop_ms": statistics.median(write_loop_ns) / 1e6,
        "delivered": {"agent": delivered, "raw": raw_delivered, "expected": (WARMUP + rounds) * n},
    }


def agent_rounds(fan: Fanout, n: int, rounds: int, procs: Processes) -> tuple[list[int], int, bytes]:
    """The agent's rounds: latencies (ns), notices delivered, and the chunk it wrote to each subscriber."""
    request = b"GET /v1/events HTTP/1.1\r\nHost: agent\r\nAccept: text/event-stream\r\n\r\n"
    fan.open(procs.agent_sock, n, request, b"snapshot")
    control = HttpControl(procs.agent_sock)
    body = json.dumps({"kind": "termination", "in_s": 600, "reason": "fan-out benchmark"}).encode()
    agent_ns: list[int] = []
    delivered = 0
    for i in range(WARMUP + rounds):
        t0 = time.monotonic_ns()
        control.send("POST", "/v1/drills", body)
        latencies = fan.wait(b"notice", t0)
        status, doc = control.response()
        assert status == 201, (status, doc)
        delivered += len(latencies)
        if i >= WARMUP:
            agent_ns += latencies
            if os.environ.get("FANOUT_DEBUG"):
                print(f"    round {i}: max {max(latencies) / 1e6:.1f} ms", flush=True)
        control.send("DELETE", f"/v1/drills/{doc['notice']['id']}")
        fan.wait(b"cleared", time.monotonic_ns())
        status, doc = control.response()
        assert status == 200, (status, doc)
        time.sleep(PAUSE_S)
    frame = fan.notice_frame
    assert frame is not None and frame.startswith(b"id: "), frame
    payload = b"%x\r\n%s\r\n" % (len(frame), frame)  # the chunk the agent wrote to each subscriber
    control.close()
    fan.close()
    return agent_ns, delivered, payload


def raw_rounds(
    fan: Fanout, n: int, rounds: int, procs: Processes, payload: bytes
) -> tuple[list[int], list[int], int]:
    """The raw broadcast's rounds: latencies (ns), the server's write loop times (ns), notices delivered."""
    raw = HttpControl(procs.raw_ctl)
    raw.sock.sendall(b"payload %d\n" % len(payload) + payload)
    assert raw.file.readline() == b"ok\n"
    fan.open(procs.raw_sock, n, None, b"")
    raw_ns: list[int] = []
    write_loop_ns: list[int] = []  # the raw server's loop of N transport.write() calls
    raw_delivered = 0
    for i in range(WARMUP + rounds):
        t0 = time.monotonic_ns()
        raw.sock.sendall(b"go\n")
        latencies = fan.wait(b"notice", t0)
        answer = raw.file.readline().split()
        assert answer[0] == b"ok", answer
        raw_delivered += len(latencies)
        if i >= WARMUP:
            raw_ns += latencies
            write_loop_ns.append(int(answer[1]))
        time.sleep(PAUSE_S)
    fan.close()
    raw.close()
    return raw_ns, write_loop_ns, raw_delivered


class Processes:
    """The agent and the raw server as child processes."""

    def __init__(self, base: Path, profile: Path | None, agent_tree: Path = REPO) -> None:
        self.base = base
        self.agent_tree = agent_tree
        self.agent_sock = base / "a.sock"
        self.raw_sock = base / "raw.sock"
        self.raw_ctl = base / "raw-ctl.sock"
        self.profile = profile
        self.agent: subprocess.Popen[bytes] | None = None
        self.raw: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PREEMPTD_", "NOTIFY_", "LISTEN_"))}
        env["PYTHONPATH"] = str(REPO)
        notify_path = self.base / "notify.sock"
        notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        notify.bind(str(notify_path))
        notify.settimeout(30)
        profile = ["-m", "cProfile", "-o", str(self.profile)] if self.profile else []
        argv = [
            sys.executable, *profile, "-m", "agent", "run", "--socket", str(self.agent_sock),
            "--state-dir", str(self.base / "state"), "--cloud", "none", "--log-format", "json",
        ]  # fmt: skip
        agent_env = {**env, "NOTIFY_SOCKET": str(notify_path), "PYTHONPATH": str(self.agent_tree)}
        with (self.base / "agent.log").open("wb") as log:
            self.agent = subprocess.Popen(argv, env=agent_env, stdout=log, stderr=log, cwd=self.agent_tree)
        try:
            while b"READY=1" not in notify.recv(4096).split(b"\n"):
                pass
        finally:
            notify.close()
        self.raw = subprocess.Popen(
            [sys.executable, __file__, "--raw-server", str(self.raw_sock), str(self.raw_ctl)],
            stdout=subprocess.PIPE,
            env=env,
        )
        assert self.raw.stdout is not None
        assert self.raw.stdout.readline() == b"ready\n"

    def stop(self) -> None:
        for proc in (self.raw, self.agent):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def run_once(sizes: list[int], procs: Processes, earlier: dict[int, bytes] | None) -> list[dict[str, Any]]:
    """One pair per size; with ``earlier`` (each size's notice chunk from the previous pair), raw first."""
    results = []
    for n in sizes:
        result = bench_size(n, ROUNDS.get(n, 20), procs, earlier[n] if earlier else None)
        results.append(result)
        a, r = result["agent"], result["raw"]
        print(
            f"  N={n:>5}  agent p50 {a['p50_ms']:7.3f} p99 {a['p99_ms']:7.3f} max {a['max_ms']:7.3f} ms | "
            f"raw p50 {r['p50_ms']:7.3f} p99 {r['p99_ms']:7.3f} max {r['max_ms']:7.3f} ms | "
            f"p99 ratio {a['p99_ms'] / r['p99_ms']:5.2f} | raw write loop {result['raw_write_loop_ms']:.3f} ms"
            f" | {result['order']}",
            flush=True,
        )
    return results


def spread(values: list[float]) -> dict[str, float]:
    """Median, quartiles (inclusive method: within min-max even for two values) and extremes."""
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else values * 3
    return {"median": statistics.median(values), "q1": q1, "q3": q3, "min": min(values), "max": max(values)}


def summarise(pairs: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per size, over the pairs: the spread of each side's p99 and p50 and of the pairs' ratios."""
    out = []
    for per_size in zip(*pairs, strict=True):
        row: dict[str, Any] = {"n": per_size[0]["n"], "rounds": per_size[0]["rounds"], "pairs": len(per_size)}
        for side in ("agent", "raw"):
            row[side] = {key: spread([r[side][key] for r in per_size]) for key in ("p50_ms", "p99_ms")}
        for key in ("p99", "p50"):
            row[f"{key}_ratio"] = spread([r["agent"][f"{key}_ms"] / r["raw"][f"{key}_ms"] for r in per_size])
        row["all_delivered"] = all(
            r["delivered"]["agent"] == r["delivered"]["expected"] == r["delivered"]["raw"] for r in per_size
        )
        row["payload_bytes"] = per_size[0]["payload_bytes"]
        out.append(row)
    return out


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| N | pairs | agent p99 median (min-max) | raw p99 median (min-max) | p99 ratio median | ratio IQR "
        "| ratio min-max | p50 ratio median | all delivered |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|:---:|",
    ]
    for row in rows:
        a, r, q = row["agent"]["p99_ms"], row["raw"]["p99_ms"], row["p99_ratio"]
        lines.append(
            f"| {row['n']} | {row['pairs']} | {a['median']:.2f} ({a['min']:.2f}-{a['max']:.2f}) | "
            f"{r['median']:.2f} ({r['min']:.2f}-{r['max']:.2f}) | {q['median']:.2f}x | "
            f"{q['q1']:.2f}-{q['q3']:.2f} | {q['min']:.2f}-{q['max']:.2f} | {row['p50_ratio']['median']:.2f}x | "
            f"{'yes' if row['all_delivered'] else 'NO'} |"
        )
    lines.append(
        f"\nms; p99 of each pair's rounds, then median and spread over the pairs; the ratio is agent ÷ raw "
        f"p99 of the same pair; payload {rows[0]['payload_bytes']} bytes per subscriber."
    )
    return "\n".join(lines)


# ----- the sender side alone (in one process, no reader competing for the CPU) -----


async def sender_side(n: int, rounds: int) -> dict[str, list[float]]:
    """Time from ``agent.drills.drill()`` until the frame is written to all n connections, next to a loop of n
    ``transport.write()`` calls, in this process; the subscribers' sockets are read only between rounds."""
    from agent.config import load_config
    from agent.core.notice import Kind
    from agent.service.daemon import Agent

    base = Path(tempfile.mkdtemp(prefix="pd-send-", dir="/tmp"))
    settings = {"socket": str(base / "a.sock"), "state_dir": str(base / "state"), "cloud": "none"}
    agent = Agent(load_config(path=None, env={}, overrides=settings))
    await agent.start()
    loop = asyncio.get_running_loop()
    socks: list[socket.socket] = []

    async def until(kind: bytes) -> None:  # every socket has a complete frame of this kind
        for sock in socks:
            data = b""
            while kind not in data or not data.endswith(b"\n\n\r\n"):
                data += await loop.sock_recv(sock, 262144)

    def drain() -> None:
        for sock in socks:
            with contextlib.suppress(BlockingIOError):
                while sock.recv(262144):
                    pass

    try:
        for _ in range(n):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.setblocking(False)
            await loop.sock_connect(sock, str(agent.config.socket))
            await loop.sock_sendall(sock, b"GET /v1/events HTTP/1.1\r\nHost: agent\r\n\r\n")
            socks.append(sock)
        await until(b"event: snapshot")
        subs = list(agent.hub.subscribers)
        agent_ms: list[float] = []
        for i in range(WARMUP + rounds):
            target = sum(s.delivered for s in subs) + n
            t0 = time.perf_counter()
            notice = agent.drills.drill(Kind.TERMINATION, 600, None, "fan-out benchmark", {})
            # Spin, yielding to the loop at each turn: the frames still queued are written in those turns.
            while sum(s.delivered for s in subs) < target:  # noqa: ASYNC110
                await asyncio.sleep(0)
            if i >= WARMUP:
                agent_ms.append((time.perf_counter() - t0) * 1e3)
            agent.retract(notice.source, notice.key)
            await until(b"event: cleared")
            drain()
            await asyncio.sleep(PAUSE_S)
        frame = agent.hub._ring[-2][1]  # the last notice frame, as the agent wrote it
        payload = b"%x\r\n%s\r\n" % (len(frame), frame)
        for sock in socks:
            sock.close()
        socks.clear()
        transports: list[asyncio.Transport] = []

        class Accept(asyncio.Protocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                assert isinstance(transport, asyncio.Transport)
                transports.append(transport)
                transport.write(b"+\n\n\r\n")

        server = await loop.create_unix_server(Accept, str(base / "raw.sock"), backlog=4096)
        for _ in range(n):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.setblocking(False)
            await loop.sock_connect(sock, str(base / "raw.sock"))
            socks.append(sock)
        await until(b"+")
        raw_ms: list[float] = []
        for i in range(WARMUP + rounds):
            t0 = time.perf_counter()
            for transport in transports:
                transport.write(payload)
            if i >= WARMUP:
                raw_ms.append((time.perf_counter() - t0) * 1e3)
            await until(b"event: notice")
            drain()
            await asyncio.sleep(PAUSE_S)
        server.close()
        return {"agent": agent_ms, "raw": raw_ms}
    finally:
        for sock in socks:
            sock.close()
        await agent.stop()
        shutil.rmtree(base, ignore_errors=True)


def run_sender_side(sizes: list[int], agent_tree: Path) -> list[dict[str, Any]]:
    rows = []
    for n in sizes:
        out = subprocess.run(
            [sys.executable, __file__, "--sender-child", str(n)],
            env={**os.environ, "PYTHONPATH": str(agent_tree)},
            cwd=agent_tree,
            capture_output=True,
            check=True,
            timeout=600,
        )
        result = json.loads(out.stdout)
        agent, raw = result["agent"], result["raw"]
        row = {
            "n": n,
            "agent_median_ms": statistics.median(agent),
            "agent_p99_ms": percentile(agent, 99),
            "raw_median_ms": statistics.median(raw),
            "raw_p99_ms": percentile(raw, 99),
        }
        rows.append(row)
        print(
            f"  N={n:>5}  agent drill()->last write: median {row['agent_median_ms']:.3f} p99 "
            f"{row['agent_p99_ms']:.3f} ms | raw write loop: median {row['raw_median_ms']:.3f} p99 "
            f"{row['raw_p99_ms']:.3f} ms | median ratio {row['agent_median_ms'] / row['raw_median_ms']:.2f}",
            flush=True,
        )
    return rows


def raise_nofile(needed: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < needed:
        wanted = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
        if wanted < needed:
            sys.exit(f"RLIMIT_NOFILE hard limit {hard} is below the {needed} descriptors needed")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="100,1000", help="subscriber counts (default 100,1000)")
    parser.add_argument(
        "--pairs",
        "--repeat",
        type=int,
        default=8,
        help="pairs (agent and raw back to back, fresh processes), median and spread reported (default 8)",
    )
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--profile-agent", type=Path, help="run the agent under cProfile, stats to this file")
    parser.add_argument(
        "--agent-tree",
        type=Path,
        default=REPO,
        help="run the agent package from this source tree (to compare commits: git archive REV agent | tar -x)",
    )
    parser.add_argument(
        "--sender-side",
        action="store_true",
        help="also time the sending side alone: in one process, drill() to the last write vs a write loop",
    )
    parser.add_argument("--raw-server", nargs=2, metavar=("SOCKET", "CONTROL"), help=argparse.SUPPRESS)
    parser.add_argument("--sender-child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.raw_server:
        asyncio.run(raw_server(*args.raw_server))
        return 0
    if args.sender_child:
        from agent.service.logs import configure_logging

        raise_nofile(2 * args.sender_child + 256)
        with open(os.devnull, "w") as devnull:
            configure_logging("json", "info", stream=devnull)
            result = asyncio.run(sender_side(args.sender_child, ROUNDS.get(args.sender_child, 20)))
        print(json.dumps(result))
        return 0
    sizes = [int(s) for s in args.sizes.split(",")]
    raise_nofile(2 * max(sizes) + 256)
    print(
        f"fan-out benchmark: {platform.python_implementation()} {platform.python_version()}, "
        f"{os.cpu_count()} CPUs, {platform.system()} {platform.release()}",
        flush=True,
    )
    sender_rows = None
    if args.sender_side:
        print("sender side (one process)", flush=True)
        sender_rows = run_sender_side(sizes, args.agent_tree.resolve())
    runs: list[list[dict[str, Any]]] = []
    for i in range(args.pairs):
        base = Path(tempfile.mkdtemp(prefix="pd-bench-", dir="/tmp"))
        profile = args.profile_agent if i == 0 else None
        procs = Processes(base, profile, args.agent_tree.resolve())
        # Odd pairs run the raw broadcast first, of the notice bytes the agent wrote in the pair before.
        earlier = {r["n"]: r["payload"].encode("latin-1") for r in runs[-1]} if i % 2 else None
        try:
            procs.start()
            print(f"pair {i + 1}/{args.pairs}, load average {os.getloadavg()[0]:.2f}", flush=True)
            runs.append(run_once(sizes, procs, earlier))
        finally:
            procs.stop()
            shutil.rmtree(base, ignore_errors=True)
    if not runs:
        return 0
    rows = summarise(runs)
    print()
    print(markdown(rows))
    print("p99 ratio medians: " + ", ".join(f"N={r['n']} {r['p99_ratio']['median']:.2f}x" for r in rows))
    if args.json:
        args.json.write_text(
            json.dumps({"pairs": runs, "summary": rows, "sender_side": sender_rows}, indent=2)
        )
    failed = [row["n"] for row in rows if not row["all_delivered"]]
    if failed:
        print(f"NOT every subscriber got every notice at N = {failed}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
