"""The GPU health monitor (source ``nvml``): XID and ECC events, periodic NVML checks and the kernel log,
turned into ``gpu_fault`` / ``gpu_degraded`` notices.

Every NVML call runs off the event loop on a daemon thread: one worker per GPU for the periodic checks, one
thread for ``nvmlEventSetWait_v2``, one for start-up. A watchdog on the loop flags a call that does not
return within ``gpu.call_timeout_s`` as a finding of its own ("NVML call hung"); only that GPU's worker is
stuck, the others carry on, and shutdown never waits for a stuck thread. See docs/gpu-health.md.

This module schedules the threads and reports; the NVML calls are in nvml_driver.py, what they become for
each GPU in nvml_gpus.py, and the pure checks in gpu_health.py and gpu_xid.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import structlog

from agent.config import GpuConfig
from agent.core.notice import Observation
from agent.core.ports import GPU_PIDS
from agent.core.threads import deliver, wait_or_drop
from agent.sources.base import Sink, Source
from agent.sources.gpu_health import GpuIdentity
from agent.sources.gpu_xid import KmsgXid, pci_key
from agent.sources.kmsg import KmsgFollower
from agent.sources.nvml_cause import NO_DEVICE, NO_DRIVER, NO_LIBRARY, Diagnosis, diagnose
from agent.sources.nvml_cause import NO_PERMISSION as DENIED
from agent.sources.nvml_driver import (
    DEFAULT_LIBRARY,
    DRIVER_NOT_LOADED,
    LIBRARY_NOT_FOUND,
    NO_PERMISSION,
    CallWatch,
    PollResult,
    Startup,
    Worker,
    error_code,
    error_text,
    nvml_shutdown,
    poll,
    start,
    watch_events,
)
from agent.sources.nvml_gpus import Gpu, GpuFindings

log = structlog.get_logger("preemptd.nvml")

T = TypeVar("T")


class NvmlSource(Source):
    name = "nvml"

    def __init__(self, config: GpuConfig) -> None:
        self.config = config
        self._findings = GpuFindings(config)
        self._system: dict[str, Observation] = {}
        self._gpus: dict[str, Gpu] = {}
        self._broken: dict[str, tuple[GpuIdentity, int]] = {}
        self._rounds = 0  # poll rounds since this run started
        self._by_pci: dict[tuple[int, int, int], str] = {}
        self._driver_version: str | None = None
        self._state = "starting"
        self._why: str | None = None
        self._diagnosis: Diagnosis | None = None
        self._sink: Sink | None = None
        self._stop = threading.Event()
        self._events_watch = CallWatch()
        self._events_done = asyncio.Event()
        self._events_state = "off"
        self._kmsg_state: dict[str, Any] = {"enabled": config.kmsg, "path": str(config.kmsg_path)}
        self._kmsg_seen: set[tuple[str, int]] = set()
        self._kmsg_warned: str | None = None

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
            # Why the GPUs are not seen (problem, cause, the library paths tried, the device nodes, docs).
            "cause": self._diagnosis.to_json() if self._diagnosis is not None else None,
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
        self._diagnosis = None
        self._events_done = asyncio.Event()
        loop = asyncio.get_running_loop()
        startup_worker = Worker("preemptd-nvml-start")
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
                self._disable(
                    sink, f"NVML (driver {startup.driver_version}) sees no GPU on this host", NO_DEVICE
                )
                return
            for ident, code in startup.broken:
                # Not polled: without a handle there is nothing to ask. It stays a fault until the agent
                # restarts (a GPU that fell off the bus needs a reset or a reboot anyway).
                self._broken[ident.uuid] = (ident, code)
                log.error("nvml_gpu_unusable", gpu=ident.uuid, index=ident.index, error=error_text(code))
                self._findings.unusable(ident, code)
            for ident, handle in startup.gpus:
                self._gpus[ident.uuid] = Gpu(ident, handle, Worker(f"preemptd-nvml-gpu{ident.index}"))
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
                    on_state=lambda *state: deliver(loop, self._on_kmsg_state, *state),
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

    async def _startup(self, worker: Worker, sink: Sink) -> Startup | None:
        future = worker.submit(lambda watch: start(watch, self.config.library_path))
        try:
            return await self._watched(worker, future, self._startup_hung)
        except ImportError as exc:
            why, problem = f"the nvidia-ml-py package (module pynvml) is not installed: {exc}", None
        except OSError as exc:
            why = (
                f"cannot load the NVML library {self.config.library_path}: {exc}; "
                "check gpu.library_path or install the NVIDIA driver"
            )
            problem = NO_LIBRARY
        except Exception as exc:
            why, problem = _startup_failure(exc)
        finally:
            worker.close()
            self._system.pop("driver/hung", None)
        self._disable(sink, why, problem)
        return None

    def _disable(self, sink: Sink, why: str, problem: str | None = None) -> None:
        self._state, self._why = "disabled", why
        if problem is not None:
            found = self._diagnosis = diagnose(problem, self.config.library_path, os.environ)
            # A warning where a GPU was to be expected (a pod, the NVIDIA runtime's variables, a driver);
            # on a host without any, the monitor being off is how it should be.
            report = log.warning if found.expected else log.info
            report("nvml_unavailable", why=why, **found.to_json())
        sink.replace([])
        sink.disable(why)

    async def _watched(
        self, worker: Worker, future: asyncio.Future[T], on_hung: Callable[[str, float], None]
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
        self._system["driver/hung"] = self._findings.hung_obs("driver/hung", "the NVIDIA driver", call, None)
        self._publish()

    def _tick(self) -> float:
        return max(0.01, min(0.25, self.config.call_timeout_s / 4))

    async def _shutdown(
        self,
        startup_worker: Worker,
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
        worker = Worker("preemptd-nvml-stop")
        try:
            future = worker.submit(nvml_shutdown)
            await asyncio.wait({future}, timeout=0.5)
        finally:
            worker.close()

    # -- periodic checks -------------------------------------------------------------------------------

    async def _poll_round(self, sink: Sink) -> None:
        pending: dict[asyncio.Future[PollResult], Gpu] = {}
        for gpu in self._gpus.values():
            if gpu.inflight is not None and not gpu.inflight.done():
                continue  # still inside a hung call: its finding stays up, the other GPUs go on
            if gpu.inflight is not None:
                self._apply_poll(gpu, gpu.inflight)
            gpu.inflight = gpu.worker.submit(functools.partial(poll, handle=gpu.handle, skip=gpu.disabled()))
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
                    self._findings.hung(gpu, call)
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

    def _apply_poll(self, gpu: Gpu, future: asyncio.Future[PollResult]) -> None:
        gpu.inflight = None
        if future.cancelled():
            return
        error = future.exception()
        if error is not None:
            self._findings.poll_failed(gpu, error)
            return
        self._findings.poll_done(gpu, future.result())

    # -- events ----------------------------------------------------------------------------------------

    def _event_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        """The event thread: register every GPU, then wait for events in short slices until stopped."""
        try:
            watch_events(
                self._events_watch,
                [(g.ident.uuid, g.handle) for g in self._gpus.values()],
                self.config.event_wait_ms,
                self._stop,
                on_state=lambda *args: deliver(loop, self._on_events_state, *args),
                on_event=lambda *args: deliver(loop, self._on_event, *args),
            )
        finally:
            deliver(loop, self._events_done.set)

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
        self._findings.event(gpu, event_type, data)
        self._publish()

    def _on_kmsg_xid(self, found: KmsgXid) -> None:
        uuid = self._by_pci.get(found.pci)
        gpu = self._gpus.get(uuid) if uuid else None
        if gpu is None:
            log.warning("kmsg_xid_unknown_gpu", pci=found.pci, xid=found.xid, text=found.text)
            return
        self._findings.xid(gpu, found.xid, "kmsg", found.text)
        self._publish()

    def _on_kmsg_state(self, state: str, why: str | None, cause: str | None) -> None:
        self._kmsg_state.update(state=state, why=why, cause=cause)
        if not why or why == self._kmsg_warned:
            return
        # Once per reason (a restarted monitor meets the same one): Xid lines that only the kernel log
        # carries go unseen until it is fixed; NVML's own XID events still arrive.
        self._kmsg_warned = why
        log.warning(
            "kmsg_unavailable",
            state=state,
            why=why,
            cause=cause,
            effect="Xid lines from the kernel log are not seen; NVML's XID events still are",
        )

    def _check_event_thread(self) -> None:
        bound = self.config.event_wait_ms / 1000.0 + self.config.call_timeout_s
        watch = self._events_watch
        call = watch.call
        key = "events/hung"
        if call is not None and watch.stuck_for(time.monotonic()) > bound:
            if key not in self._system:
                log.error("nvml_call_hung", call=call, bound_s=bound)
            self._system[key] = self._findings.hung_obs(key, "the event set", call, None)
        else:
            self._system.pop(key, None)

    # -- publishing ------------------------------------------------------------------------------------

    def _publish(self) -> None:
        if self._sink is None:
            return
        observations = self._findings.active(self._system)
        if self._rounds < self.config.raise_after:
            # Warm-up after a (re)start: the agent may have restored our notices from its state file, and a
            # condition that still holds needs raise_after polls to be seen again. Clearing now would send
            # cleared + a new notice with a new id for one condition; so raise only, clear from then on.
            for obs in observations:
                self._sink.observe(obs)
            return
        self._sink.replace(observations)


def _startup_failure(exc: Exception) -> tuple[str, str]:
    """What an NVML error from start-up says, and which problem it is (agent/sources/nvml_cause.py); an
    error that is none of them is raised again (the source restarts with backoff)."""
    code = error_code(exc)
    if code == LIBRARY_NOT_FOUND:
        why = (
            f"NVML library {DEFAULT_LIBRARY} not found: no NVIDIA driver on this host "
            "(set gpu.library_path if it lives elsewhere, or gpu.enabled = false)"
        )
        return why, NO_LIBRARY
    if code == DRIVER_NOT_LOADED:
        return "the NVIDIA kernel driver is not loaded (nvmlInit: Driver Not Loaded)", NO_DRIVER
    if code == NO_PERMISSION:
        return "no permission to use NVML (nvmlInit: Insufficient Permissions)", DENIED
    if code is not None:
        raise RuntimeError(f"NVML start-up failed: {error_text(code)}") from exc
    raise exc
