"""The jobs' membership as their ranks report it (``membership`` reports, agent/client/elastic.py): the ``jobs``
status section says each job's world size now and its latest re-forms ("shrank 3→2 in 0.5 s at step 1234"),
and each report is one info line (rate-limited: a client in a loop cannot fill the journal).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Any, Protocol

import structlog

from agent.core.notice import format_time
from agent.core.ratelog import ClientMistakes
from agent.core.reports import Report

MAX_JOBS = 64  # the jobs kept (the least recently reported go first)
HISTORY = 5  # re-forms kept per job
log = structlog.get_logger("preemptd.membership")


class MembershipHost(Protocol):
    def on_report(self, fn: Callable[[Report], None]) -> None: ...

    def add_status_section(self, name: str, fn: Callable[[], Any]) -> None: ...


def describe(phase: str, membership: dict[str, Any], step: int | None) -> str:
    """One line for a person: ``shrank 3→2 in 0.47 s at step 1234``."""
    before, after = membership.get("previous_world_size"), membership.get("world_size")
    at = f" at step {step}" if step is not None else ""
    took = f" in {membership['seconds']:.2f} s" if isinstance(membership.get("seconds"), float) else ""
    if phase == "reformed":
        verb = (
            "shrank" if isinstance(before, int) and isinstance(after, int) and after < before else "re-formed"
        )
        return f"{verb} {before}→{after}{took}{at}"
    if phase == "left":
        return f"this host left ({before}→{after}){at}"
    return f"stopped at {before} instead of shrinking{at}: {membership.get('reason', '')}".rstrip(": ")


class MembershipComponent:
    name = "membership"

    def __init__(self) -> None:
        self.jobs: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._lines = ClientMistakes(log)

    def setup(self, host: MembershipHost) -> None:
        host.on_report(self._on_report)
        host.add_status_section("jobs", self.status)

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None

    def _on_report(self, report: Report) -> None:
        if report.kind != "membership":
            return
        job = str(report.client.get("job") or report.client.get("name") or "unknown")
        membership = dict(report.membership)
        what = describe(report.phase, membership, report.step)
        entry = self.jobs.pop(job, None) or {"history": deque(maxlen=HISTORY)}
        entry.update(world_size=membership.get("world_size"), last=report.phase)
        entry["history"].append(
            {
                "time": format_time(report.received_at),
                "phase": report.phase,
                "step": report.step,
                "what": what,
                **membership,
            }
        )
        self.jobs[job] = entry
        while len(self.jobs) > MAX_JOBS:
            self.jobs.popitem(last=False)
        self._lines.note(
            "info", "job_membership", job=job, phase=report.phase, what=what, pid=report.peer_pid
        )

    def status(self) -> dict[str, Any]:
        return {
            job: {"world_size": entry["world_size"], "last": entry["last"], "history": list(entry["history"])}
            for job, entry in self.jobs.items()
        }
