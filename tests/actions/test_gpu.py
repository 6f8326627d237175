"""Signals to GPU compute processes, end to end: the real agent with the real NVML source on the fake NVIDIA
driver, whose scenario lists a real child process as a compute process on a GPU."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from agent.config import GpuConfig
from agent.sources.nvml import NvmlSource
from tests.actions_support import HANDLER, IGNORER, Child
from tests.fake_nvml.build import Scenario, fake_nvml_lib, scenario
from tests.support import http_json, running_agent

__all__ = ["fake_nvml_lib", "scenario"]  # fixtures

pytestmark = pytest.mark.timeout(60)

GPU1 = "GPU-fa4e0000-0000-4000-8000-000000000001"  # the fake driver's second GPU


async def status_until(socket: Path, predicate: Callable[[dict[str, Any]], bool], what: str) -> None:
    """Poll ``/v1/status`` until ``predicate`` holds: no event announces what NVML lists."""
    loop = asyncio.get_running_loop()
    end = loop.time() + 15.0
    while loop.time() < end:
        _, doc = await http_json(socket, "GET", "/v1/status")
        if predicate(doc):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{what}: not within 15 s")


def fast_gpu(library: Path) -> GpuConfig:
    return GpuConfig(
        library_path=library, poll_interval_s=0.05, call_timeout_s=1.0, event_wait_ms=50, kmsg=False
    )


def lists_pids(*pids: int) -> Any:
    def check(doc: dict[str, Any]) -> bool:
        gpus = doc["sources"].get("nvml", {}).get("gpus") or []
        seen = {pid for gpu in gpus for pid in gpu.get("compute_pids", [])}
        return set(pids) <= seen

    return check


async def test_a_drill_signals_the_gpu_compute_processes(
    base: Path, fake_nvml_lib: Path, scenario: Scenario
) -> None:
    child = await Child.start(HANDLER, str(base / "got"))
    try:
        scenario.update({"device_count": 2, "gpu.0.pids": str(child.pid)})
        settings = {"host.enabled": False, "actions.signals": [{"name": "gpu", "gpu_processes": True}]}
        async with running_agent(base, settings, sources=[NvmlSource(fast_gpu(fake_nvml_lib))]) as agent:
            await status_until(
                agent.config.socket, lists_pids(child.pid), "the child listed as a compute process"
            )
            status, _ = await http_json(
                agent.config.socket, "POST", "/v1/drills", {"kind": "termination", "in_s": 60}
            )
            assert 201 == status
            assert 0 == await child.wait()
        assert "SIGTERM" == (base / "got").read_text()
    finally:
        await child.stop()


async def test_a_gpu_fault_signals_only_the_processes_on_that_gpu(
    base: Path, fake_nvml_lib: Path, scenario: Scenario
) -> None:
    on_gpu0 = await Child.start(IGNORER)
    on_gpu1 = await Child.start(HANDLER, str(base / "got"))
    try:
        scenario.update({"device_count": 2, "gpu.0.pids": str(on_gpu0.pid), "gpu.1.pids": str(on_gpu1.pid)})
        rule = {"name": "faulty", "kinds": ["gpu_fault"], "gpu_processes": True, "gpu_scope": "notice"}
        settings = {"host.enabled": False, "actions.signals": [rule]}
        async with running_agent(base, settings, sources=[NvmlSource(fast_gpu(fake_nvml_lib))]) as agent:
            socket = agent.config.socket
            await status_until(socket, lists_pids(on_gpu0.pid, on_gpu1.pid), "both children listed")
            scenario.update({"event.x": "1,xid,79"})  # a fatal XID on GPU 1
            assert 0 == await on_gpu1.wait(timeout=20)
            _, doc = await http_json(socket, "GET", "/v1/status")
        sent = [(s["pid"], s["target"]) for s in doc["actions"]["signals"] if s["outcome"] == "sent"]
        assert [(on_gpu1.pid, f"gpu:{GPU1}")] == sent
        assert on_gpu0.proc.returncode is None
    finally:
        await on_gpu0.stop()
        await on_gpu1.stop()
