"""The Slurm bridge (``[actions.slurm]``): on a notice it drains this host's Slurm node, and once the training
processes on the host have flushed (the ``ready`` event) or the deadline minus a margin comes, requeues the
node's requeueable jobs and optionally signals their steps; when the notice clears it resumes the node, but
only a drain that is still the agent's own. docs/slurm.md has the timeline and the configuration.

Slurm is reached through its own tools (:mod:`agent.bridges.slurm_commands`); every call is an owned task, so
a slow or missing controller never delays an event on its way to clients.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

import structlog

from agent.actions.common import Recent, applies
from agent.bridges.common import drain_reason, register_metrics
from agent.bridges.slurm_commands import SlurmCommands, SlurmError, SlurmJob, host_names, parse_signal
from agent.config import NoticeKindName, SeverityName
from agent.notice import Event, EventType, Notice, format_time, utcnow
from agent.ports import Host
from agent.tasks import TaskSet, wait_for_any

log = structlog.get_logger("preemptd.slurm")


@dataclass(frozen=True)
class SlurmConfig:
    """``[actions.slurm]``."""

    enabled: bool = False
    # The node's name in Slurm; empty: the node whose NodeHostname or NodeAddr is this host's.
    node: str = ""
    kinds: tuple[NoticeKindName, ...] = ("termination",)
    min_severity: SeverityName = "info"
    drills: bool = True
    requeue: bool = True
    # A signal for the jobs' steps (``"USR1"``, ``"SIGTERM"``, a number); empty: none.
    signal: str = ""
    # When to send it: at the notice (programs without the client get the whole window) or with the requeue.
    signal_at: Literal["notice", "ready"] = "notice"
    # Act this many seconds before the deadline at the latest, even if the host is not ready yet.
    margin_s: float = 30.0
    # After ready, how long a running job may take to exit on its own (75) before it is requeued running.
    stop_wait_s: float = 15.0
    resume: bool = True
    bin_dir: str = ""
    slurm_conf: str = ""
    timeout_s: float = 10.0
    retries: int = 2
    history_size: int = 50


@dataclass
class _Work:
    """What the bridge did and is doing for one notice."""

    notice: Notice
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    cleared: bool = False
    phase: str = "starting"
    node: str | None = None
    owned_reason: str | None = None
    drain: str = "pending"
    acted_on: str | None = None
    jobs: dict[int, dict[str, Any]] = field(default_factory=dict)
    found: dict[int, SlurmJob] = field(default_factory=dict)
    run: asyncio.Task[Any] | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.notice.kind.value,
            "phase": self.phase,
            "node": self.node,
            "drain": self.drain,
            "drained_by_agent": self.owned_reason is not None,
            "jobs": [self.jobs[k] for k in sorted(self.jobs)],
            "acted_on": self.acted_on,
        }


class SlurmBridge:
    """A reactor: ``handle(event)`` never blocks; the work runs in tasks the bridge owns."""

    name = "slurm"

    def __init__(
        self,
        config: SlurmConfig,
        *,
        commands: SlurmCommands | None = None,
        names: Callable[[], list[str]] = host_names,
        clock: Callable[[], datetime] = utcnow,
    ) -> None:
        self.config = config
        self.signal = parse_signal(config.signal)
        self.commands = commands or SlurmCommands(
            bin_dir=config.bin_dir,
            slurm_conf=config.slurm_conf,
            timeout_s=config.timeout_s,
            retries=config.retries,
        )
        self._names = names
        self._clock = clock
        self.tasks = TaskSet("slurm")
        self.recent = Recent(config.history_size)
        self.counts: Counter[tuple[str, str]] = Counter()
        self.node: str | None = config.node or None
        self.degraded: str | None = None
        self._work: dict[str, _Work] = {}
        self._lock = asyncio.Lock()

    # --- reactor --------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Check the tools and find the node in the background: start never waits on the controller."""
        self.tasks.spawn(self._probe(), "probe")

    async def stop(self, timeout: float) -> None:
        await self.tasks.close(timeout)

    def handle(self, event: Event) -> None:
        if event.type is EventType.READY:
            notice_id = str(event.data.get("notice_id") or (event.notice.id if event.notice else ""))
            work = self._work.get(notice_id)
            if work is not None:
                work.ready.set()
            return
        notice = event.notice
        if notice is None:
            return
        work = self._work.get(notice.id)
        if event.type is EventType.CLEARED:
            if work is not None and not work.cleared:
                work.cleared = True
                work.changed.set()
                self.tasks.spawn(self._cleared(work), f"clear:{notice.id}")
            return
        if event.type not in (EventType.NOTICE, EventType.UPDATE):
            return
        if work is not None:
            work.notice = notice  # a moved deadline moves the latest moment to act
            work.changed.set()
            return
        cfg = self.config
        if not applies(notice, cfg.kinds, cfg.min_severity, cfg.drills):
            return
        work = _Work(notice)
        self._work[notice.id] = work
        self._trim()
        work.run = self.tasks.spawn(self._on_notice(work), f"notice:{notice.id}")

    def status(self) -> dict[str, Any]:
        return {
            "state": "degraded" if self.degraded else "ok",
            "degraded_reason": self.degraded,
            "node": self.node,
            "requeue": self.config.requeue,
            "signal": self.signal or None,
            "notices": {notice_id: work.to_json() for notice_id, work in self._work.items()},
            "actions": self.recent.to_json(),
        }

    def carry_over(self, previous: object) -> None:
        """After a reload: keep what the previous instance drained and is waiting for (its tasks finish under
        the old settings, woken by the events this instance now receives), its counts and its node."""
        if not isinstance(previous, SlurmBridge):
            return
        self._work = previous._work
        self._lock = previous._lock
        self.counts = previous.counts
        self.recent = previous.recent
        if not self.config.node and previous.config.node == self.config.node:
            self.node = previous.node

    async def drain_tasks(self) -> None:
        """Wait until everything started so far has finished (tests)."""
        await self.tasks.drain()

    # --- the steps ------------------------------------------------------------------------------------

    async def _probe(self) -> None:
        try:
            for tool in ("sinfo", "squeue", "scontrol", "scancel"):
                self.commands.tool(tool)
            node = await self._resolve()
        except SlurmError as exc:
            self._degrade(str(exc))
            return
        log.info("slurm_ready", node=node)

    async def _resolve(self) -> str:
        """This host's node name: the configured one, else the node matched by NodeHostname/NodeAddr."""
        if self.node is not None:
            return self.node
        node = await self.commands.find_node(self._names())
        self.node = node.name
        return node.name

    async def _on_notice(self, work: _Work) -> None:
        notice = work.notice
        try:
            node = await self._resolve()
        except SlurmError as exc:
            self._degrade(str(exc))
            work.phase, work.drain = "failed", "failed: node unknown"
            self._outcome(work, "drain", "-", "failed", exc)
            return
        work.node = node
        async with self._lock:
            await self._drain(work, node)
            jobs = await self._call(work, "list_jobs", node, self.commands.jobs_on(node))
        for job in jobs or []:
            work.jobs[job.job_id] = job.to_json()
            work.found[job.job_id] = job
        if self.signal and self.config.signal_at == "notice":
            await self._signal_all(work, jobs or [])
        work.phase = "waiting"
        reason = await self._wait(work)
        if reason == "cleared":
            work.phase = "cleared before acting"
            return
        work.acted_on = reason
        work.phase = "acting"
        log.info("slurm_acting", notice_id=notice.id, node=node, on=reason, jobs=sorted(work.jobs))
        if self.signal and self.config.signal_at == "ready":
            await self._signal_all(work, jobs or [])
        if self.config.requeue and work.jobs:
            await self._requeue_all(work)
        work.phase = "done"

    async def _drain(self, work: _Work, node: str) -> None:
        reason = drain_reason(work.notice)
        current = await self._call(work, "read_node", node, self.commands.node(node))
        if current is None:
            work.drain = "failed: node state unknown"
            return
        owner = self._owner_of(current.reason)
        if current.drained and current.reason == reason:
            work.owned_reason, work.drain = reason, "drained by the agent (found after a restart)"
        elif current.drained and owner is not None:
            work.drain = f"already drained by the agent for notice {owner.notice.id}"
        elif current.drained:
            work.drain = (
                f"left alone: already drained by {current.reason_set_by or 'someone'}: {current.reason}"
            )
            self._outcome(work, "drain", node, "skipped", detail=work.drain)
        else:
            done = await self._call(work, "drain", node, self.commands.drain(node, reason), record=True)
            if done is not None:
                work.owned_reason, work.drain = reason, "drained"
            else:
                work.drain = "failed"

    def _owner_of(self, reason: str) -> _Work | None:
        for work in self._work.values():
            if work.owned_reason == reason and not work.cleared:
                return work
        return None

    async def _wait(self, work: _Work) -> str:
        """Wait for ``ready``, for the deadline minus the margin, or for the notice to clear."""
        while True:
            if work.cleared:
                return "cleared"
            if work.ready.is_set():
                return "ready"
            work.changed.clear()
            timeout: float | None = None
            if work.notice.deadline is not None:
                latest = (work.notice.deadline - self._clock()).total_seconds() - self.config.margin_s
                if latest <= 0:
                    return "deadline"
                timeout = latest
            await wait_for_any(work.ready, work.changed, timeout=timeout)

    async def _signal_all(self, work: _Work, jobs: list[SlurmJob]) -> None:
        async with self._lock:
            for job in jobs:
                done = await self._call(
                    work,
                    "signal",
                    str(job.job_id),
                    self.commands.signal(job.job_id, self.signal),
                    record=True,
                )
                work.jobs[job.job_id]["signal"] = self.signal if done else "failed"

    async def _requeue_all(self, work: _Work) -> None:
        ids = set(work.jobs)
        latest = time.monotonic() + self.config.stop_wait_s
        if work.notice.deadline is not None:
            left = (work.notice.deadline - self._clock()).total_seconds() - self.config.margin_s
            latest = min(latest, time.monotonic() + max(0.0, left))
        # A job that stops itself after its flush (exit 75 through `preemptd exec`) is requeued from its
        # finished state; only one still running at the latest moment is stopped by the requeue.
        jobs = dict(work.found)
        while True:
            found = await self._call(work, "read_jobs", "-", self.commands.jobs(ids))
            if found is not None:
                jobs = {job.job_id: job for job in found}
            if (
                not any(j.active and j.requeue for j in jobs.values())
                or time.monotonic() >= latest
                or work.cleared
            ):
                break
            await asyncio.sleep(min(1.0, max(0.0, latest - time.monotonic())))
        async with self._lock:
            for job_id in sorted(ids):
                entry = work.jobs[job_id]
                job = jobs.get(job_id)
                if job is None:
                    entry["outcome"] = "gone: the controller no longer knows the job"
                    continue
                entry["state"] = job.state
                if job.exit_code is not None:
                    entry["exit_code"] = job.exit_code
                if not job.requeue:
                    entry["outcome"] = "left alone: not requeueable (submitted with --no-requeue)"
                    self._outcome(work, "requeue", str(job_id), "not_requeueable", detail=entry["outcome"])
                elif job.state == "PENDING":
                    entry["outcome"] = "already pending"
                    self._outcome(work, "requeue", str(job_id), "skipped", detail="already pending")
                else:
                    done = await self._call(
                        work, "requeue", str(job_id), self.commands.requeue(job_id), record=True
                    )
                    entry["outcome"] = "requeued" if done else "requeue failed"

    async def _cleared(self, work: _Work) -> None:
        work.phase = "clearing"
        try:
            await self._on_cleared(work)
        finally:
            work.phase = "cleared"

    async def _on_cleared(self, work: _Work) -> None:
        if work.run is not None and not work.run.done():
            # Let the drain and any Slurm call in flight finish; the waiting step sees `cleared` and ends.
            await asyncio.wait({work.run})
        if work.owned_reason is None or work.node is None:
            return
        node = work.node
        async with self._lock:
            current = await self._call(work, "read_node", node, self.commands.node(node))
            if current is None:
                return
            if not current.drained or current.reason != work.owned_reason:
                what = f"{current.reason!r}" if current.drained else "not drained"
                work.drain = f"not resumed: the node is now {what}"
                self._outcome(work, "resume", node, "skipped", detail=work.drain)
                work.owned_reason = None
                return
            heir = next((w for w in self._work.values() if not w.cleared and w.node == node), None)
            if heir is not None:
                # Another notice still wants the node drained: hand the drain over rather than resume.
                reason = drain_reason(heir.notice)
                if await self._call(heir, "drain", node, self.commands.drain(node, reason), record=True):
                    heir.owned_reason, heir.drain = (
                        reason,
                        f"drained (taken over from notice {work.notice.id})",
                    )
                work.owned_reason, work.drain = None, f"drain handed to notice {heir.notice.id}"
                return
            if not self.config.resume:
                work.drain = "left drained (actions.slurm.resume = false)"
                return
            if await self._call(work, "resume", node, self.commands.resume(node), record=True) is not None:
                work.owned_reason, work.drain = None, "resumed"

    # --- bookkeeping ----------------------------------------------------------------------------------

    async def _call(self, work: _Work, action: str, target: str, call: Any, *, record: bool = False) -> Any:
        """Await one Slurm call; a failure is recorded (with stderr), degrades the bridge and returns None."""
        try:
            result = await call
        except SlurmError as exc:
            self._outcome(work, action, target, "failed", exc)
            self._degrade(str(exc))
            return None
        if record:
            self._outcome(work, action, target, "ok")
        if self.degraded and self.node is not None:
            log.info("slurm_recovered", was=self.degraded)
            self.degraded = None  # the controller answers again
        return result if result is not None else True

    def _outcome(
        self,
        work: _Work,
        action: str,
        target: str,
        outcome: str,
        error: SlurmError | None = None,
        **more: str,
    ) -> None:
        """Keep, count and log one call's outcome (with the command's stderr when it failed)."""
        record: dict[str, Any] = {"at": format_time(self._clock()), "notice_id": work.notice.id}
        record.update(action=action, target=target, outcome=outcome, **more)
        if error is not None:
            record.update(error=str(error), **({"stderr": error.stderr[-2000:]} if error.stderr else {}))
        self.recent.add(record)
        self.counts[(action, outcome)] += 1
        fields = {k: v for k, v in record.items() if k != "at"}
        if outcome in ("ok", "skipped", "not_requeueable"):
            log.info(f"slurm_{action}", **fields)
        else:
            log.warning(f"slurm_{action}_failed", **fields)

    def _degrade(self, why: str) -> None:
        if self.degraded != why:
            log.error("slurm_degraded", why=why, effect="notices still reach local clients")
        self.degraded = why

    def _trim(self) -> None:
        size = max(1, self.config.history_size)
        for notice_id in list(self._work):
            if len(self._work) <= size:
                break
            work = self._work[notice_id]
            if work.cleared and (work.run is None or work.run.done()):
                del self._work[notice_id]


def build_reactor(host: Host) -> SlurmBridge | None:
    """The bridge for ``[actions.slurm]``, or None when it is not enabled."""
    config = host.config.table("actions.slurm", SlurmConfig)
    if not config.enabled:
        return None
    bridge = SlurmBridge(config)
    register_metrics(host, "slurm", "Slurm", bridge)
    return bridge
