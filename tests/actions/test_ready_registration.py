"""A training process counts as a participant of the ready step from its first connection (its watcher
registers it), not from its first checkpoint report: a notice that comes before any save still waits for its
emergency checkpoint before ``ready``, which is what releases the Slurm requeue and the Kubernetes eviction.
Real agent, real client processes."""

from __future__ import annotations

import asyncio
import os
import sys
import textwrap
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest

from agent.core.errors import ReportError
from agent.core.reports import Report, parse_report
from tests.support import REPO, SSEClient, http_json, running_agent

# A training job that has not saved yet: it watches, and on the notice prints it, then saves its emergency
# checkpoint once the test says so (a line on stdin), so the order is the test's alone.
JOB = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from agent.client import CheckpointStore, Watcher

    sock, root = sys.argv[1], Path(sys.argv[2])
    store = CheckpointStore(root, socket_path=sock)
    with Watcher(sock) as watcher:
        trigger = watcher.wait(120)
        print("notice", trigger.notice_id if trigger else None, flush=True)
        sys.stdin.readline()
        store.save(1, lambda d: (d / "state").write_bytes(b"x"), emergency=True, notice_id=trigger.notice_id)
        store.close(10)
    print("saved", flush=True)
    """
)

NOW = datetime(2026, 1, 1, tzinfo=timezone.utc)


def environ() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREEMPTD_")}
    for name in ("RANK", "WORLD_SIZE", "SLURM_JOB_ID", "TORCHELASTIC_RUN_ID", "JOB_ID"):
        env.pop(name, None)
    env["PYTHONPATH"] = str(REPO)
    return env


async def test_a_job_that_has_not_saved_yet_is_waited_for_until_its_emergency_checkpoint(base: Path) -> None:
    """Registered at connection, no checkpoint yet, a drill: no ready until the job reports its emergency
    save, then ready for all participants."""
    registered = asyncio.Event()

    def seen(report: Report) -> None:
        if report.kind == "participant":
            registered.set()

    async with running_agent(base, {"actions.ready.grace_s": 300.0}) as agent:
        sock = agent.config.socket
        agent.hooks.on_report(seen)
        job = await asyncio.create_subprocess_exec(
            sys.executable, "-c", JOB, str(sock), str(base / "ckpt"), env=environ(), cwd=str(REPO),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        events = await SSEClient.connect(sock)
        try:
            assert job.stdin is not None and job.stdout is not None
            await asyncio.wait_for(registered.wait(), 60)
            status, drill = await http_json(sock, "POST", "/v1/drills", {"kind": "termination", "in_s": 600})
            notice_id = drill["notice"]["id"]
            told = await asyncio.wait_for(job.stdout.readline(), 60)
            _, before = await http_json(sock, "GET", "/v1/status")
            job.stdin.write(b"save\n")
            await job.stdin.drain()
            ready = await events.until(lambda e: e["type"] == "ready", timeout=60)
            saved = await asyncio.wait_for(job.stdout.readline(), 60)
        finally:
            await events.close()
            if job.returncode is None:
                job.kill()
            await job.wait()
    waiting = before["actions"]["ready"]["notices"][notice_id]
    key = f"-c@{job.pid}"
    assert (201, f"notice {notice_id}\n".encode(), b"saved\n") == (status, told, saved)
    assert ("waiting", [key], [key]) == (waiting["state"], waiting["participants"], waiting["missing"])
    assert (notice_id, "all_participants", [key]) == (
        ready["data"]["notice_id"],
        ready["data"]["reason"],
        ready["data"]["finished"],
    )
    assert [] == [e for e in events.received if e["type"] == "ready" and e is not ready]


async def test_preemptd_watch_is_not_a_participant(base: Path) -> None:
    """``preemptd watch`` follows the events without registering: with no participant, a drill is ready at
    once (``without_participants = "immediately"``)."""
    subscribed = asyncio.Event()
    async with running_agent(base, {"actions.ready.without_participants": "immediately"}) as agent:
        sock = agent.config.socket
        agent.hooks.on_subscriber(lambda peer: subscribed.set())
        watch = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "agent", "watch", env={**environ(), "PREEMPTD_SOCKET": str(sock)},
            cwd=str(REPO), stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
        )  # fmt: skip
        try:
            await asyncio.wait_for(subscribed.wait(), 60)
            events = await SSEClient.connect(sock)
            try:
                await http_json(sock, "POST", "/v1/drills", {"kind": "termination", "in_s": 600})
                ready = await events.until(lambda e: e["type"] == "ready", timeout=60)
            finally:
                await events.close()
        finally:
            watch.terminate()
            await watch.wait()
    assert ("no_participants", []) == (ready["data"]["reason"], ready["data"]["participants"])


def test_a_registration_report_is_accepted() -> None:
    """``{"kind": "participant", "phase": "registered"}`` with ``client.participant`` is a valid report."""
    report = parse_report(
        {"kind": "participant", "phase": "registered", "client": {"name": "train.py", "participant": True}},
        NOW,
        peer_pid=7,
    )
    assert ("participant", "registered", True) == (report.kind, report.phase, report.client["participant"])


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        (
            {"kind": "participant", "phase": "registered", "client": {"name": "x"}},
            "a 'participant' report registers the process as a participant: it needs 'client.participant': true",
        ),
        (
            {"kind": "participant", "phase": "finished", "client": {"participant": True}},
            "field 'phase' of a 'participant' report must be one of 'registered', got 'finished'",
        ),
        (
            {"kind": "checkpoint", "phase": "registered"},
            "field 'phase' of a 'checkpoint' report must be one of 'started', 'finished', 'failed', got"
            " 'registered'",
        ),
    ],
    ids=["without-participant-flag", "participant-finished", "checkpoint-registered"],
)
def test_a_malformed_registration_is_refused_naming_what_to_send(doc: dict[str, Any], message: str) -> None:
    """A registration without ``client.participant``, or a phase of the other kind, is refused by field."""
    with pytest.raises(ReportError) as refused:
        parse_report(doc, NOW)
    assert message == str(refused.value)
