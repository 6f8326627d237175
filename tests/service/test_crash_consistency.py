"""Crash consistency of a real `preemptd run` killed with SIGKILL: a cloud notice keeps its id, sequence
numbers are never used twice, and an answered drill survives."""

from __future__ import annotations

import signal
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest

from agent.core.board import NoticeBoard
from agent.core.notice import Kind, Observation
from agent.simulate import simulator_for
from tests.cloud_harness import FAST, QUIET
from tests.support import AgentProcess, SSEClient, http_json


def aws_args(url: str) -> list[str]:
    settings = {"aws.endpoint": url, **{f"aws.{k}": v for k, v in FAST["aws"].items()}, **QUIET}
    args = ["--cloud", "aws"]
    for key, value in settings.items():
        args += ["--set", f"{key}={str(value).lower() if isinstance(value, bool) else value}"]
    return args


async def first_notice(client: SSEClient) -> tuple[dict[str, Any], dict[str, Any]]:
    """The snapshot and the first event (or snapshot entry) that carries a notice."""
    snapshot = await client.next()
    assert "snapshot" == snapshot["type"]
    if snapshot["notices"]:
        return snapshot, snapshot["notices"][0]
    event = await client.until(lambda e: e["type"] == "notice", timeout=20)
    return snapshot, event["notice"]


@pytest.mark.slow
async def test_sigkill_before_the_state_write_keeps_the_notice_id_and_never_reuses_a_sequence_number(
    base: Path,
) -> None:
    async with simulator_for("aws") as sim:
        agent = AgentProcess(base, extra_args=aws_args(sim.url))
        await agent.start()
        client = await SSEClient.connect(agent.socket_path)
        before = (base / "state" / "state.json").read_bytes()
        sim.trigger({"type": "spot", "action": "terminate", "in_s": 120})
        _, seen = await first_notice(client)
        last_seq = int(client.last_event_id or 0)
        await agent.stop(signal.SIGKILL)
        await client.close()
        # What a crash within the write window leaves on disk: the state from before the notice.
        (base / "state" / "state.json").write_bytes(before)

        again = AgentProcess(base, extra_args=aws_args(sim.url))
        await again.start()
        try:
            client = await SSEClient.connect(again.socket_path)
            snapshot, restored = await first_notice(client)
            sim.trigger({"type": "spot", "action": "terminate", "in_s": 30})
            update = await client.until(lambda e: e["type"] == "update", timeout=20)
            await client.close()
        finally:
            await again.stop()
    assert seen["id"] == restored["id"] == update["notice"]["id"]
    assert snapshot["seq"] >= last_seq
    assert update["seq"] > last_seq


@pytest.mark.slow
async def test_an_answered_drill_survives_a_sigkill_right_after_the_answer(base: Path) -> None:
    agent = AgentProcess(base)
    await agent.start()
    status, body = await http_json(agent.socket_path, "POST", "/v1/drills", {"in_s": 600})
    assert agent.proc is not None
    agent.proc.send_signal(signal.SIGKILL)
    await agent.stop()
    again = AgentProcess(base)
    await again.start()
    try:
        _, doc = await http_json(again.socket_path, "GET", "/v1/status")
    finally:
        await again.stop()
    assert 201 == status
    assert [body["notice"]["id"]] == [n["id"] for n in doc["notices"]]


NOW = datetime(2026, 12, 3, tzinfo=timezone.utc)
SPOT = Observation(key="spot/instance-action", kind=Kind.TERMINATION, reason="spot")


def raised_id(board: NoticeBoard, obs: Observation, source: str = "aws") -> str:
    change = board.observe(source, obs, NOW)
    assert change is not None
    return change.notice.id


def test_the_same_event_gets_the_same_id_on_a_fresh_board_of_the_same_boot() -> None:
    first = raised_id(NoticeBoard(scope="boot-1"), SPOT)
    assert first == raised_id(NoticeBoard(scope="boot-1"), SPOT)
    assert first != raised_id(NoticeBoard(scope="boot-2"), SPOT)
    assert first.startswith("aws-")


def test_a_cloud_event_id_identifies_the_notice_across_boots() -> None:
    obs = Observation(key="scheduledevents/E-1", kind=Kind.MAINTENANCE, reason="x", detail={"EventId": "E-1"})
    assert raised_id(NoticeBoard(scope="boot-1"), obs, "azure") == raised_id(
        NoticeBoard(scope="boot-2"), obs, "azure"
    )


def test_a_condition_that_ends_and_comes_back_is_a_new_notice_also_after_a_restart() -> None:
    board = NoticeBoard(scope="boot-1")
    first = raised_id(board, SPOT)
    board.clear("aws", SPOT.key, NOW)
    second = raised_id(board, SPOT)
    restarted = NoticeBoard(scope="boot-1")
    restarted.restore([], board.occurrences())
    assert first != second == raised_id(restarted, SPOT)
