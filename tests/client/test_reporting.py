"""Reports and advice between the client and a real agent."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from agent.client import (
    CheckpointError,
    CheckpointSchedule,
    CheckpointStore,
    Reporter,
    advised_interval,
    client_info,
)
from agent.core.reports import Report
from agent.service.daemon import Agent
from tests.support import running_agent


class Advice:
    """A component serving a fixed ``GET /v1/advice`` document, standing in for the advisor."""

    name = "advice"

    def __init__(self, doc: dict[str, Any]) -> None:
        self.doc = doc

    def setup(self, agent: Agent) -> None:
        agent.hooks.add_route("GET", "/v1/advice", self.handle)

    async def handle(self, request: web.Request) -> web.Response:
        return web.json_response(self.doc)

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass


def writer(directory: Path) -> None:
    (directory / "state.bin").write_bytes(b"x" * 1000)


async def test_store_reports_started_and_finished_with_size_and_notice(base: Path) -> None:
    reports: list[Report] = []
    async with running_agent(base, components=[]) as agent:
        agent.hooks.on_report(reports.append)
        reporter = Reporter(base / "a.sock", client=client_info(name="trainer", rank=3, world_size=8))
        store = CheckpointStore(base / "ckpt", reporter=reporter)
        await asyncio.to_thread(store.save, 12, writer, emergency=True, notice_id="drill-1")
        assert await asyncio.to_thread(reporter.flush, 10)
    assert [("started", 12, None, True, "drill-1"), ("finished", 12, 1000, True, "drill-1")] == [
        (r.phase, r.step, r.bytes, r.emergency, r.notice_id) for r in reports
    ]
    assert ("trainer", 3, 8, True) == tuple(
        reports[1].client[k] for k in ("name", "rank", "world_size", "participant")
    )


async def test_failed_save_is_reported_as_failed(base: Path) -> None:
    reports: list[Report] = []

    def broken(directory: Path) -> None:
        raise OSError("no space left")

    async with running_agent(base, components=[]) as agent:
        agent.hooks.on_report(reports.append)
        reporter = Reporter(base / "a.sock")
        store = CheckpointStore(base / "ckpt", reporter=reporter)
        with pytest.raises(CheckpointError, match="no space left"):
            await asyncio.to_thread(store.save, 1, broken)
        assert await asyncio.to_thread(reporter.flush, 10)
    assert ["started", "failed"] == [r.phase for r in reports]


def test_reporter_without_an_agent_drops_reports_without_blocking(base: Path) -> None:
    reporter = Reporter(base / "none.sock")
    reporter.checkpoint("started", 1)
    assert (True, 1, 0) == (reporter.flush(10), reporter.failed, reporter.sent)


async def test_schedule_uses_the_fixed_interval_while_the_agent_has_no_advice(base: Path) -> None:
    async with running_agent(base, components=[]):
        schedule = CheckpointSchedule(600.0, base / "a.sock")
        await asyncio.to_thread(schedule.refresh)
    assert (600.0, False) == (schedule.interval_s, schedule.advised)


async def test_schedule_uses_the_advised_interval(base: Path) -> None:
    async with running_agent(base, components=[Advice({"interval_s": 1234.5})]):
        schedule = CheckpointSchedule(600.0, base / "a.sock")
        await asyncio.to_thread(schedule.refresh)
    assert (1234.5, True) == (schedule.interval_s, schedule.advised)


async def test_schedule_falls_back_when_advice_has_no_interval_yet(base: Path) -> None:
    async with running_agent(base, components=[Advice({"interval_s": None, "reason": "not enough data"})]):
        schedule = CheckpointSchedule(600.0, base / "a.sock")
        await asyncio.to_thread(schedule.refresh)
    assert 600.0 == schedule.interval_s


async def test_schedule_bounds_the_advised_interval(base: Path) -> None:
    async with running_agent(base, components=[Advice({"interval_s": 5.0})]):
        schedule = CheckpointSchedule(600.0, base / "a.sock", min_interval_s=60.0, max_interval_s=3600.0)
        await asyncio.to_thread(schedule.refresh)
    assert 60.0 == schedule.interval_s


def test_schedule_is_due_after_the_interval() -> None:
    now = [100.0]
    schedule = CheckpointSchedule(10.0, "/nonexistent", use_advice=False, clock=lambda: now[0])
    before = schedule.due()
    now[0] = 110.0
    assert (False, True) == (before, schedule.due())


def test_advised_interval_rejects_non_positive_and_non_numbers() -> None:
    docs: list[dict[str, Any] | None] = [
        None,
        {},
        {"interval_s": 0},
        {"interval_s": "60"},
        {"interval_s": True},
    ]
    assert [None] * 5 == [advised_interval(d) for d in docs]
