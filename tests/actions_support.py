"""Helpers for the actions tests: notices and events, and real child processes that handle or ignore
signals (they print ``ready`` once their handlers are installed, so tests wait on that, never on a sleep)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import sys
import uuid
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

from agent.core.notice import Event, EventType, Kind, Notice, Severity, utcnow

# Writes the name of the first SIGTERM/SIGUSR1 it gets to argv[1], then exits 0.
HANDLER = """
import pathlib, signal, sys
out = pathlib.Path(sys.argv[1])
def on(sig, frame):
    out.write_text(signal.Signals(sig).name)
    sys.exit(0)
signal.signal(signal.SIGTERM, on)
signal.signal(signal.SIGUSR1, on)
print("ready", flush=True)
while True:
    signal.pause()
"""

# Ignores SIGTERM and SIGUSR1: only an escalation (SIGKILL) ends it.
IGNORER = """
import signal
signal.signal(signal.SIGTERM, signal.SIG_IGN)
signal.signal(signal.SIGUSR1, signal.SIG_IGN)
print("ready", flush=True)
while True:
    signal.pause()
"""


def make_notice(
    kind: Kind = Kind.TERMINATION,
    *,
    severity: Severity | None = None,
    source: str = "drill",
    deadline_in: float | None = 120.0,
    drill: bool = True,
    detail: Mapping[str, Any] | None = None,
) -> Notice:
    now = utcnow()
    return Notice(
        id=f"{source}-{uuid.uuid4().hex[:16]}",
        kind=kind,
        severity=severity or Severity.CRITICAL,
        source=source,
        key=f"{source}/test",
        reason="test notice",
        detected_at=now,
        updated_at=now,
        deadline=now + timedelta(seconds=deadline_in) if deadline_in is not None else None,
        drill=drill,
        detail=dict(detail or {}),
    )


_seq = itertools.count(1)


def event(kind: EventType, notice: Notice | None, data: Mapping[str, Any] | None = None) -> Event:
    return Event(seq=next(_seq), type=kind, time=utcnow(), notice=notice, data=dict(data or {}))


class Child:
    """A real Python child process running ``script`` with ``args``; started and stopped by the test."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    @property
    def pid(self) -> int:
        return self.proc.pid

    @classmethod
    async def start(cls, script: str, *args: str, timeout: float = 10.0) -> Child:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", script, *args, stdout=asyncio.subprocess.PIPE
        )
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), timeout)
        assert b"ready\n" == line
        return cls(proc)

    async def wait(self, timeout: float = 10.0) -> int:
        return await asyncio.wait_for(self.proc.wait(), timeout)

    async def stop(self) -> None:
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
            await self.proc.wait()


def write_pid_file(directory: Path, pid: int) -> Path:
    path = directory / "train.pid"
    path.write_text(f"{pid}\n")
    return path
