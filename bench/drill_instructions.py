"""Instructions per notice on the drill path, counted by callgrind: a figure that holds on a busy machine, where
the wall-clock figures of ``bench/fanout.py`` do not.

One process, as ``bench/fanout.py --sender-side`` has it: the agent (``Agent`` in this process, JSON logs to a
file) with N event-stream subscribers on real Unix sockets, and a control connection that sends ``POST
/v1/drills`` over the socket as ``bench/fanout.py`` does, then ``DELETE``, 20 rounds after 3 warm-up ones.
Callgrind counts the user-space instructions of every thread (the kernel's work is not counted) in one of two
windows, switched on and off with ``CALLGRIND_TOGGLE_COLLECT`` (a three-line C helper built with gcc against
valgrind's header):

* ``fanout``: from the POST's send until the hub has handed the notice to every subscriber (the frames go
  straight to each waiting stream's transport; a frame that had to be queued instead is counted and shown as
  ``queued``): HTTP, the admin check, the body, the board, the encoding and the N writes;
* ``round``: the whole round: the POST and its answer, the DELETE, every subscriber's ``cleared`` and the
  answer, with what follows the fan-out (listeners, history, log lines, the state write's Python side) and this
  process reading the N sockets (the same work for any tree).

Figures are per round (collected ÷ rounds). ``N = 1`` is the fixed cost; the difference to a larger N, divided
by N - 1, the cost of one more subscriber.

    python bench/drill_instructions.py                           # N = 1 and 100, both windows: 4 valgrind runs
    python bench/drill_instructions.py --sizes 100 --window fanout --agent-tree /tmp/before

Needs valgrind (with its headers) and gcc. ``--agent-tree`` runs the agent package from another source tree
(``git worktree add /tmp/before COMMIT``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import json
import os
import re
import resource
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
ROUNDS = 20
WARMUP = 3
PAUSE_S = 1.0  # between rounds: under valgrind the previous round's writes and threads take this long
HELPER = "#include <valgrind/callgrind.h>\nvoid toggle(void) { CALLGRIND_TOGGLE_COLLECT; }\n"
BODY = json.dumps({"kind": "termination", "in_s": 600, "reason": "fan-out benchmark"}).encode()
POST = (
    b"POST /v1/drills HTTP/1.1\r\nHost: agent\r\nContent-Length: %d\r\nContent-Type: application/json\r\n\r\n%s"
    % (len(BODY), BODY)
)


def build_helper(directory: Path) -> Path:
    source, library = directory / "toggle.c", directory / "libtoggle.so"
    source.write_text(HELPER)
    subprocess.run(["gcc", "-O1", "-shared", "-fPIC", "-o", str(library), str(source)], check=True)
    return library


async def read_answer(loop: asyncio.AbstractEventLoop, sock: socket.socket, buf: list[bytes]) -> Any:
    """One HTTP answer from the control connection: (status, JSON body)."""
    while b"\r\n\r\n" not in buf[0]:
        buf[0] += await loop.sock_recv(sock, 65536)
    head, _, rest = buf[0].partition(b"\r\n\r\n")
    fields = dict(line.partition(b":")[::2] for line in head.split(b"\r\n")[1:])
    length = int(next((v for k, v in fields.items() if k.lower() == b"content-length"), b"0"))
    while len(rest) < length:
        rest += await loop.sock_recv(sock, 65536)
    buf[0] = rest[length:]
    return int(head.split(b" ", 2)[1]), json.loads(rest[:length]) if length else None


async def child(n: int, window: str, library: str) -> dict[str, Any]:
    """Runs under valgrind: the rounds, collection on only inside ``window``."""
    from agent.config import load_config
    from agent.service.daemon import Agent
    from agent.service.logs import configure_logging

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 2 * n + 256)), hard))
    toggle = ctypes.CDLL(library).toggle
    base = Path(tempfile.mkdtemp(prefix="pd-instr-", dir="/tmp"))
    with (base / "agent.log").open("w") as log:
        configure_logging("json", "info", stream=log)
        settings = {"socket": str(base / "a.sock"), "state_dir": str(base / "state"), "cloud": "none"}
        agent = Agent(load_config(path=None, env={}, overrides=settings))
        await agent.start()
        try:
            return await rounds(agent, n, window, toggle)
        finally:
            await agent.stop()
            shutil.rmtree(base, ignore_errors=True)


async def rounds(agent: Any, n: int, window: str, toggle: Any) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    socks: list[socket.socket] = []
    pending: dict[socket.socket, bytes] = {}

    async def until(kind: bytes) -> None:  # every subscriber has a complete frame of this kind
        for sock in socks:
            data = pending[sock]
            while kind not in data or not data.endswith(b"\n\n\r\n"):
                data += await loop.sock_recv(sock, 262144)
            pending[sock] = b""

    async def connect() -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        await loop.sock_connect(sock, str(agent.config.socket))
        return sock

    for _ in range(n):
        socks.append(await connect())
        pending[socks[-1]] = b""
        await loop.sock_sendall(socks[-1], b"GET /v1/events HTTP/1.1\r\nHost: agent\r\n\r\n")
    await until(b"event: snapshot")
    subs = list(agent.hub.subscribers)
    control, answers = await connect(), [b""]
    hub_class = type(agent.hub)
    publish = hub_class.publish
    state: dict[str, Any] = {"armed": False, "queued": 0}

    def counted_publish(hub: Any, event_type: Any, *args: Any, **kwargs: Any) -> Any:
        event = publish(hub, event_type, *args, **kwargs)
        if state["armed"] and event_type.value == "notice":
            state["armed"] = False
            if window == "fanout":
                toggle()
            state["queued"] += max(0, n - (sum(s.delivered for s in subs) - state["before"]))
            state["written"].set_result(None)
        return event

    hub_class.publish = counted_publish
    try:
        for i in range(WARMUP + ROUNDS):
            measured = i >= WARMUP
            written = loop.create_future()
            state.update(armed=measured, before=sum(s.delivered for s in subs), written=written)
            if measured:
                toggle()
            control.send(POST)
            if measured:
                await written  # nothing else of this process runs in the window
            status, doc = await read_answer(loop, control, answers)
            assert status == 201, (status, doc)
            await until(b"event: notice")
            target = f"/v1/drills/{doc['notice']['id']}"
            control.send(f"DELETE {target} HTTP/1.1\r\nHost: agent\r\nContent-Length: 0\r\n\r\n".encode())
            status, doc = await read_answer(loop, control, answers)
            assert status == 200, (status, doc)
            await until(b"event: cleared")
            if measured and window == "round":
                toggle()
            await asyncio.sleep(PAUSE_S)
    finally:
        hub_class.publish = publish
        for sock in [*socks, control]:
            sock.close()
    return {"queued": state["queued"]}


def measure(n: int, window: str, tree: Path, library: Path) -> dict[str, Any]:
    """One valgrind run of the child; instructions per round."""
    argv = [
        "valgrind", "--tool=callgrind", "--collect-atstart=no", "--callgrind-out-file=/dev/null",
        sys.executable, __file__, "--child", str(n), window, str(library),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run(argv, env=env, cwd=tree, capture_output=True, text=True, timeout=3600, check=True)
    collected = int(re.findall(r"Collected : (\d+)", out.stderr)[-1])
    result = json.loads(out.stdout.strip().splitlines()[-1])
    return {"n": n, "window": window, "per_round": collected / ROUNDS, "queued": result["queued"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1,100", help="subscriber counts (default 1,100)")
    parser.add_argument("--window", choices=("fanout", "round", "both"), default="both")
    parser.add_argument("--agent-tree", type=Path, default=REPO, help="run the agent from this source tree")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        n, window, library = args.child
        with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull):
            result = asyncio.run(child(int(n), window, library))
        print(json.dumps(result))
        return 0
    windows = ("fanout", "round") if args.window == "both" else (args.window,)
    with tempfile.TemporaryDirectory(prefix="pd-instr-") as scratch:
        library = build_helper(Path(scratch))
        for window in windows:
            for n in (int(s) for s in args.sizes.split(",")):
                row = measure(n, window, args.agent_tree.resolve(), library)
                print(
                    f"window {window:6}  N={n:>4}  {row['per_round'] / 1e3:9.1f} k instructions per round"
                    + (f"  ({row['queued']} frames queued, not written directly)" if row["queued"] else ""),
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
