"""Elastic Slurm jobs: what this host's ranks said about the Slurm job they run in, so that the bridge keeps a
job that shrinks instead of requeueing it (docs/slurm.md, "Elastic jobs").

A rank under ``preemptd exec -- torchrun --nnodes MIN:MAX`` reports ``client.min_nodes``/``max_nodes`` and its
``client.slurm_job_id`` with every report (agent/client/reporting.py: client_info). After a notice, each node's
first local rank says what the job did (agent/client/elastic.py): ``left`` (this host's ranks left, the others
re-formed without it: the job goes on, on the job's other nodes), ``stopped`` (it could not shrink: every rank
flushed and stops, so today's requeue applies) or ``reformed`` (this host stayed). The bridge waits for that word
before it requeues a job that registered as elastic, and requeues it when the word is ``stopped``, or when none
came by the latest moment (deadline - ``margin_s``).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from agent.core.notice import format_time
from agent.core.reports import Report

MAX_JOBS = 256  # Slurm jobs remembered (the least recently reported go first)


@dataclass(frozen=True)
class Membership:
    """The latest membership report of a job's ranks on this host."""

    phase: str
    received_at: datetime
    world_size: int | None
    previous_world_size: int | None
    reason: str

    def to_json(self) -> dict[str, Any]:
        return {
            "phase": self.phase,
            "at": format_time(self.received_at),
            "world_size": self.world_size,
            "previous_world_size": self.previous_world_size,
            **({"reason": self.reason} if self.reason else {}),
        }


def slurm_job(client: dict[str, Any]) -> int | None:
    """The Slurm job id a client named (``slurm_job_id``: Slurm's ``SLURM_JOB_ID``), or None."""
    value = str(client.get("slurm_job_id") or "")
    return int(value) if value.isdigit() else None


class ElasticJobs:
    """Which of this host's Slurm jobs registered as elastic (their MIN and MAX nodes), and each job's latest
    membership report."""

    def __init__(self) -> None:
        self.nodes: OrderedDict[int, tuple[int, int]] = OrderedDict()
        self.membership: OrderedDict[int, Membership] = OrderedDict()

    def note(self, report: Report) -> None:
        """Take what ``report`` says about its Slurm job, if it names one."""
        job = slurm_job(dict(report.client))
        if job is None:
            return
        low, high = report.client.get("min_nodes"), report.client.get("max_nodes")
        if isinstance(low, int) and isinstance(high, int):
            _remember(self.nodes, job, (low, high))
        if report.kind == "membership":
            said = dict(report.membership)
            _remember(
                self.membership,
                job,
                Membership(
                    phase=report.phase,
                    received_at=report.received_at,
                    world_size=said.get("world_size"),
                    previous_world_size=said.get("previous_world_size"),
                    reason=str(said.get("reason") or ""),
                ),
            )

    def said(self, job_id: int, since: datetime) -> Membership | None:
        """The job's membership report received at or after ``since`` (the notice), if any."""
        found = self.membership.get(job_id)
        return found if found is not None and found.received_at >= since else None

    def kept(self, job_id: int, since: datetime) -> str | None:
        """Why the job is not requeued (its ranks here left and the rest of it goes on), or None."""
        said = self.said(job_id, since)
        if said is None or said.phase != "left":
            return None
        size = f" at world size {said.world_size}" if said.world_size is not None else ""
        return f"kept: elastic, this node left and the job goes on{size} on its other nodes"

    def waiting(self, job_id: int, since: datetime) -> bool:
        """Whether the requeue waits for the job's word: it registered as elastic and has said nothing since."""
        return job_id in self.nodes and self.said(job_id, since) is None

    def describe(self, job_id: int, since: datetime) -> dict[str, Any]:
        """What status shows of the job: its MIN/MAX nodes and its membership since the notice."""
        shown: dict[str, Any] = {}
        if job_id in self.nodes:
            low, high = self.nodes[job_id]
            shown["elastic"] = {"min_nodes": low, "max_nodes": high}
        said = self.said(job_id, since)
        if said is not None:
            shown["membership"] = said.to_json()
        return shown

    def carry_over(self, previous: ElasticJobs) -> None:
        self.nodes, self.membership = previous.nodes, previous.membership


def _remember(table: OrderedDict[int, Any], job: int, value: Any) -> None:
    table.pop(job, None)
    table[job] = value
    while len(table) > MAX_JOBS:
        table.popitem(last=False)
