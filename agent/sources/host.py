"""The host monitor (source ``host``): memory pressure, free space for the next checkpoint, and the state
directory's disk, read with psutil and raised as ``host_degraded`` notices with hysteresis.

The checkpoint check uses what clients report (``POST /v1/reports``: ``bytes`` and ``path``): a directory
whose free space is below the last checkpoint's size (times ``host.checkpoint_headroom``) is flagged before
the next flush fails. Every read of a file system runs on a daemon thread under a time bound, so a dead
network mount neither blocks the loop nor the agent's exit. The memory is read on the loop: /proc/meminfo is
the kernel's, answered from memory, and a thread's round trip for it cost more CPU than the read itself
(bench/RESULTS.md, "Idle cost").
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import structlog

from agent.config import HostConfig
from agent.core.notice import Kind, Observation
from agent.core.reports import Report
from agent.core.threads import drop, run_for, wait_or_drop
from agent.sources.base import Sink, Source
from agent.sources.gpu_health import Hysteresis

log = structlog.get_logger("preemptd.host")

T = TypeVar("T")

MAX_REPORTED_DIRS = 16


def _psutil() -> Any:
    import psutil

    return psutil


@dataclass(frozen=True)
class DiskReading:
    path: str  # the directory asked about
    measured: str  # the existing directory measured (the path itself or its nearest existing parent)
    total: int
    free: int


@dataclass(frozen=True)
class MemoryReading:
    total: int
    available: int

    @property
    def available_percent(self) -> float:
        return 100.0 * self.available / self.total if self.total else 100.0


def existing_ancestor(path: Path) -> Path:
    """``path`` or its nearest existing parent (a checkpoint directory may not exist yet)."""
    candidate = path
    while not candidate.exists() and candidate != candidate.parent:
        candidate = candidate.parent
    return candidate


def read_disk(path: Path) -> DiskReading:
    measured = existing_ancestor(path)
    usage = _psutil().disk_usage(str(measured))
    return DiskReading(path=str(path), measured=str(measured), total=int(usage.total), free=int(usage.free))


def read_memory() -> MemoryReading:
    vm = _psutil().virtual_memory()
    return MemoryReading(total=int(vm.total), available=int(vm.available))


def memory_finding(reading: MemoryReading, config: HostConfig) -> Observation | None:
    if reading.available_percent >= config.memory_available_min_percent:
        return None
    return Observation(
        key="memory",
        kind=Kind.HOST_DEGRADED,
        reason=f"memory pressure: less than {config.memory_available_min_percent:g}% of memory available",
        detail={
            "available_bytes": reading.available,
            "total_bytes": reading.total,
            "available_percent": round(reading.available_percent, 2),
        },
    )


def state_dir_finding(reading: DiskReading, config: HostConfig) -> Observation | None:
    percent = 100.0 * reading.free / reading.total if reading.total else 100.0
    if reading.free >= config.state_dir_min_free_bytes and percent >= config.state_dir_min_free_percent:
        return None
    return Observation(
        key="disk/state",
        kind=Kind.HOST_DEGRADED,
        reason=f"the state directory's disk ({reading.measured}) is nearly full",
        detail={"path": reading.path, "free_bytes": reading.free, "total_bytes": reading.total},
    )


def checkpoint_finding(
    reading: DiskReading, last_bytes: int | None, config: HostConfig
) -> Observation | None:
    """A checkpoint directory whose free space cannot take another checkpoint of the last reported size."""
    if last_bytes is None:
        return None
    needed = int(last_bytes * config.checkpoint_headroom)
    if reading.free >= needed:
        return None
    return Observation(
        key=f"disk/{reading.path}",
        kind=Kind.HOST_DEGRADED,
        reason=f"checkpoint directory {reading.path}: not enough free space for the next checkpoint",
        detail={
            "path": reading.path,
            "measured": reading.measured,
            "free_bytes": reading.free,
            "needed_bytes": needed,
            "last_checkpoint_bytes": last_bytes,
        },
    )


class _Reader:
    """A daemon thread kept for one directory's reads (the state directory, each checkpoint directory),
    started at its first call: a new thread for each read of each check cost more CPU than the reads
    themselves (bench/RESULTS.md, "Idle cost"). Calls run one at a time, so one that hangs (a dead mount)
    holds this reader alone; unlike the default executor's, a stuck thread never delays exit."""

    def __init__(self) -> None:
        self._calls: queue.SimpleQueue[tuple[Any, ...] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def call(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._calls.put((loop, future, fn, args))
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name="preemptd-host-read", daemon=True)
            self._thread.start()
        return future

    def _serve(self) -> None:
        while (call := self._calls.get()) is not None:
            loop, future, fn, args = call
            run_for(loop, future, fn, *args)

    def close(self) -> None:
        """The thread ends once its current call is done (a hung one: when it returns)."""
        self._calls.put(None)


class HostSource(Source):
    name = "host"

    def __init__(self, config: HostConfig, state_dir: Path) -> None:
        self.config = config
        self.state_dir = state_dir
        self._hyst = Hysteresis(config.raise_after, config.clear_after)
        self._last_bytes: int | None = None
        # Checkpoint locations from client reports: directory -> size of the last checkpoint written there.
        self._reported: dict[str, int] = {}
        self._wake = asyncio.Event()
        self._readings: dict[str, Any] = {}
        self._stuck: set[str] = set()
        self._hung: dict[str, asyncio.Future[Any]] = {}  # what -> its read still running past the bound
        self._readers: dict[str, _Reader] = {}  # what -> the thread that reads it
        self._rounds = 0

    def on_report(self, report: Report) -> None:
        if report.kind != "checkpoint" or report.bytes is None or report.phase == "failed":
            return
        self._last_bytes = report.bytes
        if report.path:
            location = Path(report.path)
            if location.is_absolute():
                directory = self._configured_dir_for(location) or str(location.parent)
                self._reported.pop(directory, None)
                self._reported[directory] = report.bytes
                while len(self._reported) > MAX_REPORTED_DIRS:
                    del self._reported[next(iter(self._reported))]
        self._wake.set()  # check at once: the next flush of that size may not fit

    def _configured_dir_for(self, location: Path) -> str | None:
        for directory in self.config.checkpoint_dirs:
            if location == directory or directory in location.parents:
                return str(directory)
        return None

    def status(self) -> Mapping[str, Any]:
        return {
            "checks": self._rounds,
            "last_checkpoint_bytes": self._last_bytes,
            "checkpoint_dirs": [str(d) for d in self._checkpoint_dirs()],
            "readings": dict(self._readings),
            "not_responding": sorted(self._stuck),
        }

    def _checkpoint_dirs(self) -> list[str]:
        dirs = [str(d) for d in self.config.checkpoint_dirs]
        dirs.extend(d for d in self._reported if d not in dirs)
        return dirs

    async def run(self, sink: Sink) -> None:
        self._rounds = 0
        try:
            while True:
                self._wake.clear()
                await self._check(sink)
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), self.config.poll_interval_s)
        finally:
            for future in self._hung.values():
                drop(future)
            self._hung.clear()
            for reader in self._readers.values():
                reader.close()
            self._readers.clear()

    async def _bounded(self, what: str, fn: Callable[..., T], *args: Any) -> T | None:
        """Run a psutil read off the loop; None (and ``what`` marked as not responding) past the bound."""
        # A read still hung from an earlier check is waited for again, not started once more: a dead mount
        # holds one thread, not one per check.
        hung: asyncio.Future[T] | None = self._hung.pop(what, None)
        if hung is None and what not in self._readers:
            self._readers[what] = _Reader()
        future = hung or self._readers[what].call(fn, *args)
        if not await wait_or_drop(future, self.config.call_timeout_s):
            self._hung[what] = future
            if what not in self._stuck:
                log.warning("host_read_hung", what=what, bound_s=self.config.call_timeout_s)
            self._stuck.add(what)
            return None
        self._stuck.discard(what)
        return future.result()

    async def _check(self, sink: Sink) -> None:
        errors: list[str] = []
        try:
            memory = read_memory()
        except OSError as exc:  # /proc not mounted (a container without it)
            errors.append(f"memory: {exc}")
        else:
            self._readings["memory"] = {"available_percent": round(memory.available_percent, 2)}
            self._apply("memory", memory_finding(memory, self.config))
        try:
            state = await self._bounded("state_dir", read_disk, self.state_dir)
        except OSError as exc:
            errors.append(f"state directory {self.state_dir}: {exc}")
        else:
            if state is not None:
                self._readings["state_dir"] = {"path": state.measured, "free_bytes": state.free}
                self._apply("disk/state", state_dir_finding(state, self.config))
        directories = self._checkpoint_dirs()
        for what in [w for w in self._hung if w not in {"state_dir", *directories}]:
            drop(self._hung.pop(what))  # a reported directory no longer watched
            self._stuck.discard(what)
        for what in [w for w in self._readers if w not in {"state_dir", *directories}]:
            self._readers.pop(what).close()
        for directory in directories:
            key = f"disk/{directory}"
            try:
                disk = await self._bounded(directory, read_disk, Path(directory))
            except OSError as exc:
                errors.append(f"checkpoint directory {directory}: {exc}")
                continue
            if disk is None:
                self._hyst.bad(self._not_responding(directory), urgent=True)
                continue
            self._readings[key] = {"measured": disk.measured, "free_bytes": disk.free}
            last = self._reported.get(directory, self._last_bytes)
            self._apply(key, checkpoint_finding(disk, last, self.config))
        self._rounds += 1
        if self._rounds < self.config.raise_after:
            # Warm-up: keep notices the agent restored from its state until a condition has had
            # raise_after readings to be seen again (see NvmlSource._publish).
            for obs in self._hyst.active().values():
                sink.observe(obs)
        else:
            sink.replace(self._hyst.active().values())
        if errors:
            sink.error(errors[0], errors=errors)
        else:
            sink.ok(**self._readings)

    def _apply(self, key: str, finding: Observation | None) -> None:
        if finding is None:
            self._hyst.good(key)
        else:
            self._hyst.bad(finding)

    def _not_responding(self, directory: str) -> Observation:
        return Observation(
            key=f"disk/{directory}",
            kind=Kind.HOST_DEGRADED,
            reason=f"checkpoint directory {directory}: the file system is not responding",
            detail={"path": directory, "bound_s": self.config.call_timeout_s},
        )
