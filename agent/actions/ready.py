"""The ``ready`` step: clients that declared themselves participants (``client.participant`` in a report: a
``participant``/``registered`` report when their watcher connects, or any checkpoint report) report their
emergency checkpoint finished; once all that were alive at the notice have, or a grace runs out
(never later than a margin before the deadline), the agent publishes ``ready`` for the notice.

This module decides when; who the participants are is in participants.py, what is tracked per notice in
ready_notice.py, and the Azure acknowledgement that may follow ``ready`` in azure_ack.py.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from typing import Any

from agent.actions.common import OwnedTasks, applies, log
from agent.actions.participants import STATUS_SAMPLE, Owned, Participants
from agent.actions.ready_notice import Pending
from agent.config import ReadyConfig
from agent.core.notice import Event, EventType, Notice, utcnow
from agent.core.reports import Report
from agent.core.tasks import TaskSet

Publish = Callable[[str, Mapping[str, Any]], Any]


class ReadyEngine(OwnedTasks):
    """Tracks participants and, per matching notice, who has saved; publishes ``ready`` once per notice.
    A :class:`agent.core.ports.Reactor` named ``ready``."""

    name = "ready"

    def __init__(self, config: ReadyConfig, *, publish: Publish, tasks: TaskSet, history: int = 100) -> None:
        self.config = config
        self._publish = publish
        self._tasks = tasks
        self._pending: dict[str, Pending] = {}
        self._participants = Participants(config, self._awaited)
        self._history = max(1, history)
        # The data of the last ready event seen (for the last-ready metrics).
        self.last_ready: dict[str, Any] = {}

    # --- reactor contract ---------------------------------------------------------------------------

    def handle(self, event: Event) -> None:
        if event.type is EventType.READY:
            self.last_ready = dict(event.data)
        self.on_event(event)

    async def stop(self, timeout: float) -> None:
        # Grace timers only wait: nothing is lost by cancelling them at once.
        await self._tasks.close(0)

    def carry_over(self, previous: object) -> None:
        """After a reload: keep the participants and the notices being waited for (their timers stay with
        the previous instance's tasks and declare through the same records)."""
        if isinstance(previous, ReadyEngine):
            self._participants.registered = previous._participants.registered
            self._pending = previous._pending
            self.last_ready = previous.last_ready

    # --- inputs -------------------------------------------------------------------------------------

    def refusal(self, report: Report, privileged: bool) -> tuple[int, str] | None:
        """Why ``report`` must be refused, as (HTTP status, reason), or None (:meth:`Participants.refusal`)."""
        return self._participants.refusal(report, privileged)

    def _awaited(self) -> Iterator[set[Owned]]:
        """The participants of each notice still waited for."""
        return (pending.expected for pending in self._pending.values() if pending.waiting)

    def on_report(self, report: Report) -> None:
        key = self._participants.record(report)
        if report.kind == "participant":
            self._join_waiting(key)
            return
        if report.phase not in ("finished", "failed") or not report.emergency:
            return
        for pending in list(self._pending.values()):
            if pending.ready_at is not None or pending.cleared:
                continue
            if report.notice_id not in (None, pending.notice.id):
                continue
            if key not in pending.expected and key not in self._participants.registered:
                continue  # a client that never declared itself is not waited for, nor counted
            pending.expected.add(key)
            said = pending.done.get(key)
            pending.done[key] = report.phase
            if said != report.phase:  # one line per participant and outcome, however often it reports
                log.info(
                    "ready_participant_done",
                    notice_id=pending.notice.id,
                    participant=key[1],
                    uid=key[0],
                    phase=report.phase,
                )
            if pending.expected <= set(pending.done):
                self._declare(pending, "all_participants")

    def _join_waiting(self, key: Owned) -> None:
        """A process that registers while a notice is waited for (its registration raced the notice, or it
        started during it) has the notice in its snapshot and may be saving: wait for it too."""
        for pending in self._pending.values():
            if pending.waiting and key not in pending.expected:
                pending.expected.add(key)
                log.info(
                    "ready_participant_joined", notice_id=pending.notice.id, participant=key[1], uid=key[0]
                )

    def on_event(self, event: Event) -> None:
        notice = event.notice
        if notice is None or not self.config.enabled:
            return
        if event.type is EventType.CLEARED:
            pending = self._pending.get(notice.id)
            if pending is not None and pending.ready_at is None:
                pending.cleared = True
                if pending.timer is not None:
                    pending.timer.cancel("notice cleared")
            return
        if event.type not in (EventType.NOTICE, EventType.UPDATE) or notice.id in self._pending:
            return
        cfg = self.config
        if not applies(notice, cfg.kinds, cfg.min_severity, True):
            return
        self._start(notice)

    # --- lifecycle ----------------------------------------------------------------------------------

    def _start(self, notice: Notice) -> None:
        now = utcnow()
        self._participants.prune(now)
        expected = set(self._participants.registered)
        cutoff = self.config.grace_s
        if notice.deadline is not None:
            cutoff = min(cutoff, (notice.deadline - now).total_seconds() - self.config.deadline_margin_s)
        cutoff = max(0.0, cutoff)
        pending = Pending(notice=notice, expected=expected, started=time.monotonic(), cutoff_s=cutoff)
        self._pending[notice.id] = pending
        self._trim()
        log.info(
            "ready_waiting",
            notice_id=notice.id,
            participants=len(expected),
            sample=pending.outcome()["participants"][:STATUS_SAMPLE],
            grace_s=round(cutoff, 3),
        )
        # Even an immediate ready goes through a task: this runs inside the agent's dispatch of the notice
        # event, and every other listener must see the notice before anyone sees its ready.
        if not expected and self.config.without_participants == "immediately":
            delay, reason = 0.0, "no_participants"
        elif cutoff <= 0:
            delay, reason = 0.0, "deadline"
        else:
            delay, reason = cutoff, "grace" if expected else "no_participants"
        pending.timer = self._tasks.spawn(self._expire(pending, delay, reason), f"ready-grace:{notice.id}")

    async def _expire(self, pending: Pending, delay: float, reason: str) -> None:
        await asyncio.sleep(delay)
        if pending.ready_at is None and not pending.cleared:
            # A participant that joined during the wait makes it a grace that ran out.
            joined = reason == "no_participants" and delay > 0 and bool(pending.expected)
            self._declare(pending, "grace" if joined else reason)

    def _declare(self, pending: Pending, reason: str) -> None:
        if pending.timer is not None and pending.timer is not asyncio.current_task():
            pending.timer.cancel("ready")
        now = utcnow()
        notice = pending.notice
        pending.ready_at = now
        data: dict[str, Any] = {
            "reason": reason,
            **pending.outcome(),
            "notice_to_ready_s": round((now - notice.detected_at).total_seconds(), 3),
            "margin_s": round((notice.deadline - now).total_seconds(), 3) if notice.deadline else None,
        }
        pending.data = data
        # Logged once, as notice_ready, by the agent that publishes it.
        result = self._publish(notice.id, data)
        if inspect.isawaitable(result):
            self._tasks.spawn(_await(result), f"publish-ready:{notice.id}")

    def _trim(self) -> None:
        while len(self._pending) > self._history:
            oldest = next(iter(self._pending))
            if self._pending[oldest].ready_at is None and not self._pending[oldest].cleared:
                break
            del self._pending[oldest]

    def pending(self, notice_id: str) -> Pending | None:
        return self._pending.get(notice_id)

    def status(self) -> dict[str, Any]:
        """A summary: counts per uid, and the first few participants by name; not thousands of entries."""
        return {
            **self._participants.status(),
            "notices": {notice_id: pending.to_json() for notice_id, pending in self._pending.items()},
        }


async def _await(result: Awaitable[Any]) -> None:
    await result
