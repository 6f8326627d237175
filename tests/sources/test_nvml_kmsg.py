"""NVRM Xid lines from the kernel log (a FIFO standing in for /dev/kmsg) raise the same notices as NVML
XID events, and the same XID from both paths is one notice."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.core.notice import EventType, Kind
from agent.sources.nvml import NvmlSource
from tests.fake_nvml.build import Scenario, fake_nvml_lib, scenario
from tests.fake_nvml.recording import RecordingSink
from tests.sources.nvml import GPU0, GPU1, gpu_config, wait_polled

__all__ = ["fake_nvml_lib", "scenario"]  # fixtures

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def fifo(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "kmsg"
    os.mkfifo(path)
    yield path


@contextlib.asynccontextmanager
async def kmsg_monitor(
    library: Path, kmsg: Path, **overrides: Any
) -> AsyncIterator[tuple[NvmlSource, RecordingSink]]:
    config = dataclasses.replace(gpu_config(library, **overrides), kmsg=True, kmsg_path=kmsg)
    source = NvmlSource(config)
    sink = RecordingSink("nvml")
    task = asyncio.create_task(source.run(sink))
    try:
        await sink.wait_for(lambda: source.status()["kmsg"].get("state") == "watching", what="kmsg watching")
        yield source, sink
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, 5.0)


def write_line(path: Path, line: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    try:
        os.write(fd, line.encode() + b"\n")
    finally:
        os.close(fd)


async def test_kernel_log_xid_raises_a_notice_for_the_gpu_on_that_bus(
    fake_nvml_lib: Path, scenario: Scenario, fifo: Path
) -> None:
    scenario.update({"device_count": 2, "gpu.1.pci": "00000000:2B:00.0"})
    async with kmsg_monitor(fake_nvml_lib, fifo) as (source, sink):
        await wait_polled(source, sink)
        write_line(fifo, "3,812,93211,-;NVRM: Xid (PCI:0000:2b:00): 79, pid=0, GPU has fallen off the bus.")
        notice = await sink.wait_active(f"{GPU1}/xid/79")
    assert (notice.kind, notice.detail["via"], notice.detail["text"]) == (
        Kind.GPU_FAULT,
        "kmsg",
        "pid=0, GPU has fallen off the bus.",
    )


async def test_the_same_xid_from_nvml_and_the_kernel_log_is_one_notice(
    fake_nvml_lib: Path, scenario: Scenario, fifo: Path
) -> None:
    key = f"{GPU0}/xid/48"
    async with kmsg_monitor(fake_nvml_lib, fifo) as (source, sink):
        await wait_polled(source, sink)
        scenario.update({"event.a": "0,xid,48"})
        await sink.wait_active(key)
        write_line(fifo, "NVRM: Xid (PCI:0000:18:00): 48, An uncorrectable double bit error")
        await sink.wait_for(lambda: gpu_via(source) == "kmsg", what="the kernel log line")
        await sink.wait_cleared(key)
    assert sink.events(key) == [EventType.NOTICE, EventType.CLEARED]


def gpu_via(source: NvmlSource) -> str | None:
    last = source.status()["gpus"][0]["last_xid"]
    return last["via"] if last else None


async def test_unreadable_kernel_log_is_shown_in_status_and_the_monitor_runs_on(
    fake_nvml_lib: Path, scenario: Scenario, tmp_path: Path
) -> None:
    config = dataclasses.replace(gpu_config(fake_nvml_lib), kmsg=True, kmsg_path=tmp_path / "missing")
    source = NvmlSource(config)
    sink = RecordingSink("nvml")
    task = asyncio.create_task(source.run(sink))
    try:
        await sink.wait_for(lambda: source.status()["kmsg"].get("state") == "unavailable", what="kmsg state")
        await wait_polled(source, sink)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, 5.0)
    assert "cannot open" in source.status()["kmsg"]["why"]
    assert sink.health == "ok"


async def test_lines_appended_to_a_plain_file_are_read_and_older_ones_are_not(
    fake_nvml_lib: Path, scenario: Scenario, tmp_path: Path
) -> None:
    log = tmp_path / "kern.log"
    log.write_text("NVRM: Xid (PCI:0000:18:00): 79, an old line from before the agent started\n")
    async with kmsg_monitor(fake_nvml_lib, log) as (source, sink):
        await wait_polled(source, sink)
        with log.open("a") as handle:
            handle.write("NVRM: Xid (PCI:0000:18:00): 48, An uncorrectable double bit error\n")
        await sink.wait_active(f"{GPU0}/xid/48")
    assert f"{GPU0}/xid/79" not in sink.active()
