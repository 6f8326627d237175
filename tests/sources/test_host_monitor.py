"""The psutil host monitor: memory pressure, free space for the next checkpoint, the state directory's disk;
unit tests through a recording sink and one end-to-end test through a real agent."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import psutil
import pytest

import agent.sources.host as host_module
from agent.config import HostConfig
from agent.core.notice import EventType, Kind, Observation, utcnow
from agent.core.reports import Report
from agent.sources.host import HostSource
from tests.fake_nvml.recording import RecordingSink
from tests.support import SSEClient, http_json, running_agent, threads_ended

pytestmark = pytest.mark.timeout(30)

HUGE = 1 << 60  # no test file system has this much free space


def host_config(**overrides: Any) -> HostConfig:
    base = HostConfig(poll_interval_s=0.05, raise_after=1, clear_after=1, call_timeout_s=2.0)
    return dataclasses.replace(base, **overrides)


def checkpoint(size: int, path: Path | None = None, phase: str = "finished") -> Report:
    return Report(
        kind="checkpoint",
        phase=phase,
        received_at=utcnow(),
        duration_s=1.0 if phase == "finished" else None,
        bytes=size,
        path=str(path) if path else None,
    )


@contextlib.asynccontextmanager
async def monitor(state_dir: Path, **overrides: Any) -> AsyncIterator[tuple[HostSource, RecordingSink]]:
    source = HostSource(host_config(**overrides), state_dir)
    sink = RecordingSink("host")
    task = asyncio.create_task(source.run(sink))
    try:
        await sink.wait_for(lambda: sink.health != "starting", what="the first check")
        yield source, sink
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, 5.0)


async def test_a_checkpoint_that_cannot_fit_is_flagged_at_once_and_clears(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    key = f"disk/{ckpt}"
    async with monitor(tmp_path, checkpoint_dirs=(ckpt,), poll_interval_s=60.0) as (source, sink):
        assert sink.active() == {}
        source.on_report(checkpoint(HUGE, ckpt / "step-100.pt"))
        notice = await sink.wait_active(key, timeout=5.0)
        assert (notice.kind, notice.detail["last_checkpoint_bytes"]) == (Kind.HOST_DEGRADED, HUGE)
        assert notice.reason == f"checkpoint directory {ckpt}: not enough free space for the next checkpoint"
        source.on_report(checkpoint(1024, ckpt / "step-200.pt"))
        await sink.wait_cleared(key, timeout=5.0)


async def test_without_a_report_no_checkpoint_size_is_assumed(tmp_path: Path) -> None:
    async with monitor(tmp_path, checkpoint_dirs=(tmp_path / "ckpt",)) as (source, sink):
        replaces = sink.replaces
        await sink.wait_for(lambda: sink.replaces >= replaces + 3, what="three checks")
    assert sink.active() == {}
    assert source.status()["last_checkpoint_bytes"] is None


async def test_the_directory_of_a_reported_checkpoint_is_watched_too(tmp_path: Path) -> None:
    elsewhere = tmp_path / "runs" / "job-1"
    async with monitor(tmp_path) as (source, sink):
        source.on_report(checkpoint(HUGE, elsewhere / "model.safetensors"))
        await sink.wait_active(f"disk/{elsewhere}")
    assert str(elsewhere) in source.status()["checkpoint_dirs"]


async def test_a_failed_checkpoint_report_does_not_set_the_size(tmp_path: Path) -> None:
    async with monitor(tmp_path, checkpoint_dirs=(tmp_path,)) as (source, _):
        source.on_report(checkpoint(HUGE, tmp_path / "x", phase="failed"))
    assert source.status()["last_checkpoint_bytes"] is None


async def test_memory_pressure_is_host_degraded(tmp_path: Path) -> None:
    # Available memory is always below 100.5 % of the total: a real reading that is always "pressure".
    async with monitor(tmp_path, memory_available_min_percent=100.5) as (_, sink):
        notice = await sink.wait_active("memory")
    assert notice.kind == Kind.HOST_DEGRADED
    assert 0 < notice.detail["available_percent"] <= 100


async def test_state_directory_disk_nearly_full_is_host_degraded(tmp_path: Path) -> None:
    async with monitor(tmp_path, state_dir_min_free_bytes=HUGE) as (_, sink):
        notice = await sink.wait_active("disk/state")
    assert notice.kind == Kind.HOST_DEGRADED


async def test_a_condition_needs_raise_after_readings_in_a_row(tmp_path: Path) -> None:
    # A long interval: each check after the first is triggered by a report, one at a time.
    config = {"memory_available_min_percent": 100.5, "raise_after": 3, "poll_interval_s": 60.0}
    seen = []
    async with monitor(tmp_path, **config) as (source, sink):
        for checks in (1, 2, 3):
            if checks > 1:
                source.on_report(checkpoint(1, tmp_path / "c"))
            await sink.wait_for(lambda n=checks: source.status()["checks"] >= n, what=f"check {checks}")
            seen.append("memory" in sink.active())
    assert seen == [False, False, True]


async def test_a_hung_disk_read_is_flagged_and_the_monitor_carries_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A dead network mount makes statvfs hang; stand in for it at the psutil boundary.
    release = threading.Event()
    real = host_module.read_disk
    stuck = tmp_path / "nfs"

    def read_disk(path: Path) -> Any:
        if path == stuck:
            release.wait(10)
        return real(path)

    monkeypatch.setattr(host_module, "read_disk", read_disk)
    try:
        async with monitor(tmp_path, checkpoint_dirs=(stuck,), call_timeout_s=0.2) as (source, sink):
            notice = await sink.wait_active(f"disk/{stuck}")
            assert notice.reason == f"checkpoint directory {stuck}: the file system is not responding"
            assert source.status()["not_responding"] == [str(stuck)]
            release.set()
            await sink.wait_cleared(f"disk/{stuck}")
    finally:
        release.set()


async def test_a_read_hung_over_several_checks_holds_one_thread_and_its_late_error_is_reported(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A dead mount: every check waits for the same hung statvfs instead of starting another thread; when
    it finally fails, the next check reports that error."""
    release = threading.Event()
    real = host_module.read_disk
    stuck = tmp_path / "nfs"
    calls: list[Path] = []

    def read_disk(path: Path) -> Any:
        if path == stuck:
            calls.append(path)
            if len(calls) == 1:
                release.wait(10)
                raise OSError(116, "Stale file handle")
        return real(path)

    monkeypatch.setattr(host_module, "read_disk", read_disk)
    try:
        async with monitor(tmp_path, checkpoint_dirs=(stuck,), call_timeout_s=0.1) as (source, sink):
            await sink.wait_active(f"disk/{stuck}")
            rounds = source.status()["checks"]
            await sink.wait_for(lambda: source.status()["checks"] >= rounds + 3, what="three more checks")
            assert len(calls) == 1
            release.set()
            await sink.wait_for(
                lambda: any("Stale file handle" in e for e in sink.errors), what="the late error reported"
            )
            assert f"checkpoint directory {stuck}: [Errno 116] Stale file handle" in sink.errors
    finally:
        release.set()


