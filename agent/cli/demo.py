"""``preemptd demo``: the whole flow on a laptop, with no cloud and no GPU.

Runs the agent on the per-user socket with a throwaway state directory, watching a simulated EC2 metadata
service (``preemptd simulate aws``) on loopback, next to a real training job on the CPU: ``examples/
fault_tolerant_training.py`` (a small PyTorch model) when PyTorch is installed, else ``examples/
stdlib_training.py`` (a linear regression in pure Python, the same client); the first line says which. A spot
termination notice arrives, the job flushes an emergency checkpoint and exits 75, the demo restarts it as a
scheduler would, and it resumes at the next step. A job that fails stops the demo at once, saying whether it
did not start, flush or resume, with the tail of its stderr; while it is silent (importing PyTorch) a line
every few seconds says what the demo waits for. Every line fits an 80-column terminal. ``preemptd watch`` in a
second terminal shows the raw stream.
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
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.config import load_config
from agent.core.durations import format_duration
from agent.core.errors import PreemptdError
from agent.core.notice import Event, EventType
from agent.core.paths import user_socket_path
from agent.core.tasks import TaskSet, wait_for_any
from agent.service.daemon import Agent
from agent.service.logs import configure_logging
from agent.simulate import AwsSimulator
from agent.sources.detect import cloud_sources

WIDTH = 80
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
EXAMPLE = EXAMPLES / "fault_tolerant_training.py"  # the job with PyTorch
STDLIB_EXAMPLE = EXAMPLES / "stdlib_training.py"  # the job without it
EXIT_PREEMPTED = 75
JOB_START_TIMEOUT_S = 120.0  # to import PyTorch and connect, or to load the checkpoint after the restart
FLUSH_GRACE_S = 10.0  # past the deadline, before a job that has not exited 75 is called a failure
PROGRESS_EVERY_S = 5.0  # a line saying what the demo waits for, after this long without one
STDERR_TAIL_LINES = 15  # of a failed job's stderr, shown
STREAM_LIMIT = 1 << 20  # the longest line read from the job (a long traceback line must not stop the demo)
FIRST_LINE_NO_JOB = "starting the agent and a simulated EC2 spot termination, without a training job"


@dataclass(frozen=True)
class JobChoice:
    """The training job the demo runs: its script, the first line's account of it, and what it does before it
    prints its first line (said while the demo waits for it)."""

    script: Path
    first_line: str
    loading: str


TORCH_JOB = JobChoice(
    EXAMPLE,
    "starting the agent and a small PyTorch training job on the CPU (examples/fault_tolerant_training.py); "
    "waiting for the job to import PyTorch, which takes longest on a first run",
    "importing PyTorch",
)
STDLIB_JOB = JobChoice(
    STDLIB_EXAMPLE,
    "starting the agent and a small training job on the CPU without PyTorch, which is not installed: a "
    "linear regression in pure Python (examples/stdlib_training.py)",
    "starting Python",
)


def _has_torch() -> bool:
    """Whether PyTorch is installed, without importing it (seconds): the job imports it, not the demo."""
    try:
        return importlib.util.find_spec("torch") is not None
    except (ImportError, ValueError):  # a finder that refuses it; a torch module without a spec
        return False


def choose_job(script: Path | None, has_torch: bool | None = None) -> JobChoice | str:
    """The job to run: ``script`` (``--job``) when given, else the PyTorch example when PyTorch is installed
    and the standard-library one when it is not; a sentence saying why there is none when the script is
    missing (the examples are in a source checkout, not in the wheel)."""
    if script is not None:
        if not script.exists():
            return f"the training script is not here ({script})"
        return JobChoice(script, f"starting the agent and the training job {script}", "starting up")
    choice = TORCH_JOB if (_has_torch() if has_torch is None else has_torch) else STDLIB_JOB
    if not choice.script.exists():
        return f"the training script is not here ({choice.script}): run the demo from a source checkout"
    return choice


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
            return "READY", f"no training job had reported to the agent yet; none waited for{spare}"
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


class DemoFailed(PreemptdError):
    """The training job did not do its part; the message says which part, ``stderr`` is the tail to show."""

    def __init__(self, message: str, stderr: list[str]) -> None:
        super().__init__(message)
        self.stderr = stderr


class DemoJob:
    """One run of the training job as a child process: its JSON lines become sentences on the screen and the
    milestones the demo waits for; the tail of its stderr is kept to show when it fails."""

    def __init__(
        self, script: Path, socket_path: Path, workdir: Path, screen: Screen, loading: str = "starting up"
    ) -> None:
        self.script = script
        self.loading = loading  # what it does before its first line: "importing PyTorch"
        self.socket_path = socket_path
        self.workdir = workdir
        self.screen = screen
        self.proc: asyncio.subprocess.Process | None = None
        self.talking = False  # it printed a progress line: it is past its imports
        self.connected = asyncio.Event()
        self.flushed_step: int | None = None
        self.resumed = asyncio.Event()
        self.exited = asyncio.Event()
        self.returncode: int | None = None
        self.stderr_tail: deque[str] = deque(maxlen=STDERR_TAIL_LINES)
        self._follower: asyncio.Task[None] | None = None

    async def start(self) -> None:
        env = {**os.environ, "PREEMPTD_SOCKET": str(self.socket_path), "PYTHONUNBUFFERED": "1"}
        root = str(EXAMPLES.parent)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
        # --no-signals: the demo stops the job with SIGTERM at the end, which must not look like a notice.
        self.proc = await asyncio.create_subprocess_exec(
            *(sys.executable, str(self.script), "--checkpoint-dir", str(self.workdir)),
            *("--steps", "1000000", "--step-time", "0.05", "--interval-s", "3600", "--no-signals"),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=env,
            limit=STREAM_LIMIT,
        )
        self._follower = asyncio.ensure_future(self._follow(self.proc))

    async def _follow(self, proc: asyncio.subprocess.Process) -> None:
        assert proc.stdout is not None and proc.stderr is not None
        try:
            await asyncio.gather(self._read_progress(proc.stdout), self._read_stderr(proc.stderr))
            self.returncode = await proc.wait()
        finally:
            self.exited.set()

    async def _read_progress(self, stream: asyncio.StreamReader) -> None:
        async for raw in stream:
            try:
                doc = json.loads(raw)
            except ValueError:
                continue
            if not isinstance(doc, dict):
                continue
            self.talking = True
            event = doc.get("event")
            if event == "agent_connected":
                self.connected.set()
            elif event == "resumed":
                self.resumed.set()
            elif event == "checkpoint" and doc.get("emergency"):
                self.flushed_step = doc.get("step")
            text = describe_job(doc)
            if text:
                self.screen.say("job", text)

    async def _read_stderr(self, stream: asyncio.StreamReader) -> None:
        async for raw in stream:
            self.stderr_tail.append(raw.decode(errors="replace").rstrip())

    async def until(
        self,
        milestone: asyncio.Event,
        timeout: float,
        doing: Callable[[], str],
        every: float = PROGRESS_EVERY_S,
    ) -> bool:
        """Wait for ``milestone`` or the job's exit, at most ``timeout`` seconds, with a line saying what it is
        still ``doing`` every ``every`` seconds; True when the milestone came."""
        start = time.monotonic()
        while not (milestone.is_set() or self.exited.is_set()):
            waited = time.monotonic() - start
            if waited >= timeout:
                break
            await wait_for_any(milestone, self.exited, timeout=min(every, timeout - waited))
            if not (milestone.is_set() or self.exited.is_set()):
                self.screen.say("job", f"{doing()} ({format_duration(time.monotonic() - start)} so far)")
        return milestone.is_set()

    async def finish(self) -> None:
        """Wait until the process has ended and both of its streams are read to the end."""
        assert self._follower is not None
        await self._follower

    def failed(self, what: str, how: str) -> DemoFailed:
        """The error to stop the demo with: ``what`` did not happen, ``how`` it went instead."""
        return DemoFailed(f"the training job {what}: {how}", list(self.stderr_tail))

    def exit_status(self) -> str:
        code = self.returncode
        return f"killed by signal {-code}" if code is not None and code < 0 else f"exited with status {code}"

    async def stop(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.terminate()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.proc.wait(), 10)
            if self.proc.returncode is None:
                self.proc.kill()
                await self.proc.wait()
        if self._follower is not None:
            self._follower.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._follower


async def _demo(args: argparse.Namespace, state_dir: Path, screen: Screen, choice: JobChoice | str) -> int:
    socket_path = args.socket or user_socket_path()
    simulator = AwsSimulator()
    await simulator.start()
    try:
        return await _demo_with(args, state_dir, socket_path, simulator, screen, choice)
    finally:
        await simulator.stop()


async def _preempt_and_resume(
    args: argparse.Namespace, job: DemoJob, notify: Callable[[], None], screen: Screen
) -> DemoJob:
    """The job's side of the demo: it starts and connects, flushes and exits 75 after the notice, and is
    restarted to resume from its checkpoint. Returns the restarted run; DemoFailed at the first step missed."""
    await job.start()
    screen.say("job", f"starting {job.script.name}: {job.loading}")

    def starting() -> str:
        return "started, not connected to the agent yet" if job.talking else f"still {job.loading}"

    if not await job.until(job.connected, JOB_START_TIMEOUT_S, starting):
        if job.exited.is_set():
            raise job.failed("did not start", f"it {job.exit_status()} before it connected to the agent")
        raise job.failed(
            "did not start", f"it has not connected to the agent in {format_duration(JOB_START_TIMEOUT_S)}"
        )
    notify()
    await wait_for_any(job.exited, timeout=args.after + args.lead + FLUSH_GRACE_S)
    step = job.flushed_step
    if not job.exited.is_set():
        if step is None:
            raise job.failed("did not flush", "no emergency checkpoint by the notice's deadline")
        raise job.failed("did not exit", f"it flushed step {step} but was still running after the deadline")
    await job.finish()
    if job.returncode != EXIT_PREEMPTED or step is None:
        saved = f"after flushing step {step}" if step is not None else "with no emergency checkpoint reported"
        raise job.failed("did not flush", f"it {job.exit_status()} {saved} (75: preempted and saved)")
    screen.say("job", "exited 75 (preempted): restarting it, as a scheduler would")
    again = DemoJob(job.script, job.socket_path, job.workdir, screen, job.loading)
    await again.start()

    def loading() -> str:
        return f"restarting: {job.loading}, then loading step {step}"

    if not await again.until(again.resumed, JOB_START_TIMEOUT_S, loading):
        if again.exited.is_set():
            raise again.failed("did not resume", f"the restarted job {again.exit_status()}")
        raise again.failed(
            "did not resume", f"no resume from step {step} in {format_duration(JOB_START_TIMEOUT_S)}"
        )
    return again


def _demo_agent(state_dir: Path, socket_path: Path, simulator: AwsSimulator) -> Agent:
    """The demo's agent: on ``socket_path``, its state under ``state_dir``, watching the simulated EC2."""
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
    return Agent(config, sources=cloud_sources(config))


