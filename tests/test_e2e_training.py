"""End to end: examples/fault_tolerant_training.py (real torch on CPU) under a real agent.

A drill notice becomes a durable emergency checkpoint and exit status 75; the rerun resumes at exactly the
next step with the same state an uninterrupted run has; SIGTERM takes the same path; two ranks on gloo, each
with its own agent, save the same step when only one host gets a notice.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from agent.client import EXIT_PREEMPTED, CheckpointStore
from agent.core.reports import Report
from tests.support import REPO, AgentProcess, SSEClient, http_json, running_agent, short_tmp

pytest.importorskip("torch")

EXAMPLE = REPO / "examples" / "fault_tolerant_training.py"
pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


class ExampleRun:
    """The example as a child process; its JSON-lines progress is read as it comes."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.events: list[dict[str, Any]] = []
        self._seen = 0

    @classmethod
    async def start(cls, *args: str, env: Mapping[str, str] | None = None) -> ExampleRun:
        environ = {k: v for k, v in os.environ.items() if not k.startswith("PREEMPTD_")}
        environ.update({"PYTHONPATH": str(REPO), **(env or {})})
        proc = await asyncio.create_subprocess_exec(
            sys.executable, str(EXAMPLE), *args, env=environ, cwd=str(REPO),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        return cls(proc)

    async def until(self, event: str, timeout: float = 60.0) -> dict[str, Any]:
        """The next progress line of this kind (earlier unread lines are skipped over)."""
        return await asyncio.wait_for(self._until(event), timeout)

    async def _until(self, event: str) -> dict[str, Any]:
        assert self.proc.stdout is not None
        while True:
            while self._seen < len(self.events):
                doc = self.events[self._seen]
                self._seen += 1
                if doc["event"] == event:
                    return doc
            line = await self.proc.stdout.readline()
            if not line:
                stderr = await self.proc.stderr.read() if self.proc.stderr else b""
                raise AssertionError(f"example ended before {event!r}: {stderr.decode()[-3000:]}")
            self.events.append(json.loads(line))

    async def finish(self, timeout: float = 60.0) -> int:
        assert self.proc.stdout is not None and self.proc.stderr is not None
        rest, stderr = await asyncio.wait_for(self.proc.communicate(), timeout)
        self.events.extend(json.loads(line) for line in rest.decode().splitlines() if line.strip())
        assert self.proc.returncode is not None
        if self.proc.returncode not in (0, EXIT_PREEMPTED):
            raise AssertionError(f"example failed with {self.proc.returncode}: {stderr.decode()[-3000:]}")
        return self.proc.returncode

    def of(self, event: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["event"] == event]


async def drill(socket_path: Path, in_s: float = 30.0) -> str:
    status, body = await http_json(socket_path, "POST", "/v1/drills", {"kind": "termination", "in_s": in_s})
    assert status == 201, body
    return str(body["notice"]["id"])


async def interrupted_run(base: Path, ckpt: Path) -> tuple[ExampleRun, str, list[Report]]:
    """Train under an agent until a drill interrupts; returns the run, the drill's id and the reports."""
    reports: list[Report] = []
    async with running_agent(base) as agent:
        agent.on_report(reports.append)
        sock = base / "a.sock"
        run = await ExampleRun.start(
            "--checkpoint-dir", str(ckpt), "--steps", "100000", "--step-time", "0.01", "--socket", str(sock)
        )
        await run.until("agent_connected")
        notice_id = await drill(sock)
        await run.finish()
    return run, notice_id, reports


async def test_drill_gives_durable_emergency_checkpoint_and_exit_75(base: Path) -> None:
    run, notice_id, reports = await interrupted_run(base, base / "ckpt")
    [checkpoint] = run.of("checkpoint")
    latest = CheckpointStore(base / "ckpt" / "rank-0", report=False).latest()
    assert latest is not None
    assert (EXIT_PREEMPTED, True, True) == (
        run.proc.returncode,
        checkpoint["emergency"],
        checkpoint["before_deadline"],
    )
    assert (checkpoint["step"], True, notice_id) == (latest.step, latest.emergency, latest.notice_id)
    finished = [r for r in reports if r.phase == "finished"]
    assert [(latest.step, True, notice_id)] == [(r.step, r.emergency, r.notice_id) for r in finished]


async def test_rerun_resumes_at_next_step_with_identical_state(base: Path) -> None:
    ckpt = base / "ckpt"
    run, _, _ = await interrupted_run(base, ckpt)
    [saved] = run.of("checkpoint")
    total = str(saved["step"] + 3)
    nowhere = str(base / "none.sock")

    resumed = await ExampleRun.start("--checkpoint-dir", str(ckpt), "--steps", total, "--socket", nowhere)
    await resumed.finish()
    reference = await ExampleRun.start(
        "--checkpoint-dir", str(base / "ref"), "--steps", total, "--socket", nowhere
    )
    await reference.finish()

    [start] = resumed.of("resumed")
    assert (saved["step"], saved["digest"]) == (start["next_step"], start["digest"])
    assert reference.of("done")[0]["digest"] == resumed.of("done")[0]["digest"]


async def test_rerun_while_the_drill_is_still_active_is_not_stopped_again(base: Path) -> None:
    """The notice that caused the emergency checkpoint does not stop the run resumed from it."""
    async with running_agent(base):
        sock = base / "a.sock"
        first = await ExampleRun.start(
            "--checkpoint-dir",
            str(base / "ckpt"),
            "--steps",
            "100000",
            "--step-time",
            "0.01",
            "--socket",
            str(sock),
        )
        await first.until("agent_connected")
        await drill(sock, in_s=60)
        await first.finish()
        [saved] = first.of("checkpoint")
        second = await ExampleRun.start(
            "--checkpoint-dir", str(base / "ckpt"), "--steps", str(saved["step"] + 20), "--step-time", "0.01",
            "--socket", str(sock),
        )  # fmt: skip
        code = await second.finish()
    assert (0, saved["step"], []) == (code, second.of("resumed")[0]["next_step"], second.of("preempted"))


async def test_emergency_checkpoint_makes_the_agent_declare_the_notice_ready(base: Path) -> None:
    """A periodic checkpoint makes the process a participant; its emergency report lets the agent declare the
    notice ready (all participants saved) long before the deadline."""
    async with running_agent(base):
        sock = base / "a.sock"
        events = await SSEClient.connect(sock)
        try:
            run = await ExampleRun.start(
                "--checkpoint-dir", str(base / "ckpt"), "--steps", "100000", "--step-time", "0.01",
                "--interval-s", "0.05", "--socket", str(sock),
            )  # fmt: skip
            await run.until("agent_connected")
            await run.until("checkpoint")  # a periodic one: the agent now knows this participant
            notice_id = await drill(sock)
            assert EXIT_PREEMPTED == await run.finish()
            ready = await events.until(lambda e: e["type"] == "ready", timeout=30)
        finally:
            await events.close()
    assert (notice_id, "all_participants", []) == (
        ready["data"]["notice_id"], ready["data"]["reason"], ready["data"]["missing"],
    )  # fmt: skip


async def test_sigterm_takes_the_same_flush_path(base: Path) -> None:
    run = await ExampleRun.start(
        "--checkpoint-dir", str(base / "ckpt"), "--steps", "100000", "--step-time", "0.01",
        "--socket", str(base / "none.sock"),
    )  # fmt: skip
    await run.until("fresh")
    run.proc.send_signal(signal.SIGTERM)
    assert EXIT_PREEMPTED == await run.finish()
    [checkpoint] = run.of("checkpoint")
    latest = CheckpointStore(base / "ckpt" / "rank-0", report=False).latest()
    assert latest is not None
    assert (checkpoint["step"], True, None) == (latest.step, latest.emergency, latest.notice_id)


async def test_training_started_before_the_agent_still_flushes_on_its_next_notice(base: Path) -> None:
    agent = AgentProcess(base)
    run = await ExampleRun.start(
        "--checkpoint-dir", str(base / "ckpt"), "--steps", "100000", "--step-time", "0.01",
        "--socket", str(agent.socket_path),
    )  # fmt: skip
    await run.until("fresh")
    await agent.start()  # the agent as its own process: python -m agent run
    try:
        await run.until("agent_connected")
        notice_id = await drill(agent.socket_path)
        assert EXIT_PREEMPTED == await run.finish()
    finally:
        await agent.stop()
    [checkpoint] = run.of("checkpoint")
    latest = CheckpointStore(base / "ckpt" / "rank-0", report=False).latest()
    assert latest is not None
    assert (checkpoint["step"], notice_id) == (latest.step, latest.notice_id)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def _two_ranks(ckpt: Path, sockets: list[Path], *args: str) -> list[ExampleRun]:
    port = str(_free_port())
    runs = []
    for rank, sock in enumerate(sockets):
        env = {"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": port, "GLOO_SOCKET_IFNAME": "lo"}  # fmt: skip
        runs.append(
            await ExampleRun.start("--checkpoint-dir", str(ckpt), "--socket", str(sock), *args, env=env)
        )
    return runs


@pytest.mark.torch_mp
@pytest.mark.timeout(180)
async def test_notice_on_one_host_makes_both_ranks_save_the_same_step_and_resume_alike(
    base: Path, request: pytest.FixtureRequest
) -> None:
    other = short_tmp()
    request.addfinalizer(lambda: shutil.rmtree(other, ignore_errors=True))
    ckpt = base / "ckpt"
    sockets = [base / "a.sock", other / "a.sock"]
    async with running_agent(base), running_agent(other):
        runs = await _two_ranks(ckpt, sockets, "--steps", "100000", "--step-time", "0.01")
        for run in runs:
            await run.until("agent_connected")
        await drill(sockets[0])
        codes = [await run.finish() for run in runs]
    steps = [run.of("checkpoint")[0]["step"] for run in runs]
    assert [EXIT_PREEMPTED, EXIT_PREEMPTED] == codes
    assert steps[0] == steps[1]

    resumed = await _two_ranks(ckpt, sockets, "--steps", str(steps[0] + 2))
    for run in resumed:
        await run.finish()
    starts = [run.of("resumed")[0] for run in resumed]
    assert [steps[0], steps[0]] == [s["next_step"] for s in starts]
    assert starts[0]["digest"] == starts[1]["digest"]
    assert resumed[0].of("done")[0]["digest"] == resumed[1].of("done")[0]["digest"]
