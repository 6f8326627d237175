"""``preemptd demo``: the whole flow on a laptop, with no cloud and no GPU.

Runs the agent on the per-user socket with a throwaway state directory, watching a simulated EC2 metadata
service (``preemptd simulate aws``) on loopback; after a few seconds the simulator publishes a spot
termination notice, the agent's real AWS source picks it up, and the demo prints every event as a client sees
it. ``preemptd watch`` in a second terminal shows the same stream with a live countdown.
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
from agent.notice import Event, EventType
from agent.paths import user_socket_path
from agent.simulate import AwsSimulator
from agent.sources.detect import cloud_sources


async def _demo(args: argparse.Namespace, state_dir: Path) -> int:
    socket_path = args.socket or user_socket_path()
    simulator = AwsSimulator()
    await simulator.start()
    try:
        return await _demo_with(args, state_dir, socket_path, simulator)
    finally:
        await simulator.stop()


async def _demo_with(
    args: argparse.Namespace, state_dir: Path, socket_path: Path, simulator: AwsSimulator
) -> int:
    config = load_config(
        path=None,
        env={},
        overrides={
            "socket": str(socket_path),
            "state_dir": str(state_dir),
            "cloud": "aws",
            "aws.endpoint": simulator.url,
            "log_level": "error",
            "drill_linger_s": 2.0,
        },
    )
    agent = Agent(config, sources=cloud_sources(config))
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
        f"  simulated EC2 metadata at {simulator.url}: a spot termination notice arrives in "
        f"{format_duration(args.after)}, {format_duration(args.lead)} before the deadline",
        flush=True,
    )
    try:
        await asyncio.sleep(args.after)
        simulator.trigger({"type": "spot", "action": "terminate", "in_s": args.lead})
        await asyncio.sleep(args.lead)
        if not args.keep:
            # The instance is gone at its deadline: the metadata service stops announcing the interruption.
            simulator.trigger({"type": "spot-clear"})
        await finished.wait()
    finally:
        await agent.stop()
    print("preemptd demo: the notice reached its deadline and cleared; done.", flush=True)
    return 0


def run_demo(args: argparse.Namespace) -> int:
    configure_logging("console" if sys.stdout.isatty() else "json", "error")
    with tempfile.TemporaryDirectory(prefix="preemptd-demo-") as state_dir:
        try:
            return asyncio.run(_demo(args, Path(state_dir)))
        except KeyboardInterrupt:
            return 130
        except PreemptdError as exc:
            print(f"preemptd demo: {exc}", file=sys.stderr)
            return 1
