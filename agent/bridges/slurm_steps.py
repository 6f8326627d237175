"""What the Slurm bridge does for one notice, step by step, and how it tries a failing step again.

On the notice: find the node, drain it (unless someone else did), list its jobs, signal their steps if asked,
wait for ``ready``, the deadline minus ``margin_s`` or the clear, then requeue the jobs that should run again
and follow those still running. On the clear: resume the node, or hand its drain to another notice that
still wants it. Each step that fails is tried again (:meth:`SlurmSteps.persist`) with a growing pause until
the notice's deadline, a requeue and the resume until ``persist_s`` beyond it; each try reads the node or
job first, so a change that timed out here but reached the controller is never made twice. The reactor that
starts these steps is :mod:`agent.bridges.slurm`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta
from typing import TypeVar

import structlog

from agent.bridges.common import drain_reason
from agent.bridges.slurm_commands import (
    ACTIVE_JOB_STATES,
    SlurmCommands,
    SlurmError,
    SlurmJob,
    requeue_verdict,
)
from agent.bridges.slurm_config import SlurmConfig
from agent.bridges.slurm_elastic import ElasticJobs
from agent.bridges.slurm_work import Outcomes, Work
from agent.core.notice import format_time
from agent.core.tasks import wait_for_any

log = structlog.get_logger("preemptd.slurm")

T = TypeVar("T")


class SlurmSteps:
    """The steps of every notice the bridge acts on, sharing one node, one lock (one change to Slurm at a
    time) and one record of outcomes."""

    def __init__(
        self,
        config: SlurmConfig,
        commands: SlurmCommands,
        signal: str,
        names: Callable[[], list[str]],
        clock: Callable[[], datetime],
    ) -> None:
        self.config = config
        self.commands = commands
        self.signal = signal
        self._names = names
        self._clock = clock
        self.node: str | None = config.node or None
        self.work: dict[str, Work] = {}
        self.lock = asyncio.Lock()
        self.outcomes = Outcomes(config.history_size, clock)
        self.elastic = ElasticJobs()  # what the ranks here said about their jobs (slurm_elastic.py)

    def carry_over(self, previous: SlurmSteps) -> None:
        """Take over what ``previous`` (the steps before a reload) drained and is waiting for, its lock, its
        counts and its node."""
        self.work = previous.work
        self.lock = previous.lock
        self.outcomes.counts = previous.outcomes.counts
        self.outcomes.recent = previous.outcomes.recent
        self.elastic.carry_over(previous.elastic)
        if not self.config.node and previous.config.node == self.config.node:
            self.node = previous.node

    async def resolve(self) -> str:
        """This host's node name: the configured one, else the node matched by NodeHostname/NodeAddr."""
        if self.node is not None:
            return self.node
        node = await self.commands.find_node(self._names())
        self.node = node.name
        return node.name

    async def on_notice(self, work: Work) -> None:
        try:
            await self._act(work)
        finally:
            work.drain_settled.set()  # whatever happened, a clear must not wait for the drain step forever

    async def _act(self, work: Work) -> None:
        notice = work.notice
        before_deadline = self.limit(work)
        # Finding the node is the drain's first part: its failures count as the drain's.
        node = await self.persist(work, "drain", "-", self.resolve, before_deadline)
        if node is None:
            work.set_phase("cleared before acting" if work.cleared else "failed")
            work.drain = "failed: node unknown"
            return
        work.node = node
        work.set_phase("draining")
        if await self.persist(work, "drain", node, lambda: self._drain(work, node), before_deadline) is None:
            work.drain = "not drained: cleared before the drain" if work.cleared else "failed"
        work.drain_settled.set()
        # A job that stopped after its flush while the controller could not be asked is the notice's job too.
        since = notice.detected_at.timestamp()
        listed = await self.persist(
            work,
            "list_jobs",
            node,
            lambda: self.commands.jobs_on(node, since),
            self.limit(work, beyond=True),
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

    async def _drain(self, work: Work, node: str) -> str:
        """One try: read the node, then drain it unless it is drained already (by the agent or someone)."""
        reason = drain_reason(work.notice)
        async with self.lock:
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
                self.outcomes.record(work, "drain", node, "skipped", detail=work.drain)
            else:
                work.tried.add("drain")
                await self.commands.drain(node, reason)
                self.outcomes.record(work, "drain", node, "ok")
                work.owned_reason, work.drain = reason, "drained"
        return work.drain

    def _owner_of(self, reason: str) -> Work | None:
        for work in self.work.values():
            if work.owned_reason == reason and not work.cleared:
                return work
        return None

    async def _wait(self, work: Work) -> str:
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

    async def _signal_all(self, work: Work, jobs: list[SlurmJob]) -> None:
        async with self.lock:
            for job in jobs:
                try:
                    await self.commands.signal(job.job_id, self.signal)
                except SlurmError as exc:
                    self.outcomes.record(work, "signal", str(job.job_id), "failed", exc)
                    self.outcomes.degrade(str(exc))
                    work.jobs[job.job_id]["signal"] = "failed"
                    continue
                self.outcomes.record(work, "signal", str(job.job_id), "ok")
                self._recovered()
                work.jobs[job.job_id]["signal"] = self.signal

    async def _requeue_all(self, work: Work) -> None:
        """Give the jobs ``stop_wait_s`` (never past deadline - margin) to exit on their own, and an elastic job
        until deadline - margin to say whether it shrank, then requeue each one that should run again, each
        until it lands or its time is up."""
        ids = set(work.jobs)
        since = work.notice.detected_at
        latest = None
        if work.notice.deadline is not None:
            latest = work.notice.deadline - timedelta(seconds=self.config.margin_s)
        end = self._clock() + timedelta(seconds=self.config.stop_wait_s)
        end = min(end, latest) if latest is not None else end
        # A job that stops itself after its flush (exit 75 through `preemptd exec`) is requeued from its
        # finished state; only one still running at the latest moment is stopped by the requeue. A failed
        # read here only shortens the wait: each requeue reads its job again.
        while not work.cleared:
            word = any(self.elastic.waiting(j, since) and not _runs_batch(work, j) for j in ids)
            limit = latest if word and latest is not None else end
            if self._clock() >= limit:
                break
            try:
                jobs = await self.commands.jobs(ids)
            except SlurmError:
                jobs = list(work.found.values())
            if not word and not any(self._awaited(work, job) for job in jobs):
                break
            await wait_for_any(
                work.clear, timeout=min(1.0, max(0.0, (limit - self._clock()).total_seconds()))
            )
        await asyncio.gather(*(self._requeue_job(work, job_id) for job_id in sorted(ids)))

    def _awaited(self, work: Work, job: SlurmJob) -> bool:
        """Whether the requeue step waits for ``job`` to stop on its own: one of the notice's jobs, running,
        requeueable, not requeued since, and not an elastic job that goes on without this node."""
        found = work.found.get(job.job_id)
        if found is None or not (job.active and job.requeue and job.batch and job.restarts <= found.restarts):
            return False
        return self._kept(work, job.job_id) is None

    def _kept(self, work: Work, job_id: int) -> str | None:
        """Why ``job_id`` is not requeued although this node goes: elastic, it goes on without it."""
        kept = self.elastic.kept(job_id, work.notice.detected_at)
        if kept is not None and _runs_batch(work, job_id):
            work.jobs[job_id]["elastic_note"] = (
                f"not kept: its batch script runs on {work.node}, and the job cannot outlive that node"
            )
            return None
        return kept

    async def _requeue_job(self, work: Work, job_id: int) -> None:
        entry = work.jobs[job_id]
        entry.update(self.elastic.describe(job_id, work.notice.detected_at))
        kept = self._kept(work, job_id)
        if kept is not None:  # its other nodes train on: a requeue would stop them
            entry["outcome"] = kept
            self.outcomes.record(work, "requeue", str(job_id), "skipped", detail=kept)
            return
        entry["outcome"] = "requeue pending"  # the notice's `pending` says how often it was tried, and why
        # A clear does not end the tries: a job that has stopped comes back only through this requeue.
        done = await self.persist(
            work,
            "requeue",
            str(job_id),
            lambda: self._requeue_once(work, job_id),
            self.limit(work, beyond=True),
            until_cleared=False,
        )
        if done is None:
            entry["outcome"] = "requeue failed"

    async def _requeue_once(self, work: Work, job_id: int) -> str:
        """One try: read the job, then requeue it unless it needs none or has been requeued already."""
        entry = work.jobs[job_id]
        key = f"requeue {job_id}"
        async with self.lock:
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
            self.outcomes.record(work, "requeue", str(job_id), result, detail=outcome)
            return outcome

    async def _follow(self, work: Work) -> None:
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

    async def on_cleared(self, work: Work) -> None:
        """After the notice cleared: resume the node if its drain is still the agent's own."""
        work.phase = "clearing"
        try:
            await self._resume(work)
        finally:
            work.phase = "cleared"

    async def _resume(self, work: Work) -> None:
        # Let the drain step finish (it sees `cleared` and stops trying); requeues may go on meanwhile.
        await work.drain_settled.wait()
        if work.owned_reason is None or work.node is None:
            return
        node = work.node
        await self.persist(
            work,
            "resume",
            node,
            lambda: self._resume_once(work, node),
            lambda: (work.cleared_at or self._clock()) + timedelta(seconds=self.config.persist_s),
            until_cleared=False,
        )

    async def _resume_once(self, work: Work, node: str) -> str:
        """One try: read the node, then resume it, hand the drain to another notice, or leave it."""
        async with self.lock:
            current = await self.commands.node(node)
            heir = next((w for w in self.work.values() if not w.cleared and w.node == node), None)
            if not current.drained or current.reason != work.owned_reason:
                # An earlier try that timed out here may have landed: the resume, or the hand-over.
                if not current.drained and "resume" in work.tried:
                    work.owned_reason, work.drain = None, "resumed"
                    self.outcomes.record(work, "resume", node, "ok")
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
                self.outcomes.record(work, "resume", node, "skipped", detail=work.drain)
                work.owned_reason = None
                return work.drain
            if heir is not None:
                # Another notice still wants the node drained: hand the drain over rather than resume.
                reason = drain_reason(heir.notice)
                await self.commands.drain(node, reason)
                self.outcomes.record(heir, "drain", node, "ok")
                heir.owned_reason, heir.drain = reason, f"drained (taken over from notice {work.notice.id})"
                work.owned_reason, work.drain = None, f"drain handed to notice {heir.notice.id}"
                return work.drain
            if not self.config.resume:
                work.drain = "left drained (actions.slurm.resume = false)"
                return work.drain
            work.tried.add("resume")
            await self.commands.resume(node)
            self.outcomes.record(work, "resume", node, "ok")
            work.owned_reason, work.drain = None, "resumed"
            return work.drain

    # --- trying again ---------------------------------------------------------------------------------

    def limit(self, work: Work, *, beyond: bool = False) -> Callable[[], datetime | None]:
        """Until when a failing step is tried again: the notice's deadline (read at each failure: it may
        move), or with ``beyond`` ``persist_s`` after it (after acting, without a deadline)."""

        def limit() -> datetime | None:
            deadline = work.notice.deadline
            if not beyond:
                return deadline
            base = deadline or work.acted_at
            return None if base is None else base + timedelta(seconds=self.config.persist_s)

        return limit

    async def persist(
        self,
        work: Work,
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
                self.outcomes.degrade(str(error))
                next_try = self._clock() + timedelta(seconds=delay)
                end = limit()
                if error.missing or stopped() or (end is not None and next_try > end):
                    self.outcomes.record(work, action, target, "failed", error, attempts=str(attempts))
                    return None
                work.pending[key] = {
                    "action": action,
                    "target": target,
                    "attempts": attempts,
                    "error": str(error),
                    "next_try": format_time(next_try),
                    "gives_up_at": format_time(end) if end is not None else None,
                }
                self.outcomes.record(work, action, target, "retrying", error, attempts=str(attempts))
                if until_cleared:
                    await wait_for_any(work.clear, timeout=delay)  # a clear ends the pause early
                    if stopped():
                        return None
                else:
                    await asyncio.sleep(delay)
                delay = min(self.config.retry_max_s, delay * 2)
        finally:
            work.pending.pop(key, None)

    def _recovered(self) -> None:
        if self.node is not None:
            self.outcomes.recovered()


def _runs_batch(work: Work, job_id: int) -> bool:
    """Whether ``job_id`` is a batch job whose script runs on this node (Slurm ends it when the node fails)."""
    found = work.found.get(job_id)
    return found is not None and found.batch and found.batch_host == work.node
