"""What the Slurm bridge keeps: one :class:`Work` per notice (what it did and is doing for it, shown under
``notices`` in the bridge's status) and the :class:`Outcomes` of its calls to Slurm (the recent ones, counts
for the metrics, and why the bridge is degraded while the controller does not answer).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import structlog

from agent.actions.common import Recent
from agent.bridges.slurm_commands import SlurmError, SlurmJob
from agent.core.notice import Notice, format_time

log = structlog.get_logger("preemptd.slurm")


@dataclass
class Work:
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


class Outcomes:
    """The bridge's calls to Slurm: the last ``history_size`` outcomes (status ``actions``), counts by action
    and outcome (metrics) and ``degraded``, why the bridge cannot act (None while Slurm answers)."""

    def __init__(self, history_size: int, clock: Callable[[], datetime]) -> None:
        self.recent = Recent(history_size)
        self.counts: Counter[tuple[str, str]] = Counter()
        self.degraded: str | None = None
        self._clock = clock

    def record(
        self,
        work: Work,
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

    def degrade(self, why: str) -> None:
        if self.degraded != why:
            log.error("slurm_degraded", why=why, effect="notices still reach local clients")
        self.degraded = why

    def recovered(self) -> None:
        if self.degraded:
            log.info("slurm_recovered", was=self.degraded)
            self.degraded = None  # the controller answers again
