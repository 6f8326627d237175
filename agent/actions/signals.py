"""Signals to unmodified programs: on a matching notice, send a configured signal once to the processes of
the configured targets (GPU compute processes, a systemd unit or cgroup, a PID file, a command-line match),
optionally escalating to a second signal after a delay. Every delivery, failure and skip is logged and kept
for ``/v1/status``.

Target resolution reads /proc, /sys and may run ``systemctl``: it runs on a worker thread, never on the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from agent.actions.common import Outcomes, OwnedTasks, Recent, applies, log
from agent.config import SignalRuleConfig
from agent.config.validate import check_signal_rule, parse_signal
from agent.core.notice import Event, EventType, Notice, format_time, utcnow
from agent.core.tasks import TaskSet

# Where a cgroup path is looked up: the unified (v2) hierarchy, the hybrid layout's v2 mount, then the v1
# ``name=systemd`` hierarchy, whose tree mirrors the units.
CGROUP_ROOTS: tuple[Path, ...] = (
    Path("/sys/fs/cgroup"),
    Path("/sys/fs/cgroup/unified"),
    Path("/sys/fs/cgroup/systemd"),
)

GpuPids = Callable[[], Awaitable[Mapping[str, Iterable[int]]]]


class TargetError(Exception):
    """A target could not be resolved to processes (no such unit, unreadable PID file, no NVML)."""


@dataclass(frozen=True)
class SignalRule:
    """A validated ``[[actions.signals]]`` rule."""

    config: SignalRuleConfig
    send: signal.Signals
    escalate: signal.Signals
    patterns: tuple[re.Pattern[str], ...]

    @classmethod
    def from_config(cls, config: SignalRuleConfig, index: int) -> SignalRule:
        where = f"actions.signals[{index}] ({config.name})"
        check_signal_rule(config, where)
        patterns = [re.compile(text) for text in config.cmdline]
        return cls(
            config=config,
            send=parse_signal(config.signal, where + " signal"),
            escalate=parse_signal(config.escalate_signal, where + " escalate_signal"),
            patterns=tuple(patterns),
        )


# --- target resolution (blocking; called on a worker thread) -----------------------------------------


def cgroup_dir(path: str, roots: Iterable[Path] = CGROUP_ROOTS) -> Path:
    """The directory of cgroup ``path`` (``/system.slice/train.service`` or a path under a root)."""
    candidate = Path(path)
    for root in roots:
        inside = candidate.is_absolute() and candidate.is_relative_to(root)
        if inside and (candidate / "cgroup.procs").exists():
            return candidate
    relative = path.strip("/")
    for root in roots:
        where = root / relative
        if (where / "cgroup.procs").exists():
            return where
    raise TargetError(f"cgroup {path!r} not found under {', '.join(str(r) for r in roots)}")


def pids_in_cgroup(directory: Path) -> list[int]:
    """Every process in the cgroup and its descendants (a unit with ``Delegate=`` has sub-cgroups)."""
    pids: list[int] = []
    for current, _dirs, files in os.walk(directory):
        if "cgroup.procs" not in files:
            continue
        try:
            text = (Path(current) / "cgroup.procs").read_text()
        except OSError:
            continue  # the sub-cgroup went away while walking
        pids.extend(int(line) for line in text.split() if line.isdigit())
    return pids


def unit_cgroup(unit: str) -> str:
    """The control group of a systemd unit, asked from systemd; ``system.slice/<unit>`` if it cannot say."""
    name = unit if "." in unit else unit + ".service"
    try:
        done = subprocess.run(
            ["systemctl", "show", "--property=ControlGroup", "--value", "--", name],
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
        )
        group = done.stdout.strip()
        if done.returncode == 0 and group:
            return group
    except (OSError, subprocess.SubprocessError):
        pass
    return f"/system.slice/{name}"


def pid_from_file(path: Path) -> int:
    try:
        text = path.read_text().strip()
    except OSError as exc:
        raise TargetError(f"cannot read PID file {path}: {exc.strerror or exc}") from None
    first = text.split()[0] if text else ""
    if not first.isdigit():
        raise TargetError(f"PID file {path} does not hold a process id (found {text[:40]!r})")
    return int(first)


def pids_matching(pattern: re.Pattern[str], exclude: Iterable[int] = ()) -> list[int]:
    """Processes whose command line (arguments joined by spaces) matches ``pattern``."""
    skip = set(exclude) | {os.getpid()}
    found: list[int] = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmdline = proc.info.get("cmdline") or []
        if proc.info["pid"] in skip or not cmdline:
            continue
        if pattern.search(" ".join(cmdline)):
            found.append(proc.info["pid"])
    return found


def _process_identity(pid: int) -> tuple[str, float] | None:
    try:
        proc = psutil.Process(pid)
        return proc.name(), proc.create_time()
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return None
    except psutil.AccessDenied:
        return "?", 0.0


# --- the engine ----------------------------------------------------------------------------------------


class SignalEngine(OwnedTasks):
    """Applies the signal rules to events: once per (notice, rule), escalation cancelled when it clears.
    A :class:`agent.core.ports.Reactor` named ``signals``."""

    name = "signals"

    def __init__(
        self,
        rules: Iterable[SignalRule],
        *,
        dry_run: bool,
        tasks: TaskSet,
        recent: Recent,
        gpu_pids: GpuPids | None = None,
        cgroup_roots: Iterable[Path] = CGROUP_ROOTS,
        count: Callable[[str], None] = lambda outcome: None,
    ) -> None:
        self.rules = tuple(rules)
        self.dry_run = dry_run
        self._tasks = tasks
        self.recent = self._recent = recent
        self._gpu_pids = gpu_pids
        self._roots = tuple(cgroup_roots)
        self._count = self.outcomes = Outcomes(count)
        self._done: set[tuple[str, int]] = set()
        self._running: dict[str, set[asyncio.Task[Any]]] = {}

    def carry_over(self, previous: object) -> None:
        """Take over what ``previous`` already did (after a reload): notices it signalled are not signalled
        again, and its pending escalations are still cancelled when their notice clears."""
        if not isinstance(previous, SignalEngine):
            return
        self._done |= previous._done
        for notice_id, tasks in previous._running.items():
            self._running.setdefault(notice_id, set()).update(tasks)

    # --- reactor contract -----------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        return {
            "rules": len(self.rules),
            "dry_run": self.dry_run,
            "running": len(self._tasks),
            "outcomes": dict(self.outcomes.counts),
        }

    def handle(self, event: Event) -> None:
        notice = event.notice
        if notice is None:
            return
        if event.type is EventType.CLEARED:
            # A cleared notice (a drill that ended, a cancelled maintenance) must not escalate to SIGKILL.
            for task in self._running.pop(notice.id, set()):
                task.cancel("notice cleared")
            self._done = {done for done in self._done if done[0] != notice.id}
            return
        if event.type not in (EventType.NOTICE, EventType.UPDATE):
            return
        for index, rule in enumerate(self.rules):
            cfg = rule.config
            if (notice.id, index) in self._done:
                continue
            if not applies(notice, cfg.kinds, cfg.min_severity, cfg.drills):
                continue
            self._done.add((notice.id, index))
            spawned = self._tasks.spawn(self._fire(rule, notice), f"signal:{cfg.name}:{notice.id}")
            if spawned is not None:
                running = self._running.setdefault(notice.id, set())
                running.add(spawned)
                spawned.add_done_callback(running.discard)

    async def _fire(self, rule: SignalRule, notice: Notice) -> None:
        cfg = rule.config
        gpu: Mapping[str, Iterable[int]] = {}
        if cfg.gpu_processes:
            try:
                if self._gpu_pids is None:
                    raise TargetError("no NVML source is running, so GPU compute processes are unknown")
                gpu = await self._gpu_pids()
            except Exception as exc:
                self._record(notice, cfg.name, "gpu", None, rule.send, outcome="target_error", error=str(exc))
        targets = await asyncio.to_thread(self._resolve, rule, notice, gpu)
        sent: dict[int, tuple[str, float]] = {}
        for label, pids, error in targets:
            if error is not None:
                self._record(notice, cfg.name, label, None, rule.send, outcome="target_error", error=error)
                continue
            for pid in pids:
                if pid in sent:
                    continue
                identity = self._deliver(notice, cfg.name, label, pid, rule.send, escalation=False)
                if identity is not None:
                    sent[pid] = identity
        if not targets or not any(pids for _, pids, _ in targets):
            log.info("signal_no_targets", rule=cfg.name, notice_id=notice.id)
        if cfg.escalate_after_s <= 0 or not sent or self.dry_run:
            return
        await asyncio.sleep(cfg.escalate_after_s)
        for pid, (name, started) in sent.items():
            now = _process_identity(pid)
            if now is None or (now[1] != started and started != 0.0):
                continue  # it exited (or the pid now belongs to someone else): nothing to escalate
            self._deliver(notice, cfg.name, "escalation", pid, rule.escalate, escalation=True, name=name)

    def _resolve(
        self, rule: SignalRule, notice: Notice, gpu: Mapping[str, Iterable[int]]
    ) -> list[tuple[str, list[int], str | None]]:
        cfg = rule.config
        found: list[tuple[str, list[int], str | None]] = []
        if gpu:
            wanted = _notice_gpus(notice) if cfg.gpu_scope == "notice" else set()
            for uuid, pids in gpu.items():
                if wanted and uuid not in wanted:
                    continue
                found.append((f"gpu:{uuid}", sorted(set(pids)), None))
        roots = self._roots
        for unit in cfg.units:
            found.append(_guard(f"unit:{unit}", _unit_pids, unit, roots))
        for group in cfg.cgroups:
            found.append(_guard(f"cgroup:{group}", _cgroup_pids, group, roots))
        for path in cfg.pid_files:
            found.append(_guard(f"pidfile:{path}", _pidfile_pids, path))
        for pattern in rule.patterns:
            found.append(_guard(f"cmdline:{pattern.pattern}", pids_matching, pattern))
        return found

    def _deliver(
        self,
        notice: Notice,
        rule: str,
        target: str,
        pid: int,
        sig: signal.Signals,
        *,
        escalation: bool,
        name: str | None = None,
    ) -> tuple[str, float] | None:
        """Send one signal; the process's identity (name, start time) when it was sent, else None."""
        if pid <= 1 or pid == os.getpid():
            why = "refusing to signal init or the agent"
            self._record(notice, rule, target, pid, sig, outcome="skipped", error=why)
            return None
        identity = _process_identity(pid)
        if identity is None:
            self._record(notice, rule, target, pid, sig, outcome="gone", escalation=escalation, name=name)
            return None
        name = name or identity[0]
        if self.dry_run:
            self._record(notice, rule, target, pid, sig, outcome="dry_run", escalation=escalation, name=name)
            return identity
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            self._record(notice, rule, target, pid, sig, outcome="gone", escalation=escalation, name=name)
            return None
        except PermissionError:
            self._record(
                notice,
                rule,
                target,
                pid,
                sig,
                outcome="permission_denied",
                escalation=escalation,
                name=name,
                error="the agent may not signal this process (run it as root or as the process's user)",
            )
            return None
        self._record(notice, rule, target, pid, sig, outcome="sent", escalation=escalation, name=name)
        return identity

    def _record(
        self,
        notice: Notice,
        rule: str,
        target: str,
        pid: int | None,
        sig: signal.Signals,
        *,
        outcome: str,
        escalation: bool = False,
        name: str | None = None,
        error: str | None = None,
    ) -> None:
        record: dict[str, Any] = {
            "at": format_time(utcnow()),
            "notice_id": notice.id,
            "rule": rule,
            "target": target,
            "pid": pid,
            "process": name,
            "signal": sig.name,
            "escalation": escalation,
            "outcome": outcome,
        }
        if error:
            record["error"] = error
        self._recent.add(record)
        self._count(outcome)
        fields = {k: v for k, v in record.items() if k != "at" and v is not None}
        if outcome in ("sent", "dry_run", "gone"):
            log.info("signal_" + outcome, **fields)
        else:
            log.warning("signal_" + outcome, **fields)


