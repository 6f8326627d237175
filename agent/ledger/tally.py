"""Counting one job's interruptions, flushes, resumes and hours from its reports and the notices: the
arithmetic under ``preemptd report`` (agent/ledger/report.py turns it into the document and the money). Pure
and standard library only; docs/ledger.md says how each figure is counted.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from agent.ledger.facts import NoticeFact, ReportFact

# Reports are stamped on arrival: a flush that finished this close after the deadline was still in time.
DEADLINE_SLACK_S = 1.0
# A flush that names no notice belongs to the notice it came in the window of, or up to this long after.
LATE_LIMIT_S = 600.0
HOUR = 3600.0


@dataclass(frozen=True)
class Rules:
    interrupting_kinds: tuple[str, ...] = ("termination", "maintenance")
    active_s: float = 86400.0
    drills: bool = False  # count drill notices as interruptions (a rehearsal costs a flush and a restart too)


@dataclass
class _Checkpoint:
    step: int | None
    emergency: bool
    end: float
    duration_s: float
    bytes: int
    saves: int  # ranks that reported it finished


@dataclass
class _Interruption:
    time: float
    announced: bool
    notice_id: str | None = None
    outcome: str | None = None  # in_time, late, lost (announced only)
    flush: dict[str, Any] | None = None
    redone_s: float = 0.0
    restart_s: float = 0.0
    from_step: int | None = None
    steps_redone: int | None = None
    # A drill's resume is explained by the drill; whether it counts as an interruption is Rules.drills.
    drill: bool = False


@dataclass
class Tally:
    """One job's figures (or their sum over jobs)."""

    jobs: int = 0
    gpus: int = 0
    job_hours: float = 0.0
    gpu_hours: float = 0.0
    announced: int = 0
    unannounced: int = 0
    in_time: int = 0
    late: int = 0
    lost: int = 0
    checkpoints: int = 0
    saves: int = 0
    checkpoint_bytes: int = 0
    periodic_bytes: int = 0
    checkpoint_gpu_hours: float = 0.0
    flush_gpu_hours: float = 0.0
    redone_gpu_hours: float = 0.0
    restart_gpu_hours: float = 0.0
    steps_redone: int = 0
    flushes: list[dict[str, Any]] = field(default_factory=list)
    resumes: list[dict[str, Any]] = field(default_factory=list)

    def add(self, other: Tally) -> None:
        for name in self.__dataclass_fields__:
            mine = getattr(self, name)
            setattr(self, name, mine + getattr(other, name))


def _flush_doc(job: str, notice: NoticeFact, reports: Sequence[ReportFact], outcome: str) -> dict[str, Any]:
    finished = [r for r in reports if r.phase == "finished"]
    end = max((r.time for r in finished), default=None)
    fallback = next((r.fallback_step for r in reports if r.fallback_step is not None), None)
    tiers = sorted({r.tier for r in reports if r.tier})
    return {
        "job": job,
        "notice_id": notice.id,
        "outcome": outcome,
        "step": next((r.step for r in finished if r.step is not None), None),
        "tier": ",".join(tiers) or None,
        "duration_s": rounded(max((r.duration_s or 0.0 for r in finished), default=0.0))
        if finished
        else None,
        "bytes": sum(r.bytes or 0 for r in finished) if finished else None,
        "slack_s": rounded(notice.deadline - end)
        if end is not None and notice.deadline is not None
        else None,
        "fallback_step": fallback,
    }


def _rank_key(report: ReportFact) -> int:
    return report.rank if report.rank is not None else -1


def _gpus(reports: Sequence[ReportFact]) -> int:
    """The job's GPUs on this host: each rank's latest ``gpus``, one for a rank that does not say."""
    per_rank: dict[int, int] = {}
    for report in reports:
        if report.gpus is not None and report.gpus > 0:
            per_rank[_rank_key(report)] = report.gpus
        else:
            per_rank.setdefault(_rank_key(report), 1)
    return sum(per_rank.values())


def _checkpoints(reports: Sequence[ReportFact]) -> list[_Checkpoint]:
    """Finished checkpoints, one per step: ranks block for the slowest and each writes its share."""
    groups: dict[Any, _Checkpoint] = {}
    for index, report in enumerate(reports):
        if report.kind != "checkpoint" or report.phase != "finished":
            continue
        key = (report.step, report.emergency) if report.step is not None else index
        found = groups.get(key)
        if found is None:
            groups[key] = _Checkpoint(
                report.step, report.emergency, report.time, report.duration_s or 0.0, report.bytes or 0, 1
            )
        else:
            found.end = max(found.end, report.time)
            found.duration_s = max(found.duration_s, report.duration_s or 0.0)
            found.bytes += report.bytes or 0
            found.saves += 1
    return sorted(groups.values(), key=lambda c: c.end)


def _resumes(reports: Sequence[ReportFact]) -> list[float]:
    """When the job came back on this host: a new process for a rank that already has one in the current
    generation of processes starts the next generation (the other ranks' new processes join it)."""
    current: dict[int, int] = {}
    starts: list[float] = []
    for report in reports:
        if report.pid is None:
            continue
        rank = _rank_key(report)
        if rank in current and current[rank] != report.pid:
            starts.append(report.time)
            current = {}
        current[rank] = report.pid
    return starts


