"""``preemptd demo``: the whole flow on a laptop, with no cloud and no GPU.

Runs the agent on the per-user socket with a throwaway state directory, watching a simulated EC2 metadata
service (``preemptd simulate aws``) on loopback, next to a real training job (``examples/
fault_tolerant_training.py`` on the CPU, a small model). A spot termination notice arrives, the job flushes
an emergency checkpoint and exits 75, the demo restarts it as a scheduler would, and it resumes at the next
step. Every line fits an 80-column terminal. ``preemptd watch`` in a second terminal shows the raw stream.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import os
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agent.config import load_config
from agent.daemon import Agent
from agent.durations import format_duration
from agent.errors import PreemptdError
from agent.logs import configure_logging
from agent.notice import Event, EventType
from agent.paths import user_socket_path
from agent.simulate import AwsSimulator
from agent.sources.detect import cloud_sources

WIDTH = 80
EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "fault_tolerant_training.py"
EXIT_PREEMPTED = 75
JOB_START_TIMEOUT_S = 120.0


class Screen:
    """Lines of the form ``  12.3s  WHAT    text``, wrapped to 80 columns, with the time since the start."""

    def __init__(self, write: Callable[[str], None] | None = None) -> None:
        self._start = time.monotonic()
        self._write = write or (lambda line: print(line, flush=True))

    def say(self, what: str, text: str) -> None:
        head = f"{time.monotonic() - self._start:6.1f}s  {what:<7} "
        lines = textwrap.wrap(text, WIDTH - len(head)) or [""]
        self._write(head + lines[0])
        for line in lines[1:]:
            self._write(" " * len(head) + line)


def _left(notice: dict[str, Any]) -> str:
    left = notice.get("seconds_left")
    return (
        f"{format_duration(float(left))} to the deadline" if isinstance(left, (int, float)) else "no deadline"
    )


def describe(event: Event) -> tuple[str, str] | None:
    """What the demo shows for an event, as (label, sentence); None for events it leaves out."""
    doc = event.to_json()
    notice = doc.get("notice") or {}
    origin = f"{notice.get('kind', 'notice')} from {notice.get('source', '?')}"
    if event.type is EventType.NOTICE:
        return "NOTICE", f"{origin}, {_left(notice)}: {notice.get('reason', '')}"
    if event.type is EventType.UPDATE:
        return "UPDATE", f"{origin}, {_left(notice)}"
    if event.type is EventType.CLEARED:
        return "CLEARED", f"{origin}: the deadline has passed and the instance is gone"
    if event.type is EventType.READY:
        data = doc.get("data") or {}
        saved, expected = len(data.get("finished") or []), len(data.get("participants") or [])
        margin = data.get("margin_s")
        spare = f", {format_duration(float(margin))} to spare" if isinstance(margin, (int, float)) else ""
        if expected == 0:
            return "READY", f"no training job was connected; nothing to wait for{spare}"
        if saved == expected:
            return "READY", f"every job saved its checkpoint ({saved} of {expected}){spare}"
        return "READY", f"{saved} of {expected} jobs saved before the grace ran out{spare}"
    return None


def _size(nbytes: Any) -> str:
    if not isinstance(nbytes, (int, float)):
        return "?"
    for unit in ("B", "kB", "MB", "GB"):
        if nbytes < 1000 or unit == "GB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1000
    return "?"


def describe_job(doc: dict[str, Any]) -> str | None:
    """What the demo shows for one JSON line of the training job; None for lines it leaves out."""
    event = doc.get("event")
    if event == "fresh":
        return "training a small model on the CPU, from step 0"
    if event == "agent_connected":
        return f"connected to the agent at step {doc.get('step')}"
    if event == "resumed":
        return f"resumed from the emergency checkpoint: step {doc.get('next_step')} is next"
    if event == "checkpoint" and doc.get("emergency"):
        left = doc.get("time_left")
        spare = f", {format_duration(float(left))} to spare" if isinstance(left, (int, float)) else ""
        ms = float(doc.get("seconds") or 0.0) * 1000
        return f"flushed step {doc.get('step')}: {_size(doc.get('bytes'))} in {ms:.0f} ms{spare}"
    if event == "checkpoint":
        return f"periodic checkpoint at step {doc.get('step')}"
    return None


class DemoJob:
    """The example training job as a child process; its JSON lines become sentences on the screen."""

    def __init__(self, socket_path: Path, workdir: Path, screen: Screen) -> None:
        self.socket_path = socket_path
        self.workdir = workdir
        self.screen = screen
        self.proc: asyncio.subprocess.Process | None = None
        self.connected = asyncio.Event()
        self.resumed = asyncio.Event()
        self._reader: asyncio.Task[None] | None = None

    @staticmethod
    def available() -> str | None:
        """Why the job cannot run here, or None when it can."""
        if not EXAMPLE.exists():
            return f"the example is not here ({EXAMPLE}): run the demo from a source checkout"
        if importlib.util.find_spec("torch") is None:
            return "PyTorch is not installed (pip install -e '.[torch]')"
        return None

    async def start(self) -> None:
        env = {**os.environ, "PREEMPTD_SOCKET": str(self.socket_path), "PYTHONUNBUFFERED": "1"}
        root = str(EXAMPLE.parent.parent)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
        # --no-signals: the demo stops the job with SIGTERM at the end, which must not look like a notice.
        self.proc = await asyncio.create_subprocess_exec(
            *(sys.executable, str(EXAMPLE), "--checkpoint-dir", str(self.workdir)),
            *("--steps", "1000000", "--step-time", "0.05", "--interval-s", "3600", "--no-signals"),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL,
            env=env,
        )
        self._reader = asyncio.ensure_future(self._read(self.proc))

    async def _read(self, proc: asyncio.subprocess.Process) -> None:
        assert proc.stdout is not None
        async for raw in proc.stdout:
            try:
                doc = json.loads(raw)
            except ValueError:
                continue
            if not isinstance(doc, dict):
                continue
            if doc.get("event") == "agent_connected":
                self.connected.set()
            if doc.get("event") == "resumed":
                self.resumed.set()
            text = describe_job(doc)
            if text:
                self.screen.say("job", text)

    async def wait(self) -> int:
        assert self.proc is not None and self._reader is not None
        code = await self.proc.wait()
        await self._reader
        return code

    async def stop(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.terminate()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.proc.wait(), 10)
            if self.proc.returncode is None:
                self.proc.kill()
                await self.proc.wait()
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader


async def _demo(args: argparse.Namespace, state_dir: Path) -> int:
    socket_path = args.socket or user_socket_path()
    simulator = AwsSimulator()
    await simulator.start()
    try:
        return await _demo_with(args, state_dir, socket_path, simulator)
    finally:
        await simulator.stop()


async def _run_job(job: DemoJob, screen: Screen) -> None:
    """The job until it is preempted, then once more, restarted as a scheduler would on exit status 75."""
    code = await job.wait()
    if code != EXIT_PREEMPTED:
        screen.say("job", f"exited with status {code}")
        return
    screen.say("job", "exited 75 (preempted): restarting it, as a scheduler would")
    await job.start()
    await job.wait()


async def _demo_with(
    args: argparse.Namespace, state_dir: Path, socket_path: Path, simulator: AwsSimulator
) -> int:
    config = load_config(
        path=None,
        env={},
        overrides={
            "socket": str(socket_path),
            "state_dir": str(state_dir / "state"),
            "cloud": "aws",
            "aws.endpoint": simulator.url,
            "log_level": "error",
            "drill_linger_s": 2.0,
        },
    )
    agent = Agent(config, sources=cloud_sources(config))
    screen = Screen()
    finished = asyncio.Event()

    def show(event: Event) -> None:
        shown = describe(event)
        if shown is not None:
            screen.say(*shown)
        if event.type is EventType.CLEARED and not args.keep:
            finished.set()

    agent.on_event(show)
    await agent.start()
    screen.say("agent", f"listening on {socket_path}")
    screen.say("agent", f"watch it from another terminal: PREEMPTD_SOCKET={socket_path} preemptd watch")
    job = DemoJob(socket_path, state_dir / "checkpoints", screen)
    why_not = DemoJob.available()
    runner: asyncio.Task[None] | None = None
    try:
        if why_not is None:
            await job.start()
            runner = asyncio.ensure_future(_run_job(job, screen))
            await asyncio.wait_for(job.connected.wait(), JOB_START_TIMEOUT_S)
        else:
            screen.say("job", f"no training job: {why_not}")
        screen.say(
            "cloud",
            f"simulated EC2 metadata at {simulator.url}: a spot termination notice in "
            f"{format_duration(args.after)}, {format_duration(args.lead)} before the deadline",
        )
        await asyncio.sleep(args.after)
        simulator.trigger({"type": "spot", "action": "terminate", "in_s": args.lead})
        await asyncio.sleep(args.lead)
        if not args.keep:
            # The instance is gone at its deadline: the metadata service stops announcing the interruption.
            simulator.trigger({"type": "spot-clear"})
        await finished.wait()
        if runner is not None:
            # The restarted job may still be importing PyTorch: show it resume before ending.
            await asyncio.wait_for(job.resumed.wait(), JOB_START_TIMEOUT_S)
    finally:
        await job.stop()
        if runner is not None:
            runner.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await runner
        await agent.stop()
    print("preemptd demo: done.", flush=True)
    return 0


def run_demo(args: argparse.Namespace) -> int:
    configure_logging("console" if sys.stdout.isatty() else "json", "error")
    with tempfile.TemporaryDirectory(prefix="preemptd-demo-") as state_dir:
        try:
            return asyncio.run(_demo(args, Path(state_dir)))
        except KeyboardInterrupt:
            return 130
        except asyncio.TimeoutError:
            print("preemptd demo: the training job did not start in time", file=sys.stderr)
            return 1
        except PreemptdError as exc:
            print(f"preemptd demo: {exc}", file=sys.stderr)
            return 1
