"""The GPU health monitor (source ``nvml``): XID and ECC events, periodic NVML checks and the kernel log,
turned into ``gpu_fault`` / ``gpu_degraded`` notices.

Every NVML call runs off the event loop on a daemon thread: one worker per GPU for the periodic checks, one
thread for ``nvmlEventSetWait_v2``, one for start-up. A watchdog on the loop flags a call that does not
return within ``gpu.call_timeout_s`` as a finding of its own ("NVML call hung"); only that GPU's worker is
stuck, the others carry on, and shutdown never waits for a stuck thread. See docs/gpu-health.md.

Over 450 lines because the NVML calls, the threads that make them and the watchdog that bounds them share
one lifecycle; the pure checks are in gpu_health.py and gpu_xid.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import structlog

from agent.config import GpuConfig
from agent.core.notice import Kind, Observation, Severity
from agent.core.ports import GPU_PIDS
from agent.core.threads import deliver, run_for, wait_or_drop
from agent.sources.base import Sink, Source
from agent.sources.gpu_health import (
    CHECKS,
    CheckState,
    Finding,
    GpuIdentity,
    HeldFindings,
    Hysteresis,
    Thresholds,
    evaluate,
    merge,
    observation,
    recovery_finding,
    xid_finding,
)
from agent.sources.gpu_xid import KmsgXid, XidClass, pci_key
from agent.sources.kmsg import KmsgFollower

log = structlog.get_logger("preemptd.nvml")

T = TypeVar("T")

# NVML return codes (nvml.h); pynvml raises NVMLError subclasses carrying them as ``.value``.
NOT_SUPPORTED = 3
NO_PERMISSION = 4
DRIVER_NOT_LOADED = 9
TIMEOUT = 10
LIBRARY_NOT_FOUND = 12
FUNCTION_NOT_FOUND = 13
GPU_IS_LOST = 15
RESET_REQUIRED = 16
UNKNOWN = 999

FIELD_RECOVERY_ACTION = 230  # NVML_FI_DEV_GET_GPU_RECOVERY_ACTION (R570+)
EVENT_SBE, EVENT_DBE, EVENT_XID = 0x1, 0x2, 0x8
EVENT_GPU_UNAVAILABLE, EVENT_RECOVERY_ACTION = 0x4000, 0x8000
EVENT_MASK = EVENT_SBE | EVENT_DBE | EVENT_XID | EVENT_GPU_UNAVAILABLE | EVENT_RECOVERY_ACTION
DEFAULT_LIBRARY = "libnvidia-ml.so.1"

_ERROR_NAMES = {
    NOT_SUPPORTED: "Not Supported",
    NO_PERMISSION: "Insufficient Permissions",
    DRIVER_NOT_LOADED: "Driver Not Loaded",
    TIMEOUT: "Timeout",
    LIBRARY_NOT_FOUND: "NVML Shared Library Not Found",
    FUNCTION_NOT_FOUND: "Function Not Found",
    GPU_IS_LOST: "GPU is lost",
    RESET_REQUIRED: "GPU requires restart",
    UNKNOWN: "Unknown Error",
}


def _pynvml() -> Any:
    import pynvml

    return pynvml


def error_code(exc: BaseException) -> int | None:
    """The NVML return code of a pynvml exception, None for anything else."""
    if type(exc).__name__ == "NVMLLibraryMismatchError":
        # pynvml's wrapper for an unversioned call whose versioned symbol the driver lacks (an older driver
        # without nvmlDeviceGetComputeRunningProcesses_v3): the call is not there.
        return FUNCTION_NOT_FOUND
    value = getattr(exc, "value", None)
    if type(exc).__name__.startswith("NVMLError") and isinstance(value, int):
        return value
    return None


def error_text(code: int) -> str:
    # Not str(exc): for an unknown code pynvml asks the library (nvmlErrorString), which may be wedged.
    return f"{_ERROR_NAMES.get(code, 'NVML error')} ({code})"


def load_library(path: Path | None) -> None:
    """Make pynvml use ``path`` (or the system's library for None) from the next ``nvmlInit`` on.

    pynvml loads ``libnvidia-ml.so.1`` itself, has no path setting, and caches every function pointer it
    looks up; switching libraries therefore swaps ``nvmlLib`` and empties that cache, under pynvml's lock.
    Raises OSError when the library cannot be loaded."""
    pynvml = _pynvml()
    with pynvml.libLoadLock:
        current = pynvml.nvmlLib
        current_name = getattr(current, "_name", None) if current is not None else None
        wanted = str(path) if path is not None else DEFAULT_LIBRARY
        if current is not None and current_name == wanted:
            return
        pynvml.nvmlLib = ctypes.CDLL(wanted) if path is not None else None
        pynvml._nvmlGetFunctionPointer_cache.clear()


class _CallWatch:
    """Which NVML call a thread is in and since when; read by the watchdog on the loop."""

    def __init__(self) -> None:
        self.call: str | None = None
        self.started = 0.0

    def run(self, name: str, fn: Callable[..., T], *args: Any) -> T:
        self.call, self.started = name, time.monotonic()
        try:
            return fn(*args)
        finally:
            self.call = None

    def stuck_for(self, now: float) -> float:
        return now - self.started if self.call is not None else 0.0


class _Worker:
    """A daemon thread running NVML jobs one after another. A job that hangs leaves only this thread stuck;
    the process can still exit (daemon) and nobody joins it without a bound."""

    def __init__(self, name: str) -> None:
        self.watch = _CallWatch()
        self._jobs: list[
            tuple[Callable[[_CallWatch], Any], asyncio.Future[Any], asyncio.AbstractEventLoop]
        ] = []
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[_CallWatch], T]) -> asyncio.Future[T]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        with self._cond:
            self._jobs.append((job, future, loop))
            self._cond.notify()
        return future

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._jobs and not self._closed:
                    self._cond.wait()
                if not self._jobs:
                    return
                job, future, loop = self._jobs.pop(0)
            run_for(loop, future, job, self.watch)


@dataclass
class _Gpu:
    """What the monitor knows of one GPU; owned by the loop thread."""

    ident: GpuIdentity
    handle: Any
    worker: _Worker
    checks: dict[str, CheckState] = field(default_factory=lambda: dict.fromkeys(CHECKS, CheckState.PENDING))
    errors: dict[str, str] = field(default_factory=dict)
    pids: list[int] = field(default_factory=list)
    events: str = "pending"
    inflight: asyncio.Future[_PollResult] | None = None
    hung_call: str | None = None
    unknown_streak: int = 0
    lost: bool = False
    last_xid: dict[str, Any] | None = None
    sbe_events: int = 0

    def disabled(self) -> frozenset[str]:
        return frozenset(c for c, s in self.checks.items() if s is CheckState.NOT_SUPPORTED)


@dataclass
class _PollResult:
    values: dict[str, Any] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)
    failures: dict[str, str] = field(default_factory=dict)
    lost: int | None = None


@dataclass
class _Startup:
    driver_version: str
    gpus: list[tuple[GpuIdentity, Any]]
    # GPUs whose handle or identity could not be read (a GPU that fell off the bus before the agent
    # started): index -> (what is known of it, the NVML error code).
    broken: list[tuple[GpuIdentity, int]] = field(default_factory=list)


def _address(handle: Any) -> int | None:
    try:
        address = ctypes.cast(handle, ctypes.c_void_p).value
    except (TypeError, ctypes.ArgumentError):
        return None
    return int(address) if address is not None else None


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


# --- thread side: every function below runs on a worker thread ----------------------------------------


def _start(watch: _CallWatch, library_path: Path | None) -> _Startup:
    pynvml = _pynvml()
    load_library(library_path)
    watch.run("nvmlInit", pynvml.nvmlInit)
    version = _text(watch.run("nvmlSystemGetDriverVersion", pynvml.nvmlSystemGetDriverVersion))
    count = watch.run("nvmlDeviceGetCount", pynvml.nvmlDeviceGetCount)
    startup = _Startup(driver_version=version, gpus=[])
    for index in range(count):
        uuid, name, bus_id = f"GPU-index-{index}", "unknown", ""
        try:
            handle = watch.run("nvmlDeviceGetHandleByIndex", pynvml.nvmlDeviceGetHandleByIndex, index)
            uuid = _text(watch.run("nvmlDeviceGetUUID", pynvml.nvmlDeviceGetUUID, handle))
            name = _text(watch.run("nvmlDeviceGetName", pynvml.nvmlDeviceGetName, handle))
            bus_id = _text(watch.run("nvmlDeviceGetPciInfo", pynvml.nvmlDeviceGetPciInfo, handle).busId)
        except Exception as exc:
            code = error_code(exc)
            if code is None:
                raise
            ident = GpuIdentity(uuid=uuid, index=index, name=name, pci_bus_id=bus_id)
            startup.broken.append((ident, code))
            continue
        startup.gpus.append((GpuIdentity(uuid=uuid, index=index, name=name, pci_bus_id=bus_id), handle))
    return startup


def _read_clocks(watch: _CallWatch, handle: Any) -> int:
    pynvml = _pynvml()
    try:
        return int(
            watch.run(
                "nvmlDeviceGetCurrentClocksEventReasons",
                pynvml.nvmlDeviceGetCurrentClocksEventReasons,
                handle,
            )
        )
    except pynvml.NVMLError_FunctionNotFound:  # drivers before R535
        return int(
            watch.run(
                "nvmlDeviceGetCurrentClocksThrottleReasons",
                pynvml.nvmlDeviceGetCurrentClocksThrottleReasons,
                handle,
            )
        )


def _read_recovery_action(watch: _CallWatch, handle: Any) -> int:
    pynvml = _pynvml()
    values = watch.run(
        "nvmlDeviceGetFieldValues", pynvml.nvmlDeviceGetFieldValues, handle, [FIELD_RECOVERY_ACTION]
    )
    entry = values[0]
    if entry.nvmlReturn != 0:
        raise pynvml.NVMLError(entry.nvmlReturn)
    kind = entry.valueType
    if kind == pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG:
        return int(entry.value.ullVal)
    if kind == pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG:
        return int(entry.value.ulVal)
    if kind == pynvml.NVML_VALUE_TYPE_SIGNED_INT:
        return int(entry.value.siVal)
    return int(entry.value.uiVal)


def _read(watch: _CallWatch, check: str, handle: Any) -> Any:
    pynvml = _pynvml()
    if check == "ecc":
        return watch.run(
            "nvmlDeviceGetTotalEccErrors",
            pynvml.nvmlDeviceGetTotalEccErrors,
            handle,
            pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
            pynvml.NVML_VOLATILE_ECC,
        )
    if check == "retired_pages":
        return watch.run(
            "nvmlDeviceGetRetiredPagesPendingStatus", pynvml.nvmlDeviceGetRetiredPagesPendingStatus, handle
        )
    if check == "remapped_rows":
        return watch.run("nvmlDeviceGetRemappedRows", pynvml.nvmlDeviceGetRemappedRows, handle)
    if check == "temperature":
        temp = watch.run(
            "nvmlDeviceGetTemperature", pynvml.nvmlDeviceGetTemperature, handle, pynvml.NVML_TEMPERATURE_GPU
        )
        thresholds = []
        for which in (pynvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN, pynvml.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN):
            try:
                thresholds.append(
                    watch.run(
                        "nvmlDeviceGetTemperatureThreshold",
                        pynvml.nvmlDeviceGetTemperatureThreshold,
                        handle,
                        which,
                    )
                )
            except pynvml.NVMLError_NotSupported:
                thresholds.append(None)
        if thresholds == [None, None]:
            raise pynvml.NVMLError(NOT_SUPPORTED)  # a temperature without thresholds says nothing
        return (temp, thresholds[0], thresholds[1])
    if check == "clocks":
        return _read_clocks(watch, handle)
    if check == "power":
        usage = watch.run("nvmlDeviceGetPowerUsage", pynvml.nvmlDeviceGetPowerUsage, handle)
        limit = watch.run("nvmlDeviceGetEnforcedPowerLimit", pynvml.nvmlDeviceGetEnforcedPowerLimit, handle)
        return (usage, limit)
    if check == "recovery_action":
        return _read_recovery_action(watch, handle)
    if check == "processes":
        procs = watch.run(
            "nvmlDeviceGetComputeRunningProcesses", pynvml.nvmlDeviceGetComputeRunningProcesses, handle
        )
        return sorted({int(p.pid) for p in procs})
    raise ValueError(f"unknown check {check!r}")


def _poll(watch: _CallWatch, handle: Any, skip: frozenset[str]) -> _PollResult:
    result = _PollResult()
    for check in CHECKS:
        if check in skip:
            continue
        try:
            result.values[check] = _read(watch, check, handle)
        except Exception as exc:
            code = error_code(exc)
            if code is None:
                # Not an NVML error (a binding that does not fit this driver): this check fails, the
                # others are still read.
                result.failures[check] = repr(exc)
                continue
            if code in (GPU_IS_LOST, RESET_REQUIRED):
                result.lost = code
                return result
            result.errors[check] = code
    return result


def _nvml_shutdown(watch: _CallWatch) -> None:
    watch.run("nvmlShutdown", _pynvml().nvmlShutdown)


# --- the source -----------------------------------------------------------------------------------------


class NvmlSource(Source):
    name = "nvml"

    def __init__(self, config: GpuConfig) -> None:
        self.config = config
        self.limits = Thresholds(
            temperature_shutdown_margin_c=config.temperature_shutdown_margin_c,
            power_tolerance=config.power_tolerance,
            clock_event_mask=config.clock_event_mask,
        )
        self._hyst = Hysteresis(config.raise_after, config.clear_after)
        self._held = HeldFindings()
        self._system: dict[str, Observation] = {}
        self._gpus: dict[str, _Gpu] = {}
        self._broken: dict[str, tuple[GpuIdentity, int]] = {}
        self._rounds = 0  # poll rounds since this run started
        self._by_pci: dict[tuple[int, int, int], str] = {}
        self._driver_version: str | None = None
        self._state = "starting"
        self._why: str | None = None
        self._sink: Sink | None = None
        self._stop = threading.Event()
        self._events_watch = _CallWatch()
        self._events_done = asyncio.Event()
        self._events_state = "off"
        self._kmsg_state: dict[str, Any] = {"enabled": config.kmsg, "path": str(config.kmsg_path)}
        self._kmsg_seen: set[tuple[str, int]] = set()

    # -- public --------------------------------------------------------------------------------------

    def compute_pids(self) -> dict[str, list[int]]:
        """GPU UUID -> PIDs of the compute processes NVML last reported on it (for signalling)."""
        return {uuid: list(gpu.pids) for uuid, gpu in self._gpus.items()}

    def capabilities(self) -> Mapping[str, Callable[..., Any]]:
        return {GPU_PIDS: self.compute_pids}

    def status(self) -> Mapping[str, Any]:
        """Under ``sources.nvml`` in ``/v1/status``; ``gpus`` (one entry per GPU, by index, each with its UUID)
        is also collected into the top-level ``gpus`` list by the agent."""
        gpus = [
            {
                **gpu.ident.to_json(),
                "checks": {check: state.value for check, state in gpu.checks.items()},
                "errors": dict(gpu.errors),
                "events": gpu.events,
                "compute_pids": list(gpu.pids),
                "lost": gpu.lost,
                "hung_call": gpu.hung_call,
                "last_xid": gpu.last_xid,
                "single_bit_ecc_events": gpu.sbe_events,
            }
            for gpu in sorted(self._gpus.values(), key=lambda g: g.ident.index)
        ]
        gpus.extend(
            {**ident.to_json(), "lost": True, "enumeration_error": error_text(code), "checks": {}}
            for ident, code in self._broken.values()
        )
        gpus.sort(key=lambda g: int(g["index"]))
        return {
            # Not "state": the agent merges these keys with the source's health (state, since, detail...).
            "monitor": self._state,
            "why": self._why,
            "driver_version": self._driver_version,
            "library": str(self.config.library_path or DEFAULT_LIBRARY),
            "events": self._events_state,
            "kmsg": dict(self._kmsg_state),
            "gpus": gpus,
        }

    async def run(self, sink: Sink) -> None:
        self._sink = sink
        self._stop.clear()
        # A restart after a crash starts from a fresh enumeration; active findings are kept.
        self._gpus, self._by_pci, self._system, self._broken = {}, {}, {}, {}
        self._rounds = 0
        self._events_done = asyncio.Event()
        loop = asyncio.get_running_loop()
        startup_worker = _Worker("preemptd-nvml-start")
        event_thread: threading.Thread | None = None
        kmsg: KmsgFollower | None = None
        started = False
        try:
            startup = await self._startup(startup_worker, sink)
            if startup is None:
                return
            started = True
            self._driver_version = startup.driver_version
            if not startup.gpus and not startup.broken:
                self._disable(sink, f"NVML (driver {startup.driver_version}) sees no GPU on this host")
                return
            for ident, code in startup.broken:
                # Not polled: without a handle there is nothing to ask. It stays a fault until the agent
                # restarts (a GPU that fell off the bus needs a reset or a reboot anyway).
                self._broken[ident.uuid] = (ident, code)
                log.error("nvml_gpu_unusable", gpu=ident.uuid, index=ident.index, error=error_text(code))
                reason = f"cannot be used (NVML: {error_text(code)} while enumerating GPUs)"
                self._hyst.bad(observation(ident, "lost", Finding(XidClass.FATAL, reason)), urgent=True)
            for ident, handle in startup.gpus:
                self._gpus[ident.uuid] = _Gpu(ident, handle, _Worker(f"preemptd-nvml-gpu{ident.index}"))
                key = pci_key(ident.pci_bus_id)
                if key is not None:
                    self._by_pci[key] = ident.uuid
            log.info("nvml_started", driver_version=startup.driver_version, gpus=len(self._gpus))
            self._state = "running"
            event_thread = threading.Thread(
                target=self._event_loop, args=(loop,), name="preemptd-nvml-events", daemon=True
            )
            event_thread.start()
            if self.config.kmsg:
                kmsg = KmsgFollower(
                    self.config.kmsg_path,
                    on_xid=lambda xid: deliver(loop, self._on_kmsg_xid, xid),
                    on_state=lambda state, why: deliver(loop, self._on_kmsg_state, state, why),
                )
                kmsg.start()
            while True:
                await self._poll_round(sink)
                self._rounds += 1
                self._publish()
                await asyncio.sleep(self.config.poll_interval_s)
        finally:
            self._stop.set()
            self._state = "stopped" if self._state == "running" else self._state
            await self._shutdown(startup_worker, event_thread, kmsg, started)

    # -- start-up and shutdown -------------------------------------------------------------------------

    async def _startup(self, worker: _Worker, sink: Sink) -> _Startup | None:
        future = worker.submit(lambda watch: _start(watch, self.config.library_path))
        try:
            return await self._watched(worker, future, self._startup_hung)
        except ImportError as exc:
            why = f"the nvidia-ml-py package (module pynvml) is not installed: {exc}"
        except OSError as exc:
            why = (
                f"cannot load the NVML library {self.config.library_path}: {exc}; "
                "check gpu.library_path or install the NVIDIA driver"
            )
        except Exception as exc:
            code = error_code(exc)
            if code == LIBRARY_NOT_FOUND:
                why = (
                    f"NVML library {DEFAULT_LIBRARY} not found: no NVIDIA driver on this host "
                    "(set gpu.library_path if it lives elsewhere, or gpu.enabled = false)"
                )
            elif code == DRIVER_NOT_LOADED:
                why = "the NVIDIA kernel driver is not loaded (nvmlInit: Driver Not Loaded)"
            elif code == NO_PERMISSION:
                why = "no permission to use NVML (nvmlInit: Insufficient Permissions)"
            elif code is not None:
                raise RuntimeError(f"NVML start-up failed: {error_text(code)}") from exc
            else:
                raise
        finally:
            worker.close()
            self._system.pop("driver/hung", None)
        self._disable(sink, why)
        return None

    def _disable(self, sink: Sink, why: str) -> None:
        self._state, self._why = "disabled", why
        sink.replace([])
        sink.disable(why)

    async def _watched(
        self, worker: _Worker, future: asyncio.Future[T], on_hung: Callable[[str, float], None]
    ) -> T:
        """Await ``future``; while the worker's current call runs past the bound, report it (once)."""
        reported = False
        while True:
            if await wait_or_drop(future, self._tick()):
                return future.result()
            stuck = worker.watch.stuck_for(time.monotonic())
            if not reported and stuck > self.config.call_timeout_s and worker.watch.call is not None:
                reported = True
                on_hung(worker.watch.call, stuck)

    def _startup_hung(self, call: str, stuck: float) -> None:
        self._system["driver/hung"] = self._hung_obs("driver/hung", "the NVIDIA driver", call, None)
        self._publish()

    def _tick(self) -> float:
        return max(0.01, min(0.25, self.config.call_timeout_s / 4))

    async def _shutdown(
        self,
        startup_worker: _Worker,
        event_thread: threading.Thread | None,
        kmsg: KmsgFollower | None,
        started: bool,
    ) -> None:
        for gpu in self._gpus.values():
            gpu.worker.close()
        if kmsg is not None:
            kmsg.stop()
        if not started:
            return
        if event_thread is not None:
            # The thread notices the stop flag within one wait slice; a wedged wait is not waited for.
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._events_done.wait(), self.config.event_wait_ms / 1000.0 + 0.5)
        stuck = [g.ident.uuid for g in self._gpus.values() if g.worker.watch.call is not None]
        events_running = event_thread is not None and not self._events_done.is_set()
        if events_running or stuck:
            # nvmlShutdown while another thread is inside NVML is not safe; the process exit cleans up.
            log.warning("nvml_shutdown_skipped", stuck_gpus=stuck, event_wait_running=events_running)
            return
        worker = _Worker("preemptd-nvml-stop")
        try:
            future = worker.submit(_nvml_shutdown)
            await asyncio.wait({future}, timeout=0.5)
        finally:
            worker.close()

    # -- periodic checks -------------------------------------------------------------------------------

    async def _poll_round(self, sink: Sink) -> None:
        pending: dict[asyncio.Future[_PollResult], _Gpu] = {}
        for gpu in self._gpus.values():
            if gpu.inflight is not None and not gpu.inflight.done():
                continue  # still inside a hung call: its finding stays up, the other GPUs go on
            if gpu.inflight is not None:
                self._apply_poll(gpu, gpu.inflight)
            gpu.inflight = gpu.worker.submit(functools.partial(_poll, handle=gpu.handle, skip=gpu.disabled()))
            pending[gpu.inflight] = gpu
        while pending:
            done, _ = await asyncio.wait(set(pending), timeout=self._tick())
            for future in done:
                self._apply_poll(pending.pop(future), future)
            now = time.monotonic()
            for future, gpu in list(pending.items()):
                stuck = gpu.worker.watch.stuck_for(now)
                call = gpu.worker.watch.call
                if call is not None and stuck > self.config.call_timeout_s:
                    del pending[future]
                    self._gpu_hung(gpu, call)
        self._check_event_thread()
        errors = {
            f"{gpu.ident.uuid}/{check}": message
            for gpu in self._gpus.values()
            for check, message in gpu.errors.items()
        }
        if errors:
            first = next(iter(errors.items()))
            sink.error(f"NVML check failed: {first[0]}: {first[1]}", failures=errors)
        else:
            sink.ok(gpus=len(self._gpus), driver_version=self._driver_version)

    def _apply_poll(self, gpu: _Gpu, future: asyncio.Future[_PollResult]) -> None:
        gpu.inflight = None
        if future.cancelled():
            return
        error = future.exception()
        if error is not None:
            log.error("nvml_poll_failed", gpu=gpu.ident.uuid, error=repr(error))
            gpu.errors["poll"] = repr(error)
            return
        result = future.result()
        gpu.errors.pop("poll", None)
        hung_key = f"{gpu.ident.uuid}/hung"
        if gpu.hung_call is not None:
            log.info("nvml_call_returned", gpu=gpu.ident.uuid, call=gpu.hung_call)
            gpu.hung_call = None
        self._hyst.good(hung_key)
        lost_key = f"{gpu.ident.uuid}/lost"
        if result.lost is not None:
            gpu.lost = True
            reason = (
                "fallen off the bus (NVML: GPU is lost)"
                if result.lost == GPU_IS_LOST
                else "the GPU needs a reset (NVML: GPU requires restart)"
            )
            finding = Finding(XidClass.FATAL, reason, {"nvml_error": error_text(result.lost)})
            self._hyst.bad(observation(gpu.ident, "lost", finding), urgent=True)
            return
        unknown = any(code == UNKNOWN for code in result.errors.values())
        gpu.unknown_streak = gpu.unknown_streak + 1 if unknown else 0
        if gpu.unknown_streak >= self.config.unknown_after:
            gpu.lost = True
            finding = Finding(
                XidClass.FATAL,
                "not responding (NVML: Unknown Error on every poll)",
                {"nvml_error": error_text(UNKNOWN), "polls": gpu.unknown_streak},
            )
            self._hyst.bad(observation(gpu.ident, "lost", finding), urgent=True)
        elif not unknown:
            gpu.lost = False
            self._hyst.good(lost_key)
        for check in CHECKS:
            if check in result.failures:
                gpu.checks[check] = CheckState.ERROR
                gpu.errors[check] = result.failures[check]
            elif check in result.errors:
                self._check_failed(gpu, check, result.errors[check])
            elif check in result.values:
                gpu.errors.pop(check, None)
                self._check_read(gpu, check, result.values[check])

    def _check_failed(self, gpu: _Gpu, check: str, code: int) -> None:
        if code in (NOT_SUPPORTED, FUNCTION_NOT_FOUND):
            # Normal for many calls on many SKUs and drivers: this one check is off for this GPU.
            gpu.checks[check] = CheckState.NOT_SUPPORTED
            gpu.errors.pop(check, None)
            self._hyst.forget(f"{gpu.ident.uuid}/{check}")
            log.info("nvml_check_not_supported", gpu=gpu.ident.uuid, check=check)
            return
        gpu.checks[check] = CheckState.ERROR
        gpu.errors[check] = error_text(code)

    def _check_read(self, gpu: _Gpu, check: str, value: Any) -> None:
        if check == "processes":
            gpu.pids = list(value)
            gpu.checks[check] = CheckState.OK
            return
        finding = evaluate(check, value, self.limits)
        key = f"{gpu.ident.uuid}/{check}"
        if finding is None:
            self._hyst.good(key)
        else:
            self._hyst.bad(observation(gpu.ident, check, finding), urgent=finding.cls is XidClass.FATAL)
        gpu.checks[check] = CheckState.FINDING if self._hyst.is_active(key) else CheckState.OK

    def _gpu_hung(self, gpu: _Gpu, call: str) -> None:
        if gpu.hung_call is None:
            log.error("nvml_call_hung", gpu=gpu.ident.uuid, call=call, bound_s=self.config.call_timeout_s)
        gpu.hung_call = call
        self._hyst.bad(self._hung_obs("hung", gpu.ident.label, call, gpu.ident), urgent=True)

    def _hung_obs(self, condition: str, what: str, call: str, gpu: GpuIdentity | None) -> Observation:
        reason = f"NVML call hung: {call} on {what} did not return within {self.config.call_timeout_s:g} s"
        detail: dict[str, Any] = {"call": call, "bound_s": self.config.call_timeout_s, "condition": "hung"}
        if gpu is not None:
            obs = observation(gpu, condition, Finding(XidClass.FATAL, "", detail))
            return Observation(obs.key, obs.kind, reason, severity=obs.severity, detail=obs.detail)
        return Observation(condition, Kind.GPU_FAULT, reason, severity=Severity.CRITICAL, detail=detail)

    # -- events ----------------------------------------------------------------------------------------

    def _event_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        """The event thread: register every GPU, then wait for events in short slices until stopped."""
        try:
            self._watch_events(loop)
        finally:
            deliver(loop, self._events_done.set)

    def _watch_events(self, loop: asyncio.AbstractEventLoop) -> None:
        pynvml = _pynvml()
        watch = self._events_watch
        gpus = [(g.ident.uuid, g.handle) for g in self._gpus.values()]
        by_address = {_address(handle): gpu_uuid for gpu_uuid, handle in gpus}
        try:
            event_set = watch.run("nvmlEventSetCreate", pynvml.nvmlEventSetCreate)
        except Exception as exc:
            deliver(loop, self._on_events_state, "unavailable", None, f"nvmlEventSetCreate: {exc!r}")
            return
        registered = 0
        for gpu_uuid, handle in gpus:
            try:
                supported = watch.run(
                    "nvmlDeviceGetSupportedEventTypes", pynvml.nvmlDeviceGetSupportedEventTypes, handle
                )
                mask = EVENT_MASK & int(supported)
                if not mask:
                    raise pynvml.NVMLError(NOT_SUPPORTED)
                watch.run(
                    "nvmlDeviceRegisterEvents", pynvml.nvmlDeviceRegisterEvents, handle, mask, event_set
                )
                registered += 1
                deliver(loop, self._on_events_state, "registered", gpu_uuid, f"mask=0x{mask:x}")
            except Exception as exc:
                code = error_code(exc)
                state = "not_supported" if code in (NOT_SUPPORTED, FUNCTION_NOT_FOUND) else "error"
                deliver(loop, self._on_events_state, state, gpu_uuid, error_text(code) if code else repr(exc))
        if not registered:
            deliver(loop, self._on_events_state, "unavailable", None, "no GPU supports the events")
            watch.run("nvmlEventSetFree", pynvml.nvmlEventSetFree, event_set)
            return
        deliver(loop, self._on_events_state, "waiting", None, None)
        try:
            while not self._stop.is_set():
                try:
                    data = watch.run(
                        "nvmlEventSetWait_v2",
                        pynvml.nvmlEventSetWait_v2,
                        event_set,
                        self.config.event_wait_ms,
                    )
                except Exception as exc:
                    code = error_code(exc)
                    if code == TIMEOUT:
                        continue
                    if code is None:
                        raise
                    deliver(loop, self._on_events_state, "error", None, error_text(code))
                    self._stop.wait(1.0)
                    continue
                uuid: str | None
                try:
                    # Compare UUIDs, not the ctypes pointer objects.
                    uuid = _text(watch.run("nvmlDeviceGetUUID", pynvml.nvmlDeviceGetUUID, data.device))
                except Exception as exc:
                    if error_code(exc) is None:
                        raise
                    # A lost GPU cannot say its UUID: fall back to the handle's address.
                    uuid = by_address.get(_address(data.device))
                deliver(loop, self._on_event, uuid, int(data.eventType), int(data.eventData))
        finally:
            try:
                watch.run("nvmlEventSetFree", pynvml.nvmlEventSetFree, event_set)
            except Exception as exc:
                log.debug("nvml_event_set_free_failed", error=repr(exc))

    def _on_events_state(self, state: str, uuid: str | None, why: str | None) -> None:
        if uuid is not None and uuid in self._gpus:
            self._gpus[uuid].events = state if why is None or state == "registered" else f"{state}: {why}"
            return
        self._events_state = state if why is None else f"{state}: {why}"
        if state == "error":
            log.warning("nvml_event_wait_failed", error=why)

    def _on_event(self, uuid: str | None, event_type: int, data: int) -> None:
        gpu = self._gpus.get(uuid) if uuid else None
        if gpu is None:
            log.warning("nvml_event_unknown_gpu", event_type=event_type, data=data)
            return
        now = time.monotonic()
        if event_type & EVENT_XID:
            self._xid(gpu, data, "nvml", None)
        if event_type & EVENT_DBE:
            finding = Finding(XidClass.FATAL, "double-bit ECC error", {"event": "double_bit_ecc"})
            self._held.add(
                observation(gpu.ident, "double-bit-ecc", finding, "nvml"), now, self.config.xid_hold_s
            )
        if event_type & EVENT_SBE:
            gpu.sbe_events += 1
        if event_type & EVENT_GPU_UNAVAILABLE:
            finding = Finding(
                XidClass.FATAL, "the driver reports the GPU unavailable", {"event": "gpu_unavailable"}
            )
            self._held.add(
                observation(gpu.ident, "unavailable", finding, "nvml"), now, self.config.xid_hold_s
            )
        if event_type & EVENT_RECOVERY_ACTION:
            recovery = recovery_finding(data)
            if recovery is not None:
                obs = observation(gpu.ident, "recovery_action", recovery, "nvml")
                self._held.add(obs, now, self.config.xid_hold_s)
        self._publish()

    def _xid(self, gpu: _Gpu, xid: int, via: str, text: str | None) -> None:
        finding = xid_finding(xid, self.config.xid_classes, self.config.xid_default)
        gpu.last_xid = {"xid": xid, "class": finding.cls.value, "via": via, "text": text, "at": time.time()}
        log.warning("gpu_xid", gpu=gpu.ident.uuid, xid=xid, cls=finding.cls.value, via=via, text=text)
        if finding.cls is XidClass.INFO:
            return
        detail = dict(finding.detail)
        if text:
            detail["text"] = text
        finding = Finding(finding.cls, finding.reason, detail)
        obs = observation(gpu.ident, f"xid/{xid}", finding, via)
        # The same XID from NVML and from the kernel log lands on the same key: one notice.
        self._held.add(obs, time.monotonic(), self.config.xid_hold_s)

    def _on_kmsg_xid(self, found: KmsgXid) -> None:
        uuid = self._by_pci.get(found.pci)
        gpu = self._gpus.get(uuid) if uuid else None
        if gpu is None:
            log.warning("kmsg_xid_unknown_gpu", pci=found.pci, xid=found.xid, text=found.text)
            return
        self._xid(gpu, found.xid, "kmsg", found.text)
        self._publish()

    def _on_kmsg_state(self, state: str, why: str | None) -> None:
        self._kmsg_state.update(state=state, why=why)
        if why:
            log.info("kmsg_state", state=state, why=why)

    def _check_event_thread(self) -> None:
        bound = self.config.event_wait_ms / 1000.0 + self.config.call_timeout_s
        watch = self._events_watch
        call = watch.call
        key = "events/hung"
        if call is not None and watch.stuck_for(time.monotonic()) > bound:
            if key not in self._system:
                log.error("nvml_call_hung", call=call, bound_s=bound)
            self._system[key] = self._hung_obs(key, "the event set", call, None)
        else:
            self._system.pop(key, None)

    # -- publishing ------------------------------------------------------------------------------------

    def _publish(self) -> None:
        if self._sink is None:
            return
        observations = merge(self._hyst.active(), self._held.active(time.monotonic()), self._system)
        if self._rounds < self.config.raise_after:
            # Warm-up after a (re)start: the agent may have restored our notices from its state file, and a
            # condition that still holds needs raise_after polls to be seen again. Clearing now would send
            # cleared + a new notice with a new id for one condition; so raise only, clear from then on.
            for obs in observations:
                self._sink.observe(obs)
            return
        self._sink.replace(observations)
