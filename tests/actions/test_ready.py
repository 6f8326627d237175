"""The ready step: participants' emergency checkpoints, the grace, and the Azure acknowledgement."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Mapping
from typing import Any

import pytest
from structlog.testing import capture_logs

from agent.actions.azure_ack import AzureAcknowledger
from agent.actions.common import Recent
from agent.actions.ready import ReadyEngine
from agent.config import ReadyConfig
from agent.core.notice import EventType, Kind, Severity, utcnow
from agent.core.reports import Report
from agent.core.tasks import TaskSet
from tests.actions_support import event, make_notice


class Harness:
    def __init__(self) -> None:
        self.tasks = TaskSet("test")
        self.published: list[tuple[str, dict[str, Any]]] = []

    def engine(self, **settings: Any) -> ReadyEngine:
        def publish(notice_id: str, data: Mapping[str, Any]) -> None:
            self.published.append((notice_id, dict(data)))

        return ReadyEngine(ReadyConfig(**settings), publish=publish, tasks=self.tasks)


@pytest.fixture
async def harness() -> AsyncIterator[Harness]:
    h = Harness()
    yield h
    await h.tasks.close(2.0)


def report(
    rank: int,
    phase: str = "started",
    *,
    emergency: bool = False,
    participant: bool = True,
    notice_id: str | None = None,
) -> Report:
    return Report(
        kind="checkpoint",
        phase=phase,
        received_at=utcnow(),
        duration_s=1.0 if phase == "finished" else None,
        emergency=emergency,
        notice_id=notice_id,
        client={"job": "llm", "rank": rank, "participant": participant, "pid": os.getpid()},
        peer_pid=os.getpid(),
    )


async def test_ready_comes_when_every_participant_has_saved(harness: Harness) -> None:
    engine = harness.engine()
    engine.on_report(report(0))
    engine.on_report(report(1))
    notice = make_notice(deadline_in=120)
    engine.on_event(event(EventType.NOTICE, notice))
    engine.on_report(report(0, "finished", emergency=True, notice_id=notice.id))
    assert [] == harness.published
    engine.on_report(report(1, "finished", emergency=True))
    [(notice_id, data)] = harness.published
    assert (notice.id, "all_participants", ["llm#0", "llm#1"], []) == (
        notice_id,
        data["reason"],
        data["finished"],
        data["missing"],
    )
    assert 100 < data["margin_s"] <= 120
    assert 0 <= data["notice_to_ready_s"] < 20


async def test_a_participant_repeating_its_report_is_logged_once_per_outcome(harness: Harness) -> None:
    """A client that sends its emergency report over and over (a bug, or on purpose) cannot grow the log:
    one ``ready_participant_done`` line per participant and outcome."""
    engine = harness.engine()
    for rank in (0, 1):
        engine.on_report(report(rank))
    notice = make_notice(deadline_in=120)
    engine.on_event(event(EventType.NOTICE, notice))
    with capture_logs() as logs:
        for _ in range(200):
            engine.on_report(report(0, "failed", emergency=True, notice_id=notice.id))
        engine.on_report(report(0, "finished", emergency=True, notice_id=notice.id))
    assert [("llm#0", "failed"), ("llm#0", "finished")] == [
        (e["participant"], e["phase"]) for e in logs if e["event"] == "ready_participant_done"
    ]
    assert [] == harness.published  # rank 1 has not saved yet


def registration(rank: int) -> Report:
    """A participant's registration, as the client's watcher sends it when its stream opens."""
    return Report(
        kind="participant",
        phase="registered",
        received_at=utcnow(),
        client={"job": "llm", "rank": rank, "participant": True, "pid": os.getpid()},
        peer_pid=os.getpid(),
    )


async def test_a_registration_during_the_wait_is_waited_for_too(harness: Harness) -> None:
    """A process whose registration lands after the notice (it raced the notice, or the process started
    during it) has seen the notice: ready waits for its emergency save as well."""
    engine = harness.engine()
    engine.on_report(registration(0))
    notice = make_notice(deadline_in=120)
    engine.on_event(event(EventType.NOTICE, notice))
    engine.on_report(registration(1))
    engine.on_report(report(0, "finished", emergency=True, notice_id=notice.id))
    assert [] == harness.published
    engine.on_report(report(1, "finished", emergency=True, notice_id=notice.id))
    [(_, data)] = harness.published
    assert ("all_participants", ["llm#0", "llm#1"]) == (data["reason"], data["finished"])


async def test_status_shows_notice_to_ready_time_and_margin(harness: Harness) -> None:
    engine = harness.engine()
    engine.on_report(report(0))
    notice = make_notice(deadline_in=60)
    engine.on_event(event(EventType.NOTICE, notice))
    engine.on_report(report(0, "finished", emergency=True))
    shown = engine.status()["notices"][notice.id]
    assert ("ready", "all_participants") == (shown["state"], shown["reason"])
    assert {"notice_to_ready_s", "margin_s", "ready_at"} <= shown.keys()


async def test_the_grace_declares_ready_when_a_participant_never_reports(harness: Harness) -> None:
    engine = harness.engine(grace_s=0.2)
    engine.on_report(report(0))
    engine.on_report(report(1))
    notice = make_notice()
    engine.on_event(event(EventType.NOTICE, notice))
    engine.on_report(report(0, "finished", emergency=True))
    await harness.tasks.drain()
    [(_, data)] = harness.published
    assert ("grace", ["llm#1"]) == (data["reason"], data["missing"])


async def test_the_grace_never_runs_past_the_deadline_margin(harness: Harness) -> None:
    engine = harness.engine(grace_s=600, deadline_margin_s=5)
    engine.on_report(report(0))
    notice = make_notice(deadline_in=5.3)
    engine.on_event(event(EventType.NOTICE, notice))
    assert engine.status()["notices"][notice.id]["grace_s"] <= 0.3
    await harness.tasks.drain()
    assert ["grace"] == [data["reason"] for _, data in harness.published]


async def test_without_participants_ready_can_be_immediate(harness: Harness) -> None:
    engine = harness.engine(without_participants="immediately")
    engine.on_event(event(EventType.NOTICE, make_notice()))
    await harness.tasks.drain()
    assert ["no_participants"] == [data["reason"] for _, data in harness.published]


async def test_a_participant_whose_process_is_gone_is_not_waited_for(harness: Harness) -> None:
    engine = harness.engine(without_participants="immediately")
    gone = report(0)
    engine.on_report(
        Report(**{**gone.__dict__, "client": {**gone.client, "pid": 2**22 + 7}, "peer_pid": None})
    )
    engine.on_event(event(EventType.NOTICE, make_notice()))
    await harness.tasks.drain()
    assert [([], "no_participants")] == [(d["participants"], d["reason"]) for _, d in harness.published]


async def test_a_cleared_notice_never_becomes_ready(harness: Harness) -> None:
    engine = harness.engine(grace_s=0.1)
    engine.on_report(report(0))
    notice = make_notice()
    engine.on_event(event(EventType.NOTICE, notice))
    engine.on_event(event(EventType.CLEARED, notice))
    await harness.tasks.drain()
    assert [] == harness.published
    assert "cleared" == engine.status()["notices"][notice.id]["state"]


async def test_notices_of_other_kinds_need_no_ready(harness: Harness) -> None:
    engine = harness.engine(without_participants="immediately")
    engine.on_event(event(EventType.NOTICE, make_notice(Kind.GPU_DEGRADED, severity=Severity.WARNING)))
    await harness.tasks.drain()
    assert [] == harness.published


async def test_ready_is_published_once_per_notice(harness: Harness) -> None:
    engine = harness.engine()
    engine.on_report(report(0))
    notice = make_notice()
    engine.on_event(event(EventType.NOTICE, notice))
    engine.on_report(report(0, "finished", emergency=True))
    engine.on_event(event(EventType.UPDATE, notice))
    engine.on_report(report(0, "finished", emergency=True))
    assert 1 == len(harness.published)


class FakeAzure:
    """Stands in for the Azure source's ``acknowledge`` (the source itself is tested against IMDS)."""

    def __init__(self) -> None:
        self.acknowledged: list[str] = []

    async def acknowledge(self, event_id: str) -> None:
        self.acknowledged.append(event_id)


