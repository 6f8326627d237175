"""What shrinking saved an elastic job on this host: its ``membership`` reports (agent/client/elastic.py: the
ranks ``reformed`` at another size in the same processes, this host's ranks ``left``, or the job ``stopped``
instead of shrinking) against what a full relaunch of the job costs here, as the ledger measured it (the
restart of its announced interruptions: resume - stop, agent/ledger/tally.py). Pure and standard library
only; docs/ledger.md, "Re-forms (elastic jobs)", says how each figure is counted."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from agent.ledger.facts import ReportFact
from agent.ledger.tally import HOUR, Rules, Timeline, announced, cost, rounded

REFORMED, LEFT, STOPPED = "reformed", "left", "stopped"
MAX_REASONS = 5  # distinct reasons a job stopped instead of shrinking, kept in the document


@dataclass(frozen=True)
class Reforms:
    """One job's re-forms on this host (or their sum over jobs: ``+``; a sum has no one relaunch time)."""

    reformed: int = 0
    left: int = 0
    stopped: int = 0
    reform_s: float = 0.0  # the re-forms' seconds, summed (those that said them)
    halted_gpu_s: float = 0.0  # reform seconds x the job's GPUs here
    relaunch_s: float | None = None  # the median restart of the job's announced interruptions here
    relaunches: int = 0  # how many restarts that median is of
    saved_reforms: int = 0  # re-forms with both their seconds and a relaunch measured
    saved_gpu_hours: float = 0.0  # (relaunch - reform seconds) x GPUs, over those re-forms
    reasons: tuple[str, ...] = ()

    def __add__(self, other: Reforms) -> Reforms:
        reasons = tuple(dict.fromkeys(self.reasons + other.reasons))[:MAX_REASONS]
        return Reforms(
            reformed=self.reformed + other.reformed,
            left=self.left + other.left,
            stopped=self.stopped + other.stopped,
            reform_s=self.reform_s + other.reform_s,
            halted_gpu_s=self.halted_gpu_s + other.halted_gpu_s,
            relaunch_s=None,
            relaunches=self.relaunches + other.relaunches,
            saved_reforms=self.saved_reforms + other.saved_reforms,
            saved_gpu_hours=self.saved_gpu_hours + other.saved_gpu_hours,
            reasons=reasons,
        )


def memberships(tl: Timeline) -> tuple[ReportFact, ...]:
    """The job's membership reports, one per re-form: a node's first local rank reports it, so two nodes of
    the job on this host report the same change (phase, step, sizes) twice; a report without a step is its
    own."""
    seen: dict[Any, ReportFact] = {}
    rows = [r for gen in tl.generations for r in gen.reports if r.kind == "membership"]
    for index, r in enumerate(sorted(rows, key=lambda r: r.time)):
        key = (r.phase, r.step, r.previous_world_size, r.world_size) if r.step is not None else index
        seen.setdefault(key, r)
    return tuple(seen.values())


def relaunches(tl: Timeline, rules: Rules) -> tuple[float, ...]:
    """The restart seconds of the job's counted announced interruptions it came back from on this host: what
    a full relaunch takes here (the same restart the report charges, resume - stop)."""
    return tuple(
        cost(tl, event).restart_s
        for event in announced(tl, rules)
        if event.counted and event.resume is not None and not event.outlived
    )


def reforms(tl: Timeline, rules: Rules) -> Reforms:
    """The job's re-forms, departures and stops on this host, and what the re-forms saved against the
    job's own relaunch time here (none saved without a measured relaunch: no default is assumed)."""
    rows = memberships(tl)
    if not rows:
        return Reforms()
    reformed = [r for r in rows if r.phase == REFORMED]
    timed = [r.seconds for r in reformed if r.seconds is not None]
    measured = relaunches(tl, rules) if reformed else ()
    relaunch = statistics.median(measured) if measured else None
    saved = sum(relaunch - s for s in timed) * tl.gpus / HOUR if relaunch is not None else 0.0
    reasons = [r.reason or "no reason given" for r in rows if r.phase == STOPPED]
    return Reforms(
        reformed=len(reformed),
        left=sum(1 for r in rows if r.phase == LEFT),
        stopped=sum(1 for r in rows if r.phase == STOPPED),
        reform_s=sum(timed),
        halted_gpu_s=sum(timed) * tl.gpus,
        relaunch_s=relaunch,
        relaunches=len(measured),
        saved_reforms=len(timed) if relaunch is not None else 0,
        saved_gpu_hours=saved,
        reasons=tuple(dict.fromkeys(reasons))[:MAX_REASONS],
    )


def reform_figures(r: Reforms) -> dict[str, Any]:
    """The ``reforms`` object of a job's (or the total's) ``--json`` figures (each key in docs/ledger.md)."""
    return {
        "reformed": r.reformed,
        "left": r.left,
        "stopped": r.stopped,
        "stopped_reasons": list(r.reasons),
        "reform_s": rounded(r.reform_s),
        "halted_gpu_seconds": rounded(r.halted_gpu_s),
        "relaunch_s": rounded(r.relaunch_s),
        "relaunches_measured": r.relaunches,
        "saved_reforms": r.saved_reforms,
        "saved_gpu_hours": rounded(r.saved_gpu_hours, 6) if r.saved_reforms else None,
    }
