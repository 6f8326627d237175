"""End to end: examples/fault_tolerant_training.py (real torch on CPU) under a real agent.

A drill notice becomes a durable emergency checkpoint and exit status 75; the rerun resumes at exactly the
next step with the same state an uninterrupted run has; SIGTERM takes the same path; two ranks on gloo, each
with its own agent, save the same step when only one host gets a notice.
"""

from __future__ import annotations

import shutil
import signal
import socket
from pathlib import Path

import pytest

from agent.client import EXIT_PREEMPTED, CheckpointStore
from agent.core.reports import Report
from tests.support import (
    AgentProcess,
    ExampleRun,
    SSEClient,
    drill,
    running_agent,
    short_tmp,
)

pytest.importorskip("torch")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


async def interrupted_run(base: Path, ckpt: Path) -> tuple[ExampleRun, str, list[Report]]:
    """Train under an agent until a drill interrupts; returns the run, the drill's id and the reports."""
    reports: list[Report] = []
    async with running_agent(base) as agent:
        agent.hooks.on_report(reports.append)
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
