"""The jobs' changes as their ranks report them: their membership (``membership`` reports,
agent/client/elastic.py) and their peer snapshots' rate (``snapshot_rate`` reports, agent/client/hazard.py).
The ``jobs`` status section says each job's world size now and its latest changes ("shrank 3→2 in 0.5 s at
step 1234", "snapshots every 10 steps instead of 20: gpu_degraded from nvml"), which ``preemptd watch`` shows
as they come; each report is one info line (rate-limited: a client in a loop cannot fill the journal).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Any, Protocol

import structlog

from agent.core.notice import format_time
from agent.core.ports import HasHooks
from agent.core.ratelog import ClientMistakes
from agent.core.reports import Report

MAX_JOBS = 64  # the jobs kept (the least recently reported go first)
HISTORY = 5  # re-forms kept per job
log = structlog.get_logger("preemptd.membership")


class MembershipHost(HasHooks, Protocol):
    """What the membership reports use of the agent."""


def describe_rate(phase: str, rate: dict[str, Any]) -> str:
    """One line for a person: ``snapshots every 10 steps instead of 20 (hazard x4: gpu_degraded ...)``."""
    usual = f" instead of {rate['usual']}" if rate.get("usual") not in (None, rate.get("every")) else ""
    if phase == "relaxed":
        return f"snapshots every {rate.get('every')} steps again"
    factor = rate.get("factor")
    why = f"hazard x{factor:g}" if isinstance(factor, float) else "hazard"
    reason = f": {rate['reason']}" if rate.get("reason") else ""
    return f"snapshots every {rate.get('every')} steps{usual} ({why}{reason})"


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
        host.hooks.on_report(self._on_report)
        host.hooks.add_status_section("jobs", self.status)

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None

    def _on_report(self, report: Report) -> None:
        if report.kind not in ("membership", "snapshot_rate"):
            return
        job = str(report.client.get("job") or report.client.get("name") or "unknown")
        entry = self.jobs.pop(job, None) or {"history": deque(maxlen=HISTORY), "world_size": None}
        if report.kind == "membership":
            said = dict(report.membership)
            what = describe(report.phase, said, report.step)
            entry.update(world_size=said.get("world_size"), last=report.phase)
            event = "job_membership"
        else:
            said = dict(report.rate)
            what = describe_rate(report.phase, said)
            entry.update(snapshots_every=said.get("every"), last=report.phase)
            event = "job_snapshot_rate"
        entry["history"].append(
            {
                "time": format_time(report.received_at),
                "phase": report.phase,
                "step": report.step,
                "what": what,
                **said,
            }
        )
        self.jobs[job] = entry
        while len(self.jobs) > MAX_JOBS:
            self.jobs.popitem(last=False)
        self._lines.note("info", event, job=job, phase=report.phase, what=what, pid=report.peer_pid)

    def status(self) -> dict[str, Any]:
        return {
            job: {
                "world_size": entry["world_size"],
                "last": entry["last"],
                **({"snapshots_every": entry["snapshots_every"]} if "snapshots_every" in entry else {}),
                "history": list(entry["history"]),
            }
            for job, entry in self.jobs.items()
        }
