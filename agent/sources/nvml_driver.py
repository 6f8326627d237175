"""The NVML driver side of the GPU monitor: the thin wrapper over pynvml that every call goes through.

It maps pynvml's exceptions to NVML return codes (:func:`error_code`, :func:`error_text`), points pynvml at a
library (:func:`load_library`), and makes the calls themselves: start-up enumeration (:func:`start`), one
poll of a GPU's periodic checks (:func:`poll`) and the event wait (:func:`watch_events`). Everything here
runs on a worker thread; :class:`Worker` is that thread and :class:`CallWatch` records which call it is in,
so the loop can bound a wedged call (``gpu.call_timeout_s``). What the readings mean is in gpu_health.py and
nvml_gpus.py; the source that schedules all this is nvml.py.
"""

from __future__ import annotations

import asyncio
import ctypes
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import structlog

from agent.core.threads import run_for
from agent.sources.gpu_health import CHECKS, GpuIdentity

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


class CallWatch:
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


class Worker:
    """A daemon thread running NVML jobs one after another. A job that hangs leaves only this thread stuck;
    the process can still exit (daemon) and nobody joins it without a bound."""

    def __init__(self, name: str) -> None:
        self.watch = CallWatch()
        self._jobs: list[
            tuple[Callable[[CallWatch], Any], asyncio.Future[Any], asyncio.AbstractEventLoop]
        ] = []
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[CallWatch], T]) -> asyncio.Future[T]:
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
class PollResult:
    values: dict[str, Any] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)
    failures: dict[str, str] = field(default_factory=dict)
    lost: int | None = None


@dataclass
class Startup:
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


def start(watch: CallWatch, library_path: Path | None) -> Startup:
    pynvml = _pynvml()
    load_library(library_path)
    watch.run("nvmlInit", pynvml.nvmlInit)
    version = _text(watch.run("nvmlSystemGetDriverVersion", pynvml.nvmlSystemGetDriverVersion))
    count = watch.run("nvmlDeviceGetCount", pynvml.nvmlDeviceGetCount)
    startup = Startup(driver_version=version, gpus=[])
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


def _read_clocks(watch: CallWatch, handle: Any) -> int:
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


def _read_recovery_action(watch: CallWatch, handle: Any) -> int:
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


def read_check(watch: CallWatch, check: str, handle: Any) -> Any:
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


def poll(watch: CallWatch, handle: Any, skip: frozenset[str]) -> PollResult:
    result = PollResult()
    for check in CHECKS:
        if check in skip:
            continue
        try:
            result.values[check] = read_check(watch, check, handle)
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


def nvml_shutdown(watch: CallWatch) -> None:
    watch.run("nvmlShutdown", _pynvml().nvmlShutdown)


def watch_events(
    watch: CallWatch,
    gpus: Sequence[tuple[str, Any]],
    wait_ms: int,
    stop: threading.Event,
    on_state: Callable[[str, str | None, str | None], None],
    on_event: Callable[[str | None, int, int], None],
) -> None:
    """The event thread's work: register each of ``gpus`` (uuid, handle) for XID, ECC, unavailable and
    recovery-action events, then wait for events in slices of ``wait_ms`` until ``stop`` is set.

    ``on_state(state, uuid or None, why)`` says how registration and waiting go (per GPU, or for the event
    set as a whole); ``on_event(uuid, event type, event data)`` hands over each event. Both are called on
    this thread."""
    pynvml = _pynvml()
    by_address = {_address(handle): gpu_uuid for gpu_uuid, handle in gpus}
    try:
        event_set = watch.run("nvmlEventSetCreate", pynvml.nvmlEventSetCreate)
    except Exception as exc:
        on_state("unavailable", None, f"nvmlEventSetCreate: {exc!r}")
        return
    if not _register_events(watch, gpus, event_set, on_state):
        on_state("unavailable", None, "no GPU supports the events")
        watch.run("nvmlEventSetFree", pynvml.nvmlEventSetFree, event_set)
        return
    on_state("waiting", None, None)
    try:
        while not stop.is_set():
            data = _wait_event(watch, event_set, wait_ms, stop, on_state)
            if data is not None:
                on_event(_event_uuid(watch, data, by_address), int(data.eventType), int(data.eventData))
    finally:
        try:
            watch.run("nvmlEventSetFree", pynvml.nvmlEventSetFree, event_set)
        except Exception as exc:
            log.debug("nvml_event_set_free_failed", error=repr(exc))


def _register_events(
    watch: CallWatch,
    gpus: Sequence[tuple[str, Any]],
    event_set: Any,
    on_state: Callable[[str, str | None, str | None], None],
) -> int:
    """Register each GPU for the events it supports of ``EVENT_MASK``; the number registered."""
    pynvml = _pynvml()
    registered = 0
    for gpu_uuid, handle in gpus:
        try:
            supported = watch.run(
                "nvmlDeviceGetSupportedEventTypes", pynvml.nvmlDeviceGetSupportedEventTypes, handle
            )
            mask = EVENT_MASK & int(supported)
            if not mask:
                raise pynvml.NVMLError(NOT_SUPPORTED)
            watch.run("nvmlDeviceRegisterEvents", pynvml.nvmlDeviceRegisterEvents, handle, mask, event_set)
            registered += 1
            on_state("registered", gpu_uuid, f"mask=0x{mask:x}")
        except Exception as exc:
            code = error_code(exc)
            state = "not_supported" if code in (NOT_SUPPORTED, FUNCTION_NOT_FOUND) else "error"
            on_state(state, gpu_uuid, error_text(code) if code else repr(exc))
    return registered


def _wait_event(
    watch: CallWatch,
    event_set: Any,
    wait_ms: int,
    stop: threading.Event,
    on_state: Callable[[str, str | None, str | None], None],
) -> Any:
    """One wait of ``wait_ms`` on the event set: the event's data, or None when none came (a timeout, or an
    NVML error, told through ``on_state`` and followed by a pause); an error that is not NVML's is raised."""
    pynvml = _pynvml()
    try:
        return watch.run("nvmlEventSetWait_v2", pynvml.nvmlEventSetWait_v2, event_set, wait_ms)
    except Exception as exc:
        code = error_code(exc)
        if code == TIMEOUT:
            return None
        if code is None:
            raise
        on_state("error", None, error_text(code))
        stop.wait(1.0)
        return None


def _event_uuid(watch: CallWatch, data: Any, by_address: Mapping[int | None, str]) -> str | None:
    """The UUID of the GPU an event came from."""
    pynvml = _pynvml()
    try:
        # Compare UUIDs, not the ctypes pointer objects.
        return _text(watch.run("nvmlDeviceGetUUID", pynvml.nvmlDeviceGetUUID, data.device))
    except Exception as exc:
        if error_code(exc) is None:
            raise
        # A lost GPU cannot say its UUID: fall back to the handle's address.
        return by_address.get(_address(data.device))