async def _demo_with(
    args: argparse.Namespace,
    state_dir: Path,
    socket_path: Path,
    simulator: AwsSimulator,
    screen: Screen,
    choice: JobChoice | str,
) -> int:
    """The demo with the training job ``choice`` (a string: why there is none)."""
    agent = _demo_agent(state_dir, socket_path, simulator)
    finished = asyncio.Event()
    tasks = TaskSet("demo", "task_failed")

    def show(event: Event) -> None:
        shown = describe(event)
        if shown is not None:
            screen.say(*shown)
        if event.type is EventType.CLEARED and not args.keep:
            finished.set()

    def notify() -> None:
        """The cloud's part: a spot termination notice after ``--after``, gone at its deadline."""
        screen.say(
            "cloud",
            f"simulated EC2 metadata at {simulator.url}: a spot termination notice in "
            f"{format_duration(args.after)}, {format_duration(args.lead)} before the deadline",
        )
        tasks.spawn(_notice(simulator, args), "notice")

    agent.fanout.on_event(show)
    await agent.start()
    screen.say("agent", f"listening on {socket_path}")
    screen.say("agent", f"watch it from another terminal: PREEMPTD_SOCKET={socket_path} preemptd watch")
    jobs: list[DemoJob] = []
    try:
        if isinstance(choice, JobChoice):
            jobs.append(
                DemoJob(choice.script, socket_path, state_dir / "checkpoints", screen, choice.loading)
            )
            resumed = await _preempt_and_resume(args, jobs[0], notify, screen)
            jobs.append(resumed)
            await wait_for_any(finished, resumed.exited)
            if not finished.is_set():
                await resumed.finish()
                raise resumed.failed("stopped", f"it {resumed.exit_status()} after it resumed")
        else:
            screen.say("job", f"no training job: {choice}")
            notify()
            await finished.wait()
    finally:
        for job in jobs:
            await job.stop()
        await tasks.close(timeout=5.0, grace=0)
        await agent.stop()
    print("preemptd demo: done.", flush=True)
    return 0


