"""``preemptd demo``: the whole flow on a laptop, with no cloud and no GPU.

Runs the agent on the per-user socket with a throwaway state directory; a spot termination notice arrives
after a few seconds and the demo prints every event as a client sees it. ``preemptd watch`` in a second
terminal shows the same stream with a live countdown.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path

from agent.cli import format_event
from agent.config import load_config
from agent.daemon import Agent
from agent.durations import format_duration
from agent.errors import PreemptdError
from agent.logs import configure_logging
from agent.notice import Event, EventType, Kind
from agent.paths import user_socket_path


async def _demo(args: argparse.Namespace, state_dir: Path) -> int:
    socket_path = args.socket or user_socket_path()
    config = load_config(
        path=None,
        env={},
        overrides={
            "socket": str(socket_path),
            "state_dir": str(state_dir),
            "cloud": "none",
            "log_level": "warning",
            "drill_linger_s": 2.0,
        },
    )
    agent = Agent(config, sources=[])
    finished = asyncio.Event()

    def show(event: Event) -> None:
        print(format_event(event.to_json()), flush=True)
        if event.type is EventType.CLEARED and not args.keep:
            finished.set()

    agent.on_event(show)
    await agent.start()
    print(f"preemptd demo: agent listening on {socket_path}", flush=True)
    print(f"  in another terminal:  PREEMPTD_SOCKET={socket_path} preemptd watch", flush=True)
    print(
        f"  a spot termination notice arrives in {format_duration(args.after)}, {format_duration(args.lead)} before the deadline",
        flush=True,
    )
    try:
        await asyncio.sleep(args.after)
        agent.drill(Kind.TERMINATION, args.lead, None, "simulated spot termination (demo)", {"demo": True})
        await finished.wait()
    finally:
        await agent.stop()
    print("preemptd demo: the notice reached its deadline and cleared; done.", flush=True)
    return 0


def run_demo(args: argparse.Namespace) -> int:
    configure_logging("console" if sys.stdout.isatty() else "json", "warning")
    with tempfile.TemporaryDirectory(prefix="preemptd-demo-") as state_dir:
        try:
            return asyncio.run(_demo(args, Path(state_dir)))
        except KeyboardInterrupt:
            return 130
        except PreemptdError as exc:
            print(f"preemptd demo: {exc}", file=sys.stderr)
            return 1