def _guard(label: str, resolve: Callable[..., list[int]], *args: Any) -> tuple[str, list[int], str | None]:
    try:
        return label, resolve(*args), None
    except TargetError as exc:
        return label, [], str(exc)
    except OSError as exc:
        return label, [], f"{type(exc).__name__}: {exc}"


def _unit_pids(unit: str, roots: tuple[Path, ...]) -> list[int]:
    return pids_in_cgroup(cgroup_dir(unit_cgroup(unit), roots))


def _cgroup_pids(group: str, roots: tuple[Path, ...]) -> list[int]:
    return pids_in_cgroup(cgroup_dir(group, roots))


def _pidfile_pids(path: Path) -> list[int]:
    return [pid_from_file(path)]


def _notice_gpus(notice: Notice) -> set[str]:
    """GPU UUIDs a notice is about (``detail.uuid``, ``detail.gpu_uuid`` or ``detail.uuids``)."""
    detail = notice.detail
    found: set[str] = set()
    for key in ("uuid", "gpu_uuid"):
        value = detail.get(key)
        if isinstance(value, str):
            found.add(value)
    many = detail.get("uuids")
    if isinstance(many, (list, tuple)):
        found.update(str(v) for v in many)
    return found


async def call_gpu_pids(method: Callable[[], Any] | None) -> Mapping[str, Iterable[int]]:
    """Call the ``gpu_pids`` capability for ``uuid → pids``; it may be blocking or a coroutine."""
    if method is None:
        raise TargetError("no NVML source is running, so GPU compute processes are unknown")
    if asyncio.iscoroutinefunction(method):
        result = await method()
    else:
        result = await asyncio.to_thread(method)
        if asyncio.iscoroutine(result):
            result = await result
    with contextlib.suppress(AttributeError):
        return dict(result.items())
    raise TargetError(f"the NVML source returned {type(result).__name__}, expected a mapping of uuid to pids")