async def test_a_read_that_fails_after_the_monitor_stopped_is_not_left_unretrieved(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The agent stops while a statvfs hangs; the call then fails. Nobody waits for it any more: its error is
    dropped, not left in a future that asyncio reports as "exception was never retrieved"."""
    release = threading.Event()
    stuck_threads: set[threading.Thread] = set()
    stuck = tmp_path / "nfs"
    real = host_module.read_disk

    def read_disk(path: Path) -> Any:
        if path != stuck:
            return real(path)
        stuck_threads.add(threading.current_thread())
        release.wait(10)
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(host_module, "read_disk", read_disk)
    loop = asyncio.get_running_loop()
    unretrieved: list[str] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: unretrieved.append(str(context.get("message"))))
    try:
        async with monitor(tmp_path, checkpoint_dirs=(stuck,), call_timeout_s=0.1) as (_source, sink):
            await sink.wait_active(f"disk/{stuck}")
        release.set()
        assert stuck_threads
        await threads_ended(stuck_threads, 5)  # the worker thread has handed its error back to the loop
        gc.collect()
        await asyncio.sleep(0)
    finally:
        release.set()
        loop.set_exception_handler(previous)
    assert [] == [m for m in unretrieved if "never retrieved" in m]


async def test_report_to_the_agent_reaches_a_subscriber_as_host_degraded_then_cleared(
    base: Path, tmp_path: Path
) -> None:
    ckpt = tmp_path / "ckpt"
    source = HostSource(host_config(checkpoint_dirs=(ckpt,), poll_interval_s=60.0), base / "state")
    async with running_agent(base, {"gpu.enabled": False}, sources=[source]) as agent:
        socket = agent.config.socket
        client = await SSEClient.connect(socket)
        try:
            assert (await client.next())["type"] == "snapshot"
            body = {
                "kind": "checkpoint",
                "phase": "finished",
                "duration_s": 3.0,
                "bytes": HUGE,
                "path": str(ckpt),
            }
            status, _ = await http_json(socket, "POST", "/v1/reports", body)
            assert status in (200, 202)
            raised = await client.until(lambda e: e["type"] == "notice")
            assert (raised["notice"]["kind"], raised["notice"]["key"]) == ("host_degraded", f"disk/{ckpt}")
            status, _ = await http_json(socket, "POST", "/v1/reports", {**body, "bytes": 1})
            cleared = await client.until(lambda e: e["type"] == "cleared")
            assert cleared["notice"]["id"] == raised["notice"]["id"]
            status, doc = await http_json(socket, "GET", "/v1/status")
            assert (status, doc["sources"]["host"]["last_checkpoint_bytes"]) == (200, 1)
        finally:
            await client.close()


async def test_a_restored_notice_keeps_its_id_while_the_condition_is_seen_again(tmp_path: Path) -> None:
    sink = RecordingSink("host")
    restored = sink.board.observe("host", Observation("memory", Kind.HOST_DEGRADED, "before"), utcnow())
    assert restored is not None
    source = HostSource(host_config(memory_available_min_percent=100.5, raise_after=3), tmp_path)
    task = asyncio.create_task(source.run(sink))
    try:
        await sink.wait_for(lambda: sink.replaces >= 2, what="two checks after the warm-up")
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, 5.0)
    assert (sink.events("memory"), sink.active()["memory"].id) == ([EventType.UPDATE], restored.notice.id)


async def test_memory_that_cannot_be_read_is_an_error_and_the_disks_are_still_checked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The memory is read on the loop: a /proc without meminfo (a container without /proc) is the check's
    error, named, and the state directory is still read."""

    class NoProc:
        disk_usage = staticmethod(psutil.disk_usage)

        @staticmethod
        def virtual_memory() -> Any:
            raise FileNotFoundError(2, "No such file or directory", "/proc/meminfo")

    monkeypatch.setattr(host_module, "_psutil", lambda: NoProc)
    async with monitor(tmp_path) as (source, sink):
        await sink.wait_for(lambda: any(e.startswith("memory: ") for e in sink.errors), what="the error")
        rounds = source.status()["checks"]
        await sink.wait_for(lambda: source.status()["checks"] > rounds, what="another check")
    assert "/proc/meminfo" in next(e for e in sink.errors if e.startswith("memory: "))
    readings = source.status()["readings"]
    assert (False, True) == ("memory" in readings, "state_dir" in readings)
