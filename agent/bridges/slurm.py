"""The Slurm bridge (``[actions.slurm]``): on a notice it drains this host's Slurm node, and once the training
processes on the host have flushed (the ``ready`` event) or the deadline minus a margin comes, requeues the
node's requeueable jobs and optionally signals their steps; when the notice clears it resumes the node, but
only a drain that is still the agent's own. docs/slurm.md has the timeline and the configuration.

Slurm is reached through its own tools (:mod:`agent.bridges.slurm_commands`); every call is an owned task, so
a slow or missing controller never delays an event on its way to clients. A step that fails (the controller
dead or hung) is tried again with a growing pause until the notice's deadline, and the requeue of a job that
has stopped and the resume of the node until ``persist_s`` beyond it; each try reads the node or job first, so
a change that timed out here but reached the controller is never made twice.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Annotated, Any, Literal, TypeVar

import structlog
from msgspec import Meta

from agent.actions.common import Recent, applies
from agent.bridges.common import drain_reason, register_metrics
from agent.bridges.slurm_commands import (
    ACTIVE_JOB_STATES,
    SlurmCommands,
    SlurmError,
    SlurmJob,
    host_names,
    parse_signal,
    requeue_verdict,
)
from agent.config import NoticeKindName, SeverityName, register_table
from agent.core.notice import Event, EventType, Notice, format_time, utcnow
from agent.core.ports import Host
from agent.core.tasks import TaskSet, wait_for_any

log = structlog.get_logger("preemptd.slurm")

T = TypeVar("T")

# A pause between two tries: short enough to act soon after the controller is back, never so short that a
# failing controller is asked in a busy loop.
Pause = Annotated[float, Meta(ge=0.1, le=3600, description="seconds from 0.1 to 3600")]
# How long to go on beyond the deadline: up to a week.
Span = Annotated[float, Meta(ge=0, le=7 * 86400, description="seconds from 0 to 604800")]


@dataclass(frozen=True)
class SlurmConfig:
    """``[actions.slurm]``."""

    enabled: bool = False
    # The node's name in Slurm; empty: the node whose NodeHostname or NodeAddr is this host's.
    node: str = ""
    kinds: tuple[NoticeKindName, ...] = ("termination",)
    min_severity: SeverityName = "info"
    # Off: a drill's requeue stops and restarts real jobs and cannot be undone by clearing the drill.
    drills: bool = False
    requeue: bool = True
    # A signal for the jobs' steps (``"USR1"``, ``"SIGTERM"``, a number); empty: none.
    signal: str = ""
    # When to send it: at the notice (programs without the client get the whole window) or with the requeue.
    signal_at: Literal["notice", "ready"] = "notice"
    # Act this many seconds before the deadline at the latest, even if the host is not ready yet.
    margin_s: Span = 30.0
    # After ready, how long a running job may take to exit on its own (75) before it is requeued running.
    stop_wait_s: Span = 15.0
    resume: bool = True
    bin_dir: str = ""
    slurm_conf: str = ""
    # One call: its timeout and how often it is repeated at once (reads only; a change is made once per try).
    timeout_s: Pause = 10.0
    retries: Annotated[int, Meta(ge=0, le=10, description="a whole number from 0 to 10")] = 2
    # A failing step is tried again after retry_first_s, doubling up to retry_max_s, until the deadline.
    retry_first_s: Pause = 1.0
    retry_max_s: Pause = 30.0
    # How long beyond the deadline (or the clear) the requeue of a stopped job and the resume go on.
    persist_s: Span = 3600.0
    history_size: Annotated[int, Meta(ge=1, le=10_000, description="a whole number from 1 to 10000")] = 50


register_table("actions.slurm", SlurmConfig)


@dataclass
class _Work:
    """What the bridge did and is doing for one notice."""

    notice: Notice
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    clear: asyncio.Event = field(default_factory=asyncio.Event)  # the notice cleared: pauses end early
    # Set once the drain step is over (done, left alone or given up): the resume waits for it.
    drain_settled: asyncio.Event = field(default_factory=asyncio.Event)
    cleared_at: datetime | None = None
    phase: str = "starting"
    node: str | None = None
    owned_reason: str | None = None
    drain: str = "pending"
    acted_on: str | None = None
    acted_at: datetime | None = None
    jobs: dict[int, dict[str, Any]] = field(default_factory=dict)
    found: dict[int, SlurmJob] = field(default_factory=dict)
    # What is being tried again, by step ("drain", "requeue 12"): attempts, last error, next try.
    pending: dict[str, dict[str, Any]] = field(default_factory=dict)
    # Changes sent that may have reached the controller: a later try that finds them done says so.
    tried: set[str] = field(default_factory=set)
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
            "pending": [self.pending[k] for k in sorted(self.pending)],
        }

    @property
    def cleared(self) -> bool:
        return self.clear.is_set()

    def set_phase(self, phase: str) -> None:
        """Move on, unless the notice cleared: then the clear's phases are what status shows."""
        if not self.cleared:
            self.phase = phase


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
                work.cleared_at = self._clock()
                work.clear.set()
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
        try:
            await self._act(work)
        finally:
            work.drain_settled.set()  # whatever happened, a clear must not wait for the drain step forever

    async def _act(self, work: _Work) -> None:
        notice = work.notice
        before_deadline = self._limit(work)
        # Finding the node is the drain's first part: its failures count as the drain's.
        node = await self._persist(work, "drain", "-", self._resolve, before_deadline)
        if node is None:
            work.set_phase("cleared before acting" if work.cleared else "failed")
            work.drain = "failed: node unknown"
            return
        work.node = node
        work.set_phase("draining")
        if await self._persist(work, "drain", node, lambda: self._drain(work, node), before_deadline) is None:
            work.drain = "not drained: cleared before the drain" if work.cleared else "failed"
        work.drain_settled.set()
        # A job that stopped after its flush while the controller could not be asked is the notice's job too.
        since = notice.detected_at.timestamp()
        listed = await self._persist(
            work,
            "list_jobs",
            node,
            lambda: self.commands.jobs_on(node, since),
            self._limit(work, beyond=True),
        )
        jobs = listed or []
        for job in jobs:
            work.jobs[job.job_id] = job.to_json()
            work.found[job.job_id] = job
        if self.signal and self.config.signal_at == "notice":
            await self._signal_all(work, jobs)
        work.set_phase("waiting")
        reason = await self._wait(work)
        if reason == "cleared":
            work.set_phase("cleared before acting")
            return
        work.acted_on, work.acted_at = reason, self._clock()
        work.set_phase("acting")
        log.info("slurm_acting", notice_id=notice.id, node=node, on=reason, jobs=sorted(work.jobs))
        if self.signal and self.config.signal_at == "ready":
            await self._signal_all(work, jobs)
        if self.config.requeue and work.jobs:
            await self._requeue_all(work)
        work.set_phase("done")
        await self._follow(work)

    async def _drain(self, work: _Work, node: str) -> str:
        """One try: read the node, then drain it unless it is drained already (by the agent or someone)."""
        reason = drain_reason(work.notice)
        async with self._lock:
            current = await self.commands.node(node)
            owner = self._owner_of(current.reason)
            if current.drained and current.reason == reason:
                # Our drain from an earlier try that timed out here, or from before a restart of the agent.
                found = "drained" if "drain" in work.tried else "drained by the agent (found after a restart)"
                work.owned_reason, work.drain = reason, found
            elif current.drained and owner is not None:
                work.drain = f"already drained by the agent for notice {owner.notice.id}"
            elif current.drained:
                work.drain = (
                    f"left alone: already drained by {current.reason_set_by or 'someone'}: {current.reason}"
                )
                self._outcome(work, "drain", node, "skipped", detail=work.drain)
            else:
                work.tried.add("drain")
                await self.commands.drain(node, reason)
                self._outcome(work, "drain", node, "ok")
                work.owned_reason, work.drain = reason, "drained"
        return work.drain

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
                try:
                    await self.commands.signal(job.job_id, self.signal)
                except SlurmError as exc:
                    self._outcome(work, "signal", str(job.job_id), "failed", exc)
                    self._degrade(str(exc))
                    work.jobs[job.job_id]["signal"] = "failed"
                    continue
                self._outcome(work, "signal", str(job.job_id), "ok")
                self._recovered()
                work.jobs[job.job_id]["signal"] = self.signal

    async def _requeue_all(self, work: _Work) -> None:
        """Give the jobs ``stop_wait_s`` (never past deadline - margin) to exit on their own, then requeue
        each one that should run again, each until it lands or its time is up."""
        ids = set(work.jobs)
        end = self._clock() + timedelta(seconds=self.config.stop_wait_s)
        if work.notice.deadline is not None:
            end = min(end, work.notice.deadline - timedelta(seconds=self.config.margin_s))
        # A job that stops itself after its flush (exit 75 through `preemptd exec`) is requeued from its
        # finished state; only one still running at the latest moment is stopped by the requeue. A failed
        # read here only shortens the wait: each requeue reads its job again.
        while self._clock() < end and not work.cleared:
            try:
                jobs = await self.commands.jobs(ids)
            except SlurmError:
                jobs = list(work.found.values())
            if not any(self._awaited(work, job) for job in jobs):
                break
            await wait_for_any(work.clear, timeout=min(1.0, max(0.0, (end - self._clock()).total_seconds())))
        await asyncio.gather(*(self._requeue_job(work, job_id) for job_id in sorted(ids)))

    def _awaited(self, work: _Work, job: SlurmJob) -> bool:
        """Whether the requeue step waits for ``job`` to stop on its own: one of the notice's jobs, running,
        requeueable and not requeued since."""
        found = work.found.get(job.job_id)
        return found is not None and job.active and job.requeue and job.restarts <= found.restarts

    async def _requeue_job(self, work: _Work, job_id: int) -> None:
        entry = work.jobs[job_id]
        entry["outcome"] = "requeue pending"  # the notice's `pending` says how often it was tried, and why
        # A clear does not end the tries: a job that has stopped comes back only through this requeue.
        done = await self._persist(
            work,
            "requeue",
            str(job_id),
            lambda: self._requeue_once(work, job_id),
            self._limit(work, beyond=True),
            until_cleared=False,
        )
        if done is None:
            entry["outcome"] = "requeue failed"

    async def _requeue_once(self, work: _Work, job_id: int) -> str:
        """One try: read the job, then requeue it unless it needs none or has been requeued already."""
        entry = work.jobs[job_id]
        key = f"requeue {job_id}"
        async with self._lock:
            found = await self.commands.jobs([job_id])
            if not found:
                entry["outcome"] = "gone: the controller no longer knows the job"
                return "gone"
            job = found[0]
            entry.update(job.to_json())
            verdict = requeue_verdict(job, work.found[job_id].restarts, key in work.tried)
            if verdict is None:
                work.tried.add(key)
                await self.commands.requeue(job_id)
                verdict = ("ok", "requeued")
            result, outcome = verdict
            entry["outcome"] = outcome
            self._outcome(work, "requeue", str(job_id), result, detail=outcome)
            return outcome

    async def _follow(self, work: _Work) -> None:
        """Keep the entries of jobs still running after the requeue step (one left alone, one not requeued)
        current until they end, the notice clears or the deadline passes: the status shows how they ended."""
        delay = self.config.retry_first_s
        while not work.cleared:
            running = {k for k, v in work.jobs.items() if v.get("state") in ACTIVE_JOB_STATES}
            deadline = work.notice.deadline
            if not running or (deadline is not None and self._clock() >= deadline):
                return
            await wait_for_any(work.clear, timeout=delay)
            delay = min(self.config.retry_max_s, delay * 2)
            try:
                jobs = await self.commands.jobs(running)
            except SlurmError:
                continue
            for job in jobs:
                work.jobs[job.job_id].update(job.to_json())

    async def _cleared(self, work: _Work) -> None:
        work.phase = "clearing"
        try:
            await self._on_cleared(work)
        finally:
            work.phase = "cleared"

    async def _on_cleared(self, work: _Work) -> None:
        # Let the drain step finish (it sees `cleared` and stops trying); requeues may go on meanwhile.
        await work.drain_settled.wait()
        if work.owned_reason is None or work.node is None:
            return
        node = work.node
        await self._persist(
            work,
            "resume",
            node,
            lambda: self._resume_once(work, node),
            lambda: (work.cleared_at or self._clock()) + timedelta(seconds=self.config.persist_s),
            until_cleared=False,
        )

    async def _resume_once(self, work: _Work, node: str) -> str:
        """One try: read the node, then resume it, hand the drain to another notice, or leave it."""
        async with self._lock:
            current = await self.commands.node(node)
            heir = next((w for w in self._work.values() if not w.cleared and w.node == node), None)
            if not current.drained or current.reason != work.owned_reason:
                # An earlier try that timed out here may have landed: the resume, or the hand-over.
                if not current.drained and "resume" in work.tried:
                    work.owned_reason, work.drain = None, "resumed"
                    self._outcome(work, "resume", node, "ok")
                    return work.drain
                if heir is not None and current.drained and current.reason == drain_reason(heir.notice):
                    heir.owned_reason, heir.drain = (
                        current.reason,
                        f"drained (taken over from {work.notice.id})",
                    )
                    work.owned_reason, work.drain = None, f"drain handed to notice {heir.notice.id}"
                    return work.drain
                what = f"{current.reason!r}" if current.drained else "not drained"
                work.drain = f"not resumed: the node is now {what}"
                self._outcome(work, "resume", node, "skipped", detail=work.drain)
                work.owned_reason = None
                return work.drain
            if heir is not None:
                # Another notice still wants the node drained: hand the drain over rather than resume.
                reason = drain_reason(heir.notice)
                await self.commands.drain(node, reason)
                self._outcome(heir, "drain", node, "ok")
                heir.owned_reason, heir.drain = reason, f"drained (taken over from notice {work.notice.id})"
                work.owned_reason, work.drain = None, f"drain handed to notice {heir.notice.id}"
                return work.drain
            if not self.config.resume:
                work.drain = "left drained (actions.slurm.resume = false)"
                return work.drain
            work.tried.add("resume")
            await self.commands.resume(node)
            self._outcome(work, "resume", node, "ok")
            work.owned_reason, work.drain = None, "resumed"
            return work.drain

    # --- trying again ---------------------------------------------------------------------------------

    def _limit(self, work: _Work, *, beyond: bool = False) -> Callable[[], datetime | None]:
        """Until when a failing step is tried again: the notice's deadline (read at each failure: it may
        move), or with ``beyond`` ``persist_s`` after it (after acting, without a deadline)."""

        def limit() -> datetime | None:
            deadline = work.notice.deadline
            if not beyond:
                return deadline
            base = deadline or work.acted_at
            return None if base is None else base + timedelta(seconds=self.config.persist_s)

        return limit

    async def _persist(
        self,
        work: _Work,
        action: str,
        target: str,
        step: Callable[[], Awaitable[T]],
        limit: Callable[[], datetime | None],
        *,
        until_cleared: bool = True,
    ) -> T | None:
        """Run ``step`` until it succeeds; after each SlurmError wait ``retry_first_s``, doubling up to
        ``retry_max_s``, and try again, while status shows what is pending. None once the next try would
        come after ``limit()``, when a tool is missing, or (``until_cleared``) once the notice has cleared."""

        def stopped() -> bool:
            return until_cleared and work.cleared

        key = action if target in ("-", work.node) else f"{action} {target}"
        delay = self.config.retry_first_s
        attempts = 0
        try:
            while True:
                attempts += 1
                try:
                    result = await step()
                except SlurmError as exc:
                    error = exc
                else:
                    self._recovered()
                    return result
                self._degrade(str(error))
                next_try = self._clock() + timedelta(seconds=delay)
                end = limit()
                if error.missing or stopped() or (end is not None and next_try > end):
                    self._outcome(work, action, target, "failed", error, attempts=str(attempts))
                    return None
                work.pending[key] = {
                    "action": action,
                    "target": target,
                    "attempts": attempts,
                    "error": str(error),
                    "next_try": format_time(next_try),
                    "gives_up_at": format_time(end) if end is not None else None,
                }
                self._outcome(work, action, target, "retrying", error, attempts=str(attempts))
                if until_cleared:
                    await wait_for_any(work.clear, timeout=delay)  # a clear ends the pause early
                    if stopped():
                        return None
                else:
                    await asyncio.sleep(delay)
                delay = min(self.config.retry_max_s, delay * 2)
        finally:
            work.pending.pop(key, None)

    # --- bookkeeping ----------------------------------------------------------------------------------

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

    def _recovered(self) -> None:
        if self.degraded and self.node is not None:
            log.info("slurm_recovered", was=self.degraded)
            self.degraded = None  # the controller answers again

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
