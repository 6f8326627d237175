"""End to end: fault scenarios replayed through the fake NVIDIA driver reach a subscribed client of a real
agent as the right kind of notice, then ``cleared``; the agent keeps serving throughout."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest

from agent.config import GpuConfig
from agent.sources.nvml import NvmlSource
from tests.fake_nvml.build import Scenario, fake_nvml_lib, scenario
from tests.support import SSEClient, http_json, running_agent

__all__ = ["fake_nvml_lib", "scenario"]  # fixtures

pytestmark = pytest.mark.timeout(60)

GPU0 = "GPU-fa4e0000-0000-4000-8000-000000000000"
GPU1 = "GPU-fa4e0000-0000-4000-8000-000000000001"

FAST = {
    "gpu.poll_interval_s": 0.1,
    "gpu.call_timeout_s": 1.0,
    "gpu.event_wait_ms": 100,
    "gpu.raise_after": 2,
    "gpu.clear_after": 2,
    "gpu.xid_hold_s": 1.0,
    "gpu.kmsg": False,
    "host.enabled": False,
}


def fast_gpu(library: Path) -> GpuConfig:
    return GpuConfig(
        library_path=library,
        poll_interval_s=0.05,
        call_timeout_s=1.0,
        event_wait_ms=50,
        raise_after=2,
        clear_after=2,
        xid_hold_s=1.0,
        kmsg=False,
    )


async def status_until(
    socket: Path, predicate: Callable[[dict[str, Any]], bool], what: str, timeout: float = 15.0
) -> dict[str, Any]:
    """Poll ``/v1/status`` until ``predicate`` holds (no event announces a source's own state)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    doc: dict[str, Any] = {}
    while loop.time() < end:
        _, doc = await http_json(socket, "GET", "/v1/status")
        if predicate(doc):
            return doc
        await asyncio.sleep(0.05)
    raise AssertionError(f"{what} not reached within {timeout}s: {doc.get('sources')}")


def nvml_polled(doc: dict[str, Any]) -> bool:
    gpus = doc["sources"].get("nvml", {}).get("gpus") or []
    return bool(gpus) and all(state != "pending" for g in gpus for state in g["checks"].values())


async def nvml_ready(socket: Path) -> dict[str, Any]:
    """Status once the monitor has read every check of every GPU."""
    return await status_until(socket, nvml_polled, "the first full NVML poll")


SCENARIOS: list[tuple[str, Mapping[str, object], str, str, Mapping[str, object]]] = [
    ("fatal XID", {"event.x": "1,xid,79"}, f"{GPU1}/xid/79", "gpu_fault", {}),
    ("lost GPU", {"gpu.1.lost": 1}, f"{GPU1}/lost", "gpu_fault", {"gpu.1.lost": 0}),
    (
        "hung call",
        {"gpu.1.hang.nvmlDeviceGetTemperature": 1},
        f"{GPU1}/hung",
        "gpu_fault",
        {"gpu.1.hang.nvmlDeviceGetTemperature": 0},
    ),
    (
        "pending row remap",
        {"gpu.1.remap_pending": 1},
        f"{GPU1}/remapped_rows",
        "gpu_degraded",
        {"gpu.1.remap_pending": 0},
    ),
    ("overheating GPU", {"gpu.1.temp": 88}, f"{GPU1}/temperature", "gpu_degraded", {"gpu.1.temp": 50}),
]


@pytest.mark.parametrize(
    ("fault", "key", "kind", "repair"),
    [(s[1], s[2], s[3], s[4]) for s in SCENARIOS],
    ids=[s[0] for s in SCENARIOS],
)
async def test_fault_reaches_a_subscriber_and_clears_while_the_agent_serves(
    base: Path,
    fake_nvml_lib: Path,
    scenario: Scenario,
    fault: Mapping[str, object],
    key: str,
    kind: str,
    repair: Mapping[str, object],
) -> None:
    scenario.update({"device_count": 2})
    async with running_agent(
        base, {"host.enabled": False}, sources=[NvmlSource(fast_gpu(fake_nvml_lib))]
    ) as agent:
        socket = agent.config.socket
        await nvml_ready(socket)
        client = await SSEClient.connect(socket)
        try:
            snapshot = await client.next()
            assert (snapshot["type"], snapshot["notices"]) == ("snapshot", [])
            scenario.update(fault)
            raised = await client.until(lambda e: e["type"] == "notice")
            assert (raised["notice"]["key"], raised["notice"]["kind"]) == (key, kind)
            assert raised["notice"]["source"] == "nvml"
            assert raised["notice"]["detail"]["uuid"] == GPU1
            status, doc = await http_json(socket, "GET", "/v1/status")
            assert status == 200
            assert [n["key"] for n in doc["notices"]] == [key]
            scenario.update(repair)
            cleared = await client.until(lambda e: e["type"] == "cleared")
            assert (cleared["notice"]["key"], cleared["notice"]["id"]) == (key, raised["notice"]["id"])
            status, doc = await http_json(socket, "GET", "/v1/status")
            assert (status, doc["notices"]) == (200, [])
        finally:
            await client.close()


async def test_gpus_appear_in_agent_status_with_uuid_index_name_and_bus_id(
    base: Path, fake_nvml_lib: Path, scenario: Scenario
) -> None:
    scenario.update({"device_count": 2, "gpu.0.pids": "4242"})
    async with running_agent(
        base, {"host.enabled": False}, sources=[NvmlSource(fast_gpu(fake_nvml_lib))]
    ) as agent:
        doc = await nvml_ready(agent.config.socket)
    gpus = doc["gpus"]
    assert [(g["uuid"], g["index"], g["pci_bus_id"]) for g in gpus] == [
        (GPU0, 0, "00000000:18:00.0"),
        (GPU1, 1, "00000000:19:00.0"),
    ]
    assert gpus[0]["compute_pids"] == [4242]
    assert (doc["sources"]["nvml"]["state"], doc["sources"]["nvml"]["monitor"]) == ("ok", "running")


async def test_config_builds_the_monitor_with_the_configured_library(
    base: Path, fake_nvml_lib: Path, scenario: Scenario
) -> None:
    settings = {**FAST, "gpu.library_path": str(fake_nvml_lib)}
    async with running_agent(base, settings) as agent:
        assert "nvml" in agent.sources
        doc = await nvml_ready(agent.config.socket)
    assert doc["sources"]["nvml"]["driver_version"] == "999.99.99-fake"


async def test_agent_without_an_nvidia_library_runs_with_the_monitor_disabled(
    base: Path, tmp_path: Path
) -> None:
    settings = {**FAST, "gpu.library_path": str(tmp_path / "nowhere" / "libnvidia-ml.so.1")}
    async with running_agent(base, settings) as agent:
        doc = await status_until(
            agent.config.socket, lambda d: d["sources"]["nvml"]["state"] == "disabled", "nvml disabled"
        )
        _, after = await http_json(agent.config.socket, "GET", "/v1/status")
    state = doc["sources"]["nvml"]
    assert state["state"] == "disabled"
    assert "cannot load the NVML library" in state["detail"]["why"]
    assert after["agent"]["pid"] == doc["agent"]["pid"]


async def test_a_gpu_notice_keeps_its_id_across_an_agent_restart(
    base: Path, fake_nvml_lib: Path, scenario: Scenario
) -> None:
    key = f"{GPU0}/temperature"
    scenario.update({"gpu.0.temp": 88})
    settings = {"host.enabled": False}
    async with running_agent(base, settings, sources=[NvmlSource(fast_gpu(fake_nvml_lib))]) as agent:
        doc = await status_until(agent.config.socket, lambda d: bool(d["notices"]), "the notice")
        before = doc["notices"][0]
    assert before["key"] == key
    async with running_agent(base, settings, sources=[NvmlSource(fast_gpu(fake_nvml_lib))]) as agent:
        client = await SSEClient.connect(agent.config.socket)
        try:
            snapshot = await client.next()
            assert [n["id"] for n in snapshot["notices"]] == [before["id"]]
            await status_until(
                agent.config.socket,
                # The first status may come before the source's first poll has listed any GPU.
                lambda d: (
                    [g["checks"]["temperature"] for g in d["sources"]["nvml"].get("gpus") or []][:1]
                    == ["finding"]
                ),
                "the condition seen again",
            )
            _, doc = await http_json(agent.config.socket, "GET", "/v1/status")
        finally:
            await client.close()
    assert [(n["id"], n["key"]) for n in doc["notices"]] == [(before["id"], key)]
    assert doc["events"]["published"].get("cleared", 0) == 0