def tally_job(
    job: str, reports: Sequence[ReportFact], notices: Sequence[NoticeFact], now: float, rules: Rules
) -> Tally:
    """Interruptions, flushes, resumes and hours of one job (``reports`` oldest first)."""
    out = Tally(jobs=1, gpus=_gpus(reports))
    if not reports:
        return out
    times = [r.time for r in reports]
    first, last = times[0], times[-1]
    # The highest step reported by each report's time (what the job had reached), for bisecting by time.
    reached: list[int | None] = []
    for report in reports:
        best = reached[-1] if reached else None
        if report.step is not None and (best is None or report.step > best):
            best = report.step
        reached.append(best)
    checkpoints = _checkpoints(reports)
    # A checkpoint is reported when it finished: the job was there since it began.
    first = min([first] + [c.end - c.duration_s for c in checkpoints])
    ends = [c.end for c in checkpoints]
    periodic = [c for c in checkpoints if not c.emergency]
    emergency_reports = [
        r for r in reports if r.kind == "checkpoint" and r.emergency and r.phase in ("finished", "failed")
    ]
    interruptions: list[_Interruption] = []

    # Announced: an interrupting notice reached its deadline while the job was here.
    for notice in notices:
        if notice.deadline is None or notice.deadline > now:
            continue
        if notice.kind not in rules.interrupting_kinds:
            continue
        if notice.cleared_at is not None and notice.cleared_at < notice.deadline - DEADLINE_SLACK_S:
            continue  # withdrawn before it took the host
        seen = bisect.bisect_right(times, notice.deadline)
        if not seen or notice.deadline - times[seen - 1] > rules.active_s:
            continue
        flush = [
            r
            for r in emergency_reports
            if (
                r.notice_id == notice.id
                or (r.notice_id is None and notice.detected_at <= r.time <= notice.deadline + LATE_LIMIT_S)
            )
        ]
        finished = [r for r in flush if r.phase == "finished"]
        if finished:
            end = max(r.time for r in finished)
            outcome = "in_time" if end <= notice.deadline + DEADLINE_SLACK_S else "late"
        else:
            outcome = "lost"
        event = _Interruption(
            notice.deadline,
            True,
            notice.id,
            outcome,
            _flush_doc(job, notice, flush, outcome),
            drill=notice.drill,
        )
        interruptions.append(event)

    # A resume explains an interruption dated between the job's last report before it and the resume itself.
    resumes = _resumes(reports)
    last_before = {start: times[max(0, bisect.bisect_left(times, start) - 1)] for start in resumes}

    def explains(start: float, at: float) -> bool:
        return last_before[start] - DEADLINE_SLACK_S <= at <= start

    # A resume that no announced interruption explains was an unannounced one (the job's processes died and
    # came back on this host); it is dated by the resume, so its redone time includes the restart.
    for start in resumes:
        if not any(explains(start, i.time) for i in interruptions if i.announced):
            interruptions.append(_Interruption(start, False))
    interruptions.sort(key=lambda i: i.time)

    for event in interruptions:
        index = bisect.bisect_right(ends, event.time + DEADLINE_SLACK_S)
        base = checkpoints[index - 1] if index else None
        upto = bisect.bisect_right(times, event.time + DEADLINE_SLACK_S)
        highest = reached[upto - 1] if upto else None
        back = next((start for start in resumes if explains(start, event.time)), None)
        if event.announced and back is None and last > event.time + DEADLINE_SLACK_S:
            # The job's processes kept reporting after the deadline (a drill, a notice the host outlived):
            # nothing was lost or restarted, whatever the flush did.
            event.from_step, event.steps_redone = None, 0
        elif event.outcome in ("in_time", "late"):
            event.from_step = event.flush["step"] if event.flush else None
            event.steps_redone = 0
        else:
            # An unannounced one is dated by the resume: its redone time includes the restart.
            start = base.end if base is not None else first
            event.redone_s = max(0.0, event.time - start)
            event.from_step = base.step if base is not None else None
            fallback = event.flush.get("fallback_step") if event.flush else None
            if fallback is not None:
                event.from_step = fallback
            if highest is not None and event.from_step is not None:
                event.steps_redone = max(0, highest - event.from_step)
        if event.announced and back is not None:
            event.restart_s = back - event.time

    # Resumes: each return of the job, with the interruption it came back from.
    for start in resumes:
        cause = next((i for i in reversed(interruptions) if i.time <= start + DEADLINE_SLACK_S), None)
        out.resumes.append(
            {
                "job": job,
                "time": iso(start),
                "from_step": cause.from_step if cause else None,
                "steps_redone": cause.steps_redone if cause else None,
                "announced": cause.announced if cause else False,
                "notice_id": cause.notice_id if cause else None,
                "drill": cause.drill if cause else False,
            }
        )

    gpus = out.gpus
    end = max([last] + [i.time for i in interruptions])
    out.job_hours = (end - first) / HOUR
    out.gpu_hours = out.job_hours * gpus
    out.checkpoints = len(periodic)
    out.saves = sum(c.saves for c in checkpoints)
    out.checkpoint_bytes = sum(c.bytes for c in checkpoints)
    out.periodic_bytes = sum(c.bytes for c in periodic)
    out.checkpoint_gpu_hours = sum(c.duration_s for c in periodic) * gpus / HOUR
    emergency = [c for c in checkpoints if c.emergency]
    out.flush_gpu_hours = sum(c.duration_s for c in emergency) * gpus / HOUR
    for event in interruptions:
        if event.drill and not rules.drills:
            continue
        if event.announced:
            out.announced += 1
            setattr(out, event.outcome or "lost", getattr(out, event.outcome or "lost") + 1)
            if event.flush is not None:
                out.flushes.append(event.flush)
        else:
            out.unannounced += 1
        out.redone_gpu_hours += event.redone_s * gpus / HOUR
        out.restart_gpu_hours += event.restart_s * gpus / HOUR
        out.steps_redone += event.steps_redone or 0
    return out


def iso(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, timezone.utc).isoformat().replace("+00:00", "Z")


def rounded(value: float | None, digits: int = 3) -> float | None:
    if value is None or not math.isfinite(value):
        return None
    return round(value, digits)