def azure_notice(drill: bool = False) -> Any:
    return make_notice(source="azure", drill=drill, detail={"EventId": "C7061BAC-1", "EventType": "Preempt"})


@pytest.mark.parametrize(
    ("mode", "on", "expected"),
    [
        ("on_ready", EventType.READY, ["C7061BAC-1"]),
        ("on_ready", EventType.NOTICE, []),
        ("immediately", EventType.NOTICE, ["C7061BAC-1"]),
        ("never", EventType.READY, []),
    ],
)
async def test_azure_is_acknowledged_as_configured(mode: str, on: EventType, expected: list[str]) -> None:
    tasks, recent, azure = TaskSet("t"), Recent(10), FakeAzure()
    AzureAcknowledger(mode, source=lambda name: azure, tasks=tasks, recent=recent).handle(
        event(on, azure_notice()), azure_notice()
    )
    await tasks.drain()
    assert expected == azure.acknowledged


async def test_a_drill_is_never_acknowledged_to_azure() -> None:
    tasks, recent, azure = TaskSet("t"), Recent(10), FakeAzure()
    notice = azure_notice(drill=True)
    AzureAcknowledger("on_ready", source=lambda name: azure, tasks=tasks, recent=recent).handle(
        event(EventType.READY, notice), notice
    )
    await tasks.drain()
    assert ([], "skipped_drill") == (azure.acknowledged, recent.to_json()[0]["outcome"])


async def test_a_failed_acknowledgement_is_recorded() -> None:
    class Refusing:
        async def acknowledge(self, event_id: str) -> None:
            raise RuntimeError("IMDS answered 400")

    tasks, recent = TaskSet("t"), Recent(10)
    notice = azure_notice()
    AzureAcknowledger("on_ready", source=lambda name: Refusing(), tasks=tasks, recent=recent).handle(
        event(EventType.READY, notice), notice
    )
    await tasks.drain()
    assert ("failed", "RuntimeError: IMDS answered 400") == (
        recent.to_json()[0]["outcome"],
        recent.to_json()[0]["error"],
    )