async def _notice(simulator: AwsSimulator, args: argparse.Namespace) -> None:
    await asyncio.sleep(args.after)
    simulator.trigger({"type": "spot", "action": "terminate", "in_s": args.lead})
    if not args.keep:
        # The instance is gone at its deadline: the metadata service stops announcing the interruption.
        await asyncio.sleep(args.lead)
        simulator.trigger({"type": "spot-clear"})


def _show_failure(exc: DemoFailed) -> None:
    lines = textwrap.wrap(f"preemptd demo: {exc}.", WIDTH, subsequent_indent="  ")
    if exc.stderr:
        lines.append("The last lines of its stderr:")
        lines += [
            wrapped
            for line in exc.stderr
            for wrapped in textwrap.wrap(line, WIDTH, initial_indent="  ", subsequent_indent="    ") or [""]
        ]
    else:
        lines.append("It wrote nothing to stderr.")
    print("\n".join(lines), file=sys.stderr, flush=True)


def run_demo(args: argparse.Namespace) -> int:
    screen = Screen()
    # The first line comes before the agent and the job start, and says what the wait is for.
    choice = choose_job(args.job)
    screen.say("demo", choice.first_line if isinstance(choice, JobChoice) else FIRST_LINE_NO_JOB)
    configure_logging("console" if sys.stdout.isatty() else "json", "error")
    with tempfile.TemporaryDirectory(prefix="preemptd-demo-") as state_dir:
        try:
            return asyncio.run(_demo(args, Path(state_dir), screen, choice))
        except KeyboardInterrupt:
            return 130
        except DemoFailed as exc:
            _show_failure(exc)
            return 1
        except PreemptdError as exc:
            print(f"preemptd demo: {exc}", file=sys.stderr)
            return 1
