"""The NVML GPU monitor against the fake NVIDIA driver, through the real pynvml: every check and every
failure mode, observed through a recording sink (end-to-end tests through the agent are in
test_nvml_agent.py)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from agent.core.notice import EventType, Kind, Observation, Severity, utcnow
from agent.sources.nvml import NvmlSource
from tests.fake_nvml.build import Scenario, fake_nvml_lib, scenario
from tests.fake_nvml.recording import RecordingSink
from tests.sources.nvml import GPU0, GPU1, gpu_config, wait_polled
from tests.support import threads_ended, threads_named

__all__ = ["fake_nvml_lib", "scenario"]  # fixtures

pytestmark = pytest.mark.timeout(30)


@contextlib.asynccontextmanager
async def monitor(library: Path | None, **overrides: Any) -> AsyncIterator[tuple[NvmlSource, RecordingSink]]:
    source = NvmlSource(gpu_config(library, **overrides))
    sink = RecordingSink("nvml")
    task = asyncio.create_task(source.run(sink))
    try:
        yield source, sink
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, 5.0)


def gpu_status(source: NvmlSource, uuid: str) -> dict[str, Any]:
    found = [g for g in source.status()["gpus"] if g["uuid"] == uuid]
    assert len(found) == 1, source.status()["gpus"]
    return dict(found[0])


# --- start-up --------------------------------------------------------------------------------------------


async def test_missing_library_disables_the_monitor_with_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "libnvidia-ml.so.1"
    async with monitor(missing) as (source, sink):
        await sink.wait_for(lambda: sink.disabled is not None, what="disable")
    assert sink.disabled is not None
    assert str(missing) in sink.disabled
    assert "gpu.library_path" in sink.disabled
    assert source.status()["monitor"] == "disabled"


async def test_driver_not_loaded_disables_the_monitor(fake_nvml_lib: Path, scenario: Scenario) -> None:
    scenario.set(**{"error.nvmlInitWithFlags": 9})
    async with monitor(fake_nvml_lib) as (_, sink):
        await sink.wait_for(lambda: sink.disabled is not None, what="disable")
    assert sink.disabled == "the NVIDIA kernel driver is not loaded (nvmlInit: Driver Not Loaded)"


async def test_no_gpu_disables_the_monitor(fake_nvml_lib: Path, scenario: Scenario) -> None:
    scenario.set(device_count=0)
    async with monitor(fake_nvml_lib) as (_, sink):
        await sink.wait_for(lambda: sink.disabled is not None, what="disable")
    assert sink.disabled is not None
    assert "sees no GPU" in sink.disabled


async def test_status_lists_each_gpu_by_uuid_with_index_name_and_bus_id(
    fake_nvml_lib: Path, scenario: Scenario
) -> None:
    scenario.update({"device_count": 2, "gpu.1.name": "NVIDIA A100", "gpu.1.pci": "00000000:2B:00.0"})
    async with monitor(fake_nvml_lib) as (source, sink):
        await wait_polled(source, sink)
        status = source.status()
        second = gpu_status(source, GPU1)
    assert [g["uuid"] for g in status["gpus"]] == [GPU0, GPU1]
    assert (second["index"], second["name"], second["pci_bus_id"]) == (1, "NVIDIA A100", "00000000:2B:00.0")
    assert set(second["checks"].values()) == {"ok"}
    assert status["driver_version"] == "999.99.99-fake"
    assert sink.health == "ok"
    assert sink.active() == {}


async def test_compute_pids_are_known_per_gpu(fake_nvml_lib: Path, scenario: Scenario) -> None:
    scenario.update({"device_count": 2, "gpu.0.pids": "4242,17"})
    async with monitor(fake_nvml_lib) as (source, sink):
        await wait_polled(source, sink)
        assert source.compute_pids() == {GPU0: [17, 4242], GPU1: []}
        assert gpu_status(source, GPU0)["compute_pids"] == [17, 4242]


# --- XIDs and driver events ------------------------------------------------------------------------------


async def test_fatal_xid_event_raises_gpu_fault_and_clears_after_the_hold(
    fake_nvml_lib: Path, scenario: Scenario
) -> None:
    async with monitor(fake_nvml_lib) as (source, sink):
        await wait_polled(source, sink)
        scenario.update({"event.a": "0,xid,79"})
        notice = await sink.wait_active(f"{GPU0}/xid/79")
        assert (notice.kind, notice.severity) == (Kind.GPU_FAULT, Severity.CRITICAL)
        assert notice.reason == f"GPU 0 ({GPU0}): XID 79: GPU has fallen off the bus"
        assert notice.detail["uuid"] == GPU0
        await sink.wait_cleared(f"{GPU0}/xid/79")
    assert sink.events(f"{GPU0}/xid/79") == [EventType.NOTICE, EventType.CLEARED]


async def test_degraded_xid_raises_gpu_degraded(fake_nvml_lib: Path, scenario: Scenario) -> None:
    async with monitor(fake_nvml_lib) as (source, sink):
        await wait_polled(source, sink)
        scenario.update({"event.a": "0,xid,94"})
        notice = await sink.wait_active(f"{GPU0}/xid/94")
    assert (notice.kind, notice.severity) == (Kind.GPU_DEGRADED, Severity.WARNING)


async def test_informational_xid_raises_no_notice_but_shows_in_status(
    fake_nvml_lib: Path, scenario: Scenario
) -> None:
    async with monitor(fake_nvml_lib) as (source, sink):
        await wait_polled(source, sink)
        scenario.update({"event.a": "0,xid,13"})
        await sink.wait_for(lambda: gpu_status(source, GPU0)["last_xid"] is not None, what="the XID")
        await wait_polled(source, sink)
    assert gpu_status(source, GPU0)["last_xid"]["class"] == "info"
    assert sink.active() == {}


async def test_xid_classes_in_the_config_override_the_table(fake_nvml_lib: Path, scenario: Scenario) -> None:
    async with monitor(fake_nvml_lib, xid_classes={13: "fatal", 79: "info"}) as (source, sink):
        await wait_polled(source, sink)
        scenario.update({"event.a": "0,xid,79", "event.b": "0,xid,13,100"})
        notice = await sink.wait_active(f"{GPU0}/xid/13")
    assert notice.kind == Kind.GPU_FAULT
    assert f"{GPU0}/xid/79" not in sink.active()


async def test_unknown_xid_gets_the_configured_default_class(fake_nvml_lib: Path, scenario: Scenario) -> None:
    async with monitor(fake_nvml_lib, xid_default="fatal") as (source, sink):
        await wait_polled(source, sink)
        scenario.update({"event.a": "0,xid,999"})
        notice = await sink.wait_active(f"{GPU0}/xid/999")
    assert notice.kind == Kind.GPU_FAULT


async def test_double_bit_ecc_event_raises_gpu_fault(fake_nvml_lib: Path, scenario: Scenario) -> None:
    async with monitor(fake_nvml_lib) as (source, sink):
        await wait_polled(source, sink)
        scenario.update({"event.a": "0,dbe,0"})
        notice = await sink.wait_active(f"{GPU0}/double-bit-ecc")
    assert notice.kind == Kind.GPU_FAULT


async def test_recovery_action_event_raises_the_matching_notice(
    fake_nvml_lib: Path, scenario: Scenario
) -> None:
    async with monitor(fake_nvml_lib) as (source, sink):
        await wait_polled(source, sink)
        scenario.update({"event.a": "0,recovery,3"})
        notice = await sink.wait_active(f"{GPU0}/recovery_action")
    assert (notice.kind, notice.detail["recovery_action"]) == (Kind.GPU_DEGRADED, "drain_p2p")


async def test_events_are_registered_with_the_mask_the_device_supports(
    fake_nvml_lib: Path, scenario: Scenario
) -> None:
    scenario.update({"device_count": 2, "gpu.1.supported_events": "0x8"})
    async with monitor(fake_nvml_lib) as (source, sink):
        await sink.wait_for(lambda: source.status()["events"] == "waiting", what="event registration")
        events = (gpu_status(source, GPU0)["events"], gpu_status(source, GPU1)["events"])
    assert events == ("registered", "registered")


async def test_hung_event_wait_is_a_gpu_fault_and_clears_when_it_returns(
    fake_nvml_lib: Path, scenario: Scenario
) -> None:
    async with monitor(fake_nvml_lib) as (source, sink):
        await sink.wait_for(lambda: source.status()["events"] == "waiting", what="event registration")
        scenario.update({"hang.nvmlEventSetWait_v2": 1})
        notice = await sink.wait_active("events/hung")
        assert notice.reason.startswith("NVML call hung: nvmlEventSetWait_v2")
        scenario.unset("hang.nvmlEventSetWait_v2")
        await sink.wait_cleared("events/hung")


# --- periodic checks -------------------------------------------------------------------------------------


async def test_overheating_gpu_is_degraded_then_fatal_near_shutdown_then_clears(
    fake_nvml_lib: Path, scenario: Scenario
) -> None:
    key = f"{GPU0}/temperature"
    scenario.update({"temp_slowdown": 87, "temp_shutdown": 92})
    async with monitor(fake_nvml_lib) as (source, sink):
        await wait_polled(source, sink)
        scenario.update({"gpu.0.temp": 88})
        notice = await sink.wait_active(key)
        assert (notice.kind, notice.detail["temperature_c"], notice.detail["slowdown_c"]) == (
            Kind.GPU_DEGRADED,
            88,
            87,
        )
        scenario.update({"gpu.0.temp": 90})
        await sink.wait_for(
            lambda: sink.active().get(key) is not None and sink.active()[key].kind == Kind.GPU_FAULT
        )
        scenario.update({"gpu.0.temp": 60})
        await sink.wait_cleared(key)
    assert sink.events(key) == [EventType.NOTICE, EventType.UPDATE, EventType.CLEARED]


async def test_pending_row_remap_is_degraded_and_a_remap_failure_fatal(
    fake_nvml_lib: Path, scenario: Scenario
) -> None:
    key = f"{GPU0}/remapped_rows"
    async with monitor(fake_nvml_lib) as (source, sink):
        await wait_polled(source, sink)
        scenario.update({"gpu.0.remap_pending": 1, "gpu.0.remapped_rows_uncorrectable": 1})
        notice = await sink.wait_active(key)
        assert (notice.kind, notice.detail["pending"]) == (Kind.GPU_DEGRADED, True)
        scenario.update({"gpu.0.remap_failure": 1})
        await sink.wait_for(lambda: key in sink.active() and sink.active()[key].kind == Kind.GPU_FAULT)
        scenario.update({"gpu.0.remap_pending": 0, "gpu.0.remap_failure": 0})
        await sink.wait_cleared(key)


@pytest.mark.parametrize(
    ("settings", "condition", "kind"),
    [
        ({"gpu.0.ecc_uncorrected_volatile": 2}, "ecc", Kind.GPU_DEGRADED),
        ({"gpu.0.retired_pages_pending": 1}, "retired_pages", Kind.GPU_DEGRADED),
        ({"gpu.0.clocks_event_reasons": "0x48"}, "clocks", Kind.GPU_DEGRADED),
        ({"gpu.0.power_mw": 800000, "gpu.0.power_limit_mw": 700000}, "power", Kind.GPU_DEGRADED),
        ({"gpu.0.recovery_action": 1}, "recovery_action", Kind.GPU_FAULT),
    ],
)
async def test_each_check_raises_its_notice_and_clears(
    fake_nvml_lib: Path, scenario: Scenario, settings: dict[str, Any], condition: str, kind: Kind
) -> None:
    key = f"{GPU0}/{condition}"
    async with monitor(fake_nvml_lib) as (source, sink):
        await wait_polled(source, sink)
        scenario.update(settings)
        notice = await sink.wait_active(key)
        assert notice.kind == kind
        assert gpu_status(source, GPU0)["checks"][condition] == "finding"
        scenario.unset(*settings)
        await sink.wait_cleared(key)


async def test_clock_event_reasons_name_the_slowdown(fake_nvml_lib: Path, scenario: Scenario) -> None:
    scenario.update({"gpu.0.clocks_event_reasons": "0x48"})
    async with monitor(fake_nvml_lib) as (_, sink):
        notice = await sink.wait_active(f"{GPU0}/clocks")
    assert notice.reason == f"GPU 0 ({GPU0}): clocks slowed by hw_slowdown, hw_thermal_slowdown"


async def test_older_driver_without_clock_event_reasons_uses_throttle_reasons(
    fake_nvml_lib: Path, scenario: Scenario
) -> None:
    scenario.update(
        {"error.nvmlDeviceGetCurrentClocksEventReasons": 13, "gpu.0.clocks_event_reasons": "0x80"}
    )
    async with monitor(fake_nvml_lib) as (_, sink):
        notice = await sink.wait_active(f"{GPU0}/clocks")
    assert notice.detail["reasons"] == ["hw_power_brake_slowdown"]


async def test_not_supported_disables_one_check_for_one_gpu(fake_nvml_lib: Path, scenario: Scenario) -> None:
    scenario.update({"device_count": 2, "gpu.1.not_supported": "nvmlDeviceGetRemappedRows"})
    async with monitor(fake_nvml_lib) as (source, sink):
        await wait_polled(source, sink)
        first, second = gpu_status(source, GPU0), gpu_status(source, GPU1)
        assert second["checks"]["remapped_rows"] == "not_supported"
        assert first["checks"]["remapped_rows"] == "ok"
        assert {c for c, state in second["checks"].items() if state != "ok"} == {"remapped_rows"}
        # A later pending remap on the disabled GPU is not read any more; on the other it is.
        scenario.update({"remap_pending": 1})
        await sink.wait_active(f"{GPU0}/remapped_rows")
        await wait_polled(source, sink, rounds=3)
    assert f"{GPU1}/remapped_rows" not in sink.active()
    assert sink.health == "ok"


async def test_a_failing_check_degrades_the_source_without_a_notice(
    fake_nvml_lib: Path, scenario: Scenario
) -> None:
    scenario.update({"error.nvmlDeviceGetPowerUsage": 4})
    async with monitor(fake_nvml_lib) as (source, sink):
        await sink.wait_for(lambda: sink.health == "degraded", what="a degraded source")
        assert gpu_status(source, GPU0)["checks"]["power"] == "error"
    assert sink.active() == {}
    assert "Insufficient Permissions (4)" in sink.errors[-1]


# --- a lost, failing or hung GPU -------------------------------------------------------------------------


async def test_lost_gpu_is_a_gpu_fault_and_the_other_gpu_is_still_watched(
    fake_nvml_lib: Path, scenario: Scenario
) -> None:
    scenario.update({"device_count": 2})
    async with monitor(fake_nvml_lib) as (source, sink):
        await wait_polled(source, sink)
        scenario.update({"gpu.0.lost": 1})
        notice = await sink.wait_active(f"{GPU0}/lost")
        assert (notice.kind, notice.severity) == (Kind.GPU_FAULT, Severity.CRITICAL)
        assert "fallen off the bus" in notice.reason
        scenario.update({"gpu.1.temp": 99})
        await sink.wait_active(f"{GPU1}/temperature")
        scenario.unset("gpu.0.lost")
        await sink.wait_cleared(f"{GPU0}/lost")


async def test_repeated_unknown_errors_count_as_a_lost_gpu(fake_nvml_lib: Path, scenario: Scenario) -> None:
    async with monitor(fake_nvml_lib, unknown_after=3) as (source, sink):
        await wait_polled(source, sink)
        scenario.update({"gpu.0.error.nvmlDeviceGetTemperature": 999})
        notice = await sink.wait_active(f"{GPU0}/lost")
    assert "Unknown Error" in notice.reason
    assert notice.detail["polls"] == 3


async def test_hung_call_is_a_gpu_fault_and_the_other_gpus_carry_on(
    fake_nvml_lib: Path, scenario: Scenario
) -> None:
    scenario.update({"device_count": 2})
    async with monitor(fake_nvml_lib) as (source, sink):
        await wait_polled(source, sink)
        scenario.update({"gpu.0.hang.nvmlDeviceGetPowerUsage": 1})
        notice = await sink.wait_active(f"{GPU0}/hung")
        assert (notice.kind, notice.severity) == (Kind.GPU_FAULT, Severity.CRITICAL)
        assert notice.reason == (
            f"NVML call hung: nvmlDeviceGetPowerUsage on GPU 0 ({GPU0}) did not return within 1 s"
        )
        assert gpu_status(source, GPU0)["hung_call"] == "nvmlDeviceGetPowerUsage"
        scenario.update({"gpu.1.remap_pending": 1})
        await sink.wait_active(f"{GPU1}/remapped_rows")
        scenario.unset("gpu.0.hang.nvmlDeviceGetPowerUsage")
        await sink.wait_cleared(f"{GPU0}/hung")


async def test_shutdown_does_not_wait_for_a_hung_call(fake_nvml_lib: Path, scenario: Scenario) -> None:
    loop = asyncio.get_running_loop()
    async with monitor(fake_nvml_lib) as (source, sink):
        await wait_polled(source, sink)
        scenario.update({"hang.nvmlDeviceGetTemperature": 1})
        await sink.wait_active(f"{GPU0}/hung")
        started = loop.time()
    assert loop.time() - started < 2.0


async def test_hung_initialisation_is_a_gpu_fault(fake_nvml_lib: Path, scenario: Scenario) -> None:
    scenario.update({"hang.nvmlDeviceGetCount_v2": 1})
    async with monitor(fake_nvml_lib) as (source, sink):
        notice = await sink.wait_active("driver/hung")
        assert notice.reason.startswith("NVML call hung: nvmlDeviceGetCount on the NVIDIA driver")
        scenario.unset("hang.nvmlDeviceGetCount_v2")
        await sink.wait_cleared("driver/hung")
        await wait_polled(source, sink)


@pytest.mark.slow
async def test_a_start_up_error_after_the_monitor_stopped_is_dropped_not_left_unretrieved(
    fake_nvml_lib: Path, scenario: Scenario
) -> None:
    """The agent stops while nvmlInit hangs; the call then fails. Nobody waits for it any more: its error is
    dropped, not left in a future that asyncio reports as "exception was never retrieved"."""
    loop = asyncio.get_running_loop()
    unretrieved: list[str] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: unretrieved.append(str(context.get("message"))))
    try:
        scenario.update({"hang.nvmlInitWithFlags": 1, "error.nvmlInitWithFlags": 999})
        earlier = threads_named("preemptd-nvml")
        async with monitor(fake_nvml_lib) as (_source, sink):
            await sink.wait_active("driver/hung")
            workers = threads_named("preemptd-nvml") - earlier
        scenario.unset("hang.nvmlInitWithFlags")
        assert workers
        await threads_ended(workers)  # the hung worker has returned from the fake and handed back its error
        gc.collect()
        await asyncio.sleep(0)
    finally:
        loop.set_exception_handler(previous)
        scenario.unset("error.nvmlInitWithFlags")
    assert [] == [m for m in unretrieved if "never retrieved" in m]


async def test_gpu_lost_before_start_up_is_a_gpu_fault_and_the_others_are_watched(
    fake_nvml_lib: Path, scenario: Scenario
) -> None:
    scenario.update({"device_count": 2, "gpu.1.lost": 1})
    async with monitor(fake_nvml_lib) as (source, sink):
        notice = await sink.wait_active("GPU-index-1/lost")
        assert (notice.kind, notice.detail["index"]) == (Kind.GPU_FAULT, 1)
        assert "GPU is lost (15) while enumerating" in notice.reason
        await wait_polled(source, sink)
        scenario.update({"gpu.0.temp": 99})
        await sink.wait_active(f"{GPU0}/temperature")
    assert [g["index"] for g in source.status()["gpus"]] == [0, 1]


async def test_a_restarted_monitor_enumerates_again_and_keeps_working(
    fake_nvml_lib: Path, scenario: Scenario
) -> None:
    source = NvmlSource(gpu_config(fake_nvml_lib))
    sink = RecordingSink("nvml")
    for _ in range(2):
        task = asyncio.create_task(source.run(sink))
        await wait_polled(source, sink)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, 5.0)
    assert [g["uuid"] for g in source.status()["gpus"]] == [GPU0]
    assert source.status()["monitor"] == "stopped"


async def test_driver_without_the_v3_process_call_turns_off_only_the_process_check(
    fake_nvml_lib: Path, scenario: Scenario
) -> None:
    # pynvml raises NVMLLibraryMismatchError (not an NVMLError) for an unversioned call it cannot find.
    scenario.update({"error.nvmlDeviceGetComputeRunningProcesses_v3": 13})
    async with monitor(fake_nvml_lib) as (source, sink):
        await wait_polled(source, sink)
        checks = gpu_status(source, GPU0)["checks"]
    assert {c for c, state in checks.items() if state != "ok"} == {"processes"}
    assert checks["processes"] == "not_supported"
    assert sink.health == "ok"


async def test_a_notice_restored_by_the_agent_keeps_its_id_when_the_condition_still_holds(
    fake_nvml_lib: Path, scenario: Scenario
) -> None:
    # The agent restores its notices from the state file before the sources start; a degraded condition
    # needs raise_after polls to be seen again, and must not be cleared and re-raised in between.
    key = f"{GPU0}/temperature"
    scenario.update({"gpu.0.temp": 88})
    source = NvmlSource(gpu_config(fake_nvml_lib, raise_after=3))
    sink = RecordingSink("nvml")
    restored = sink.board.observe("nvml", Observation(key, Kind.GPU_DEGRADED, "before the restart"), utcnow())
    assert restored is not None
    task = asyncio.create_task(source.run(sink))
    try:
        await wait_polled(source, sink, rounds=2)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, 5.0)
    assert sink.events(key) == [EventType.UPDATE]
    assert sink.active()[key].id == restored.notice.id


async def test_a_restored_notice_whose_condition_is_gone_clears_after_the_warm_up(
    fake_nvml_lib: Path, scenario: Scenario
) -> None:
    key = f"{GPU0}/temperature"
    sink = RecordingSink("nvml")
    sink.board.observe("nvml", Observation(key, Kind.GPU_DEGRADED, "before the restart"), utcnow())
    source = NvmlSource(gpu_config(fake_nvml_lib))
    task = asyncio.create_task(source.run(sink))
    try:
        await sink.wait_cleared(key)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, 5.0)
