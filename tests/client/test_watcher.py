"""The threaded and asyncio watchers against a real agent on a temporary Unix socket."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from agent.client import Backoff, Notice, Watcher
from agent.client.aio import AsyncWatcher
from agent.core.notice import Kind
from agent.core.reports import Report
from agent.service.daemon import Agent
from tests.support import agent_config, http_json, running_agent


async def drill(socket_path: Path, in_s: float = 30.0, kind: str = "termination") -> str:
    status, body = await http_json(socket_path, "POST", "/v1/drills", {"kind": kind, "in_s": in_s})
    assert status == 201, body
    return str(body["notice"]["id"])


async def test_drill_notice_reaches_the_watcher_with_its_deadline(base: Path) -> None:
    async with running_agent(base, components=[]):
        with Watcher(base / "a.sock") as watcher:
            assert await asyncio.to_thread(watcher.wait_connected, 10)
            notice_id = await drill(base / "a.sock", in_s=30)
            trigger = await asyncio.to_thread(watcher.wait, 10)
            left = watcher.time_left()
    assert trigger is not None and left is not None
    assert (notice_id, "termination", True) == (trigger.notice_id, trigger.notice.kind, 25 < left <= 30)


async def test_watcher_started_before_the_agent_delivers_the_next_notice(base: Path) -> None:
    with Watcher(base / "a.sock", backoff=Backoff(0.02, 0.2)) as watcher:
        assert not watcher.connected
        async with running_agent(base, components=[]):
            assert await asyncio.to_thread(watcher.wait_connected, 10)
            notice_id = await drill(base / "a.sock")
            trigger = await asyncio.to_thread(watcher.wait, 10)
    assert trigger is not None
    assert notice_id == trigger.notice_id


@pytest.mark.slow
async def test_watcher_reconnects_after_an_agent_restart(base: Path) -> None:
    # A participant, as by default: its registration races the first agent's stop, which must close every
    # connection it accepted (tests/service/test_shutdown_connections.py).
    with Watcher(base / "a.sock", backoff=Backoff(0.02, 0.2)) as watcher:
        async with running_agent(base, components=[]):
            assert await asyncio.to_thread(watcher.wait_connected, 10)
        async with running_agent(base, components=[]):
            notice_id = await drill(base / "a.sock")
            trigger = await asyncio.to_thread(watcher.wait, 10)
    assert trigger is not None
    assert (notice_id, 2) == (trigger.notice_id, watcher.connects)


async def test_cleared_drill_calls_on_cleared_and_leaves_no_notice(base: Path) -> None:
    cleared: asyncio.Queue[Notice] = asyncio.Queue()
    loop = asyncio.get_running_loop()
    async with running_agent(base, components=[]):
        watcher = Watcher(
            base / "a.sock", on_cleared=lambda n: loop.call_soon_threadsafe(cleared.put_nowait, n)
        )
        with watcher:
            assert await asyncio.to_thread(watcher.wait_connected, 10)
            notice_id = await drill(base / "a.sock")
            assert await asyncio.to_thread(watcher.wait, 10) is not None
            status, _ = await http_json(base / "a.sock", "DELETE", f"/v1/drills/{notice_id}")
            gone = await asyncio.wait_for(cleared.get(), 10)
            assert (200, notice_id, None, False) == (
                status,
                gone.id,
                watcher.notice,
                watcher.should_checkpoint(),
            )


async def test_acknowledge_ends_should_checkpoint_for_that_notice(base: Path) -> None:
    async with running_agent(base, components=[]):
        with Watcher(base / "a.sock") as watcher:
            assert await asyncio.to_thread(watcher.wait_connected, 10)
            await drill(base / "a.sock")
            assert await asyncio.to_thread(watcher.wait, 10) is not None
            watcher.acknowledge()
            assert (False, True) == (watcher.should_checkpoint(), watcher.notice is not None)


def test_signal_raises_the_same_trigger_as_a_notice(base: Path) -> None:
    with Watcher(base / "a.sock", signals=[signal.SIGUSR1]) as watcher:
        os.kill(os.getpid(), signal.SIGUSR1)
        trigger = watcher.wait(10)
        assert trigger is not None
        assert (True, "signal", signal.SIGUSR1) == (
            watcher.should_checkpoint(),
            trigger.reason,
            trigger.signum,
        )


def test_stop_restores_the_previous_signal_handler(base: Path) -> None:
    before = signal.getsignal(signal.SIGUSR1)
    with Watcher(base / "a.sock", signals=[signal.SIGUSR1]):
        pass
    assert before == signal.getsignal(signal.SIGUSR1)


def test_wait_times_out_without_a_trigger(base: Path) -> None:
    with Watcher(base / "a.sock") as watcher:
        assert watcher.wait(0.05) is None


async def test_async_watcher_receives_a_drill(base: Path) -> None:
    async with running_agent(base, components=[]), AsyncWatcher(base / "a.sock") as watcher:
        assert await watcher.wait_connected(10)
        notice_id = await drill(base / "a.sock")
        trigger = await watcher.wait(10)
    assert trigger is not None
    assert notice_id == trigger.notice_id


async def test_async_watcher_started_before_the_agent_connects_later(base: Path) -> None:
    watcher = AsyncWatcher(base / "a.sock", backoff=Backoff(0.02, 0.2))
    async with watcher, running_agent(base, components=[]):  # the watcher starts first
        assert await watcher.wait_connected(10)
        notice_id = await drill(base / "a.sock")
        trigger = await watcher.wait(10)
    assert trigger is not None
    assert notice_id == trigger.notice_id


async def test_async_watcher_turns_a_signal_into_a_trigger(base: Path) -> None:
    async with AsyncWatcher(base / "a.sock", signals=[signal.SIGUSR1]) as watcher:
        os.kill(os.getpid(), signal.SIGUSR1)
        trigger = await watcher.wait(10)
    assert trigger is not None
    assert ("signal", signal.SIGUSR1) == (trigger.reason, trigger.signum)


@pytest.mark.slow
async def test_reconnect_with_last_event_id_replays_what_happened_while_disconnected(base: Path) -> None:
    """A notice raised and cleared while the watcher was away still reaches it, and nothing it already had is
    announced again: a plain reconnect would get a snapshot (the first drill again, not the second one)."""
    seen: asyncio.Queue[tuple[str, str]] = asyncio.Queue()
    loop = asyncio.get_running_loop()

    def record(kind: str) -> Callable[[Notice], None]:
        return lambda n: loop.call_soon_threadsafe(seen.put_nowait, (kind, n.id))

    async with running_agent(base, components=[]) as agent:
        watcher = Watcher(
            base / "a.sock",
            backoff=Backoff(0.3, 0.3),
            on_notice=record("notice"),
            on_cleared=record("cleared"),
        )
        with watcher:
            first = agent.drills.drill(Kind.TERMINATION, 30.0, None, "drill while connected", {})
            assert ("notice", first.id) == await asyncio.wait_for(seen.get(), 10)
            for sub in list(agent.hub.subscribers):
                sub.kick("test: drop the stream")
            notice = agent.drills.drill(Kind.TERMINATION, 30.0, None, "drill while away", {})
            agent.retract(notice.source, notice.key, "over")
            got = [await asyncio.wait_for(seen.get(), 10) for _ in range(2)]
    assert [("notice", notice.id), ("cleared", notice.id)] == got
    assert 2 == watcher.connects


@pytest.mark.slow
async def test_drill_past_its_deadline_does_not_trigger_a_job_started_after_it(base: Path) -> None:
    """A drill lingers for drill_linger_s after its deadline; a job that starts then has nothing to save."""
    seen: asyncio.Queue[Notice] = asyncio.Queue()
    loop = asyncio.get_running_loop()
    async with running_agent(base, components=[], settings={"drill_linger_s": 30.0}):
        with Watcher(base / "a.sock") as early:
            assert await asyncio.to_thread(early.wait_connected, 10)
            notice_id = await drill(base / "a.sock", in_s=0)
            assert await asyncio.to_thread(early.wait, 10) is not None
            late = Watcher(base / "a.sock", on_notice=lambda n: loop.call_soon_threadsafe(seen.put_nowait, n))
            with late:
                arrived = await asyncio.wait_for(seen.get(), 10)
                assert (notice_id, False, True) == (
                    arrived.id,
                    late.should_checkpoint(),
                    early.should_checkpoint(),
                )


class Registrations:
    """The participant registrations an agent receives, and an event per arrival."""

    def __init__(self) -> None:
        self.found: list[Report] = []
        self.arrived = asyncio.Event()

    def __call__(self, report: Report) -> None:
        if report.kind == "participant":
            self.found.append(report)
            self.arrived.set()

    async def next(self) -> None:
        await asyncio.wait_for(self.arrived.wait(), 30)
        self.arrived.clear()


async def registrations(base: Path, make: Callable[[Path], Any], runs: int = 1) -> list[Report]:
    """The participant registrations the agent, started ``runs`` times in a row, received from the watcher
    ``make(socket)`` (started once, before the first run), waiting in each run for one to arrive."""
    seen = Registrations()
    watcher = make(base / "a.sock")
    try:
        for _ in range(runs):
            # Listening from before the socket serves: the watcher may register while the agent starts.
            agent = Agent(agent_config(base), components=[])
            agent.hooks.on_report(seen)
            await agent.start()
            try:
                await seen.next()
            finally:
                await agent.stop()
    finally:
        result = watcher.stop()
        if asyncio.iscoroutine(result):
            await result
    return seen.found


async def test_async_watcher_registers_its_process_as_a_participant(base: Path) -> None:
    """The asyncio watcher registers its process, named by ``client``, when its stream opens."""
    client = {"name": "train.py", "job": "llm", "rank": 2}
    [report] = await registrations(
        base, lambda sock: AsyncWatcher(sock, client=client, backoff=Backoff(0.02, 0.2)).start()
    )
    assert ("registered", "llm", 2, True, os.getpid()) == (
        report.phase,
        report.client["job"],
        report.client["rank"],
        report.client["participant"],
        report.peer_pid,
    )


async def test_watcher_registers_again_after_an_agent_restart(base: Path) -> None:
    """A restarted agent forgot its participants: the watcher's new stream registers the process again."""
    make = lambda sock: Watcher(sock, backoff=Backoff(0.02, 0.2)).start()  # noqa: E731
    found = await registrations(base, make, runs=2)
    assert [os.getpid(), os.getpid()] == [r.peer_pid for r in found]
