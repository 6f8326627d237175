"""The report's arithmetic (``preemptd report``, the ledger's metrics): from the facts to interruptions, flush
outcomes, resumes, GPU-hours redone and spent checkpointing, goodput, and with prices the realised discount
and the break-even preemption rate. Pure and standard library only; docs/ledger.md derives every formula.

Over 400 lines because one pass over a job's reports decides its interruptions, its flushes and its
resumes under the same rules; splitting it would split those rules.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from agent.ledger.facts import Facts, NoticeFact, ReportFact

REPORT_SCHEMA = 1
# Reports are stamped on arrival: a flush that finished this close after the deadline was still in time.
DEADLINE_SLACK_S = 1.0
# A flush that names no notice belongs to the notice it came in the window of, or up to this long after.
LATE_LIMIT_S = 600.0
HOUR = 3600.0


@dataclass(frozen=True)
class Prices:
    spot_per_gpu_hour: float | None = None
    on_demand_per_gpu_hour: float | None = None
    storage_per_gb_month: float | None = None
    per_1000_requests: float | None = None
    keep_days: float = 7.0


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
        "duration_s": _r(max((r.duration_s or 0.0 for r in finished), default=0.0)) if finished else None,
        "bytes": sum(r.bytes or 0 for r in finished) if finished else None,
        "slack_s": _r(notice.deadline - end) if end is not None and notice.deadline is not None else None,
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
    checkpoints = _checkpoints(reports)
    periodic = [c for c in checkpoints if not c.emergency]
    interruptions: list[_Interruption] = []

    # Announced: an interrupting notice reached its deadline while the job was here.
    for notice in notices:
        if notice.deadline is None or notice.deadline > now:
            continue
        if notice.kind not in rules.interrupting_kinds:
            continue
        if notice.cleared_at is not None and notice.cleared_at < notice.deadline - DEADLINE_SLACK_S:
            continue  # withdrawn before it took the host
        before = [t for t in times if t <= notice.deadline]
        if not before or notice.deadline - before[-1] > rules.active_s:
            continue
        flush = [
            r
            for r in reports
            if r.kind == "checkpoint"
            and r.emergency
            and r.phase in ("finished", "failed")
            and (
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

    # A resume that no announced interruption explains was an unannounced one (the job's processes died and
    # came back on this host); it is dated by the resume, so its redone time includes the restart.
    resumes = _resumes(reports)
    for start in resumes:
        previous = max((t for t in times if t < start), default=first)
        if not any(previous - DEADLINE_SLACK_S <= i.time <= start for i in interruptions if i.announced):
            interruptions.append(_Interruption(start, False))
    interruptions.sort(key=lambda i: i.time)

    for event in interruptions:
        base = [c for c in checkpoints if c.end <= event.time + DEADLINE_SLACK_S]
        reached = [r.step for r in reports if r.time <= event.time + DEADLINE_SLACK_S and r.step is not None]
        if event.outcome in ("in_time", "late"):
            event.from_step = event.flush["step"] if event.flush else None
            event.steps_redone = 0
        else:
            # An unannounced one is dated by the resume: its redone time includes the restart.
            start = base[-1].end if base else first
            event.redone_s = max(0.0, event.time - start)
            event.from_step = base[-1].step if base else None
            fallback = event.flush.get("fallback_step") if event.flush else None
            if fallback is not None:
                event.from_step = fallback
            if reached and event.from_step is not None:
                event.steps_redone = max(0, max(reached) - event.from_step)
        later = [s for s in resumes if s >= event.time - DEADLINE_SLACK_S]
        if event.announced and later:
            event.restart_s = later[0] - event.time

    # Resumes: each return of the job, with the interruption it came back from.
    for start in resumes:
        cause = next((i for i in reversed(interruptions) if i.time <= start + DEADLINE_SLACK_S), None)
        out.resumes.append(
            {
                "job": job,
                "time": _iso(start),
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


def cost(t: Tally, prices: Prices) -> dict[str, Any]:
    """Money: what the spot GPU-hours and checkpoint storage cost, what the same useful work would have cost
    on demand, the realised discount and the break-even preemption rate (docs/ledger.md, "Prices")."""
    missing = [
        f"cost.{name}"
        for name in ("spot_per_gpu_hour", "on_demand_per_gpu_hour")
        if getattr(prices, name) is None
    ]
    if missing:
        return {"missing": missing}
    p_s, p_o = prices.spot_per_gpu_hour, prices.on_demand_per_gpu_hour
    assert p_s is not None and p_o is not None
    storage = (t.checkpoint_bytes / 1e9) * (prices.storage_per_gb_month or 0.0) * prices.keep_days / 30.0
    storage += t.saves / 1000.0 * (prices.per_1000_requests or 0.0)
    useful = (
        t.gpu_hours - t.checkpoint_gpu_hours - t.flush_gpu_hours - t.redone_gpu_hours - t.restart_gpu_hours
    )
    doc: dict[str, Any] = {
        "missing": [],
        "assumed_zero": [
            f"cost.{name}"
            for name in ("storage_per_gb_month", "per_1000_requests")
            if getattr(prices, name) is None
        ],
        "spot": _r(t.gpu_hours * p_s + storage, 4),
        "storage": _r(storage, 4),
        "on_demand_equivalent": _r(max(0.0, useful) * p_o, 4),
        "list_discount": _r(1.0 - p_s / p_o, 4) if p_o > 0 else None,
        "effective_discount": None,
        "preemptions_per_day": None,
        "break_even_per_day": None,
    }
    if t.gpu_hours <= 0 or p_o <= 0:
        return doc
    u = useful / t.gpu_hours
    s = storage / t.gpu_hours  # storage per GPU-hour of spot time
    c = t.checkpoint_gpu_hours / t.gpu_hours
    if u > 0:
        doc["effective_discount"] = _r(1.0 - (p_s + s) / (u * p_o), 4)
    events = t.announced + t.unannounced
    if t.job_hours > 0:
        doc["preemptions_per_day"] = _r(24.0 * events / t.job_hours, 4)
    if events:
        # ell: job-hours lost per interruption, at the job's mean GPUs (GPU-hours / job-hours).
        loss = (t.flush_gpu_hours + t.redone_gpu_hours + t.restart_gpu_hours) / events
        ell = loss / (t.gpu_hours / t.job_hours)
        if ell > 0:
            doc["break_even_per_day"] = _r(max(0.0, 24.0 * (1.0 - c - (p_s + s) / p_o) / ell), 4)
    return doc


def notice_benefit(t: Tally) -> dict[str, Any]:
    """How much longer the advised interval is because notices covered a share ``a`` of the interruptions:
    T* ∝ √M and only uncovered ones count in M, so T* grows by 1/√(1-a); the periodic checkpoints a
    notice-blind interval would have added are the ones saved."""
    events = t.announced + t.unannounced
    if not events:
        return {
            "covered_share": None,
            "interval_factor": None,
            "checkpoint_gpu_hours_saved": None,
            "checkpoint_bytes_saved": None,
        }
    a = (t.in_time + t.late) / events  # the flush kept the work: covered
    if a >= 1.0:
        return {
            "covered_share": 1.0,
            "interval_factor": None,
            "checkpoint_gpu_hours_saved": None,
            "checkpoint_bytes_saved": None,
        }
    factor = 1.0 / math.sqrt(1.0 - a)
    return {
        "covered_share": _r(a, 4),
        "interval_factor": _r(factor, 4),
        "checkpoint_gpu_hours_saved": _r(t.checkpoint_gpu_hours * (factor - 1.0), 4),
        "checkpoint_bytes_saved": round(t.periodic_bytes * (factor - 1.0)),
    }


def figures(t: Tally, prices: Prices | None) -> dict[str, Any]:
    """The ``--json`` figures of one job or of the total (each key in docs/ledger.md)."""
    events = t.announced + t.unannounced
    lost_hours = t.checkpoint_gpu_hours + t.flush_gpu_hours + t.redone_gpu_hours + t.restart_gpu_hours
    return {
        "jobs": t.jobs,
        "gpus": t.gpus,
        "job_hours": _r(t.job_hours, 4),
        "gpu_hours": _r(t.gpu_hours, 4),
        "interruptions": {"announced": t.announced, "unannounced": t.unannounced, "total": events},
        "notice_coverage": _r(t.announced / events, 4) if events else None,
        "flushes": {"in_time": t.in_time, "late": t.late, "lost": t.lost},
        "checkpoints": t.checkpoints,
        "checkpoint_bytes": t.checkpoint_bytes,
        "checkpoint_gpu_hours": _r(t.checkpoint_gpu_hours, 4),
        "flush_gpu_hours": _r(t.flush_gpu_hours, 4),
        "redone_gpu_hours": _r(t.redone_gpu_hours, 4),
        "restart_gpu_hours": _r(t.restart_gpu_hours, 4),
        "steps_redone": t.steps_redone,
        "goodput": _r(1.0 - lost_hours / t.gpu_hours, 4) if t.gpu_hours > 0 else None,
        "notice_benefit": notice_benefit(t),
        "cost": cost(t, prices) if prices is not None else {"missing": ["cost"]},
    }


def build_report(
    facts: Facts,
    now: datetime,
    since: datetime | None = None,
    job: str | None = None,
    prices: Prices | None = None,
    rules: Rules | None = None,
    source: str = "agent",
) -> dict[str, Any]:
    """The report document (``preemptd report --json``)."""
    rules = rules or Rules()
    at = now.timestamp()
    start = since.timestamp() if since is not None else None
    reports = [
        r for r in facts.reports if (start is None or r.time >= start) and (job is None or r.job == job)
    ]
    notices = [n for n in facts.notices if start is None or (n.deadline or n.detected_at) >= start]
    by_job: dict[str, list[ReportFact]] = {}
    for report in sorted(reports, key=lambda r: r.time):
        by_job.setdefault(report.job, []).append(report)
    total = Tally()
    jobs: dict[str, Any] = {}
    flushes: list[dict[str, Any]] = []
    resumes: list[dict[str, Any]] = []
    for name, rows in sorted(by_job.items()):
        one = tally_job(name, rows, notices, at, rules)
        jobs[name] = figures(one, prices)
        total.add(one)
    flushes, resumes = total.flushes, total.resumes
    leads = [n.lead_s for n in notices if n.lead_s is not None and (rules.drills or not n.drill)]
    kinds: dict[str, int] = {}
    for notice in notices:
        kinds[notice.kind] = kinds.get(notice.kind, 0) + 1
    return {
        "schema": REPORT_SCHEMA,
        "source": source,
        "generated_at": _iso(at),
        "since": _iso(start) if start is not None else None,
        "job": job,
        "drills_counted": rules.drills,
        "notices": {
            "total": len(notices),
            "drills": sum(1 for n in notices if n.drill),
            "by_kind": kinds,
            "lead_s": {
                "min": _r(min(leads)) if leads else None,
                "median": _r(statistics.median(leads)) if leads else None,
                "max": _r(max(leads)) if leads else None,
            },
        },
        "total": figures(total, prices),
        "jobs": jobs,
        "flushes": flushes,
        "resumes": sorted(resumes, key=lambda r: r["time"]),
    }


def prices_of(config: Any) -> Prices:
    """:class:`Prices` from a ``CostConfig`` (or anything with the same attributes)."""
    return Prices(
        spot_per_gpu_hour=config.spot_per_gpu_hour,
        on_demand_per_gpu_hour=config.on_demand_per_gpu_hour,
        storage_per_gb_month=config.storage_per_gb_month,
        per_1000_requests=config.per_1000_requests,
        keep_days=config.keep_days,
    )


def prices_to_json(prices: Prices) -> dict[str, Any]:
    return {name: getattr(prices, name) for name in Prices.__dataclass_fields__}


def prices_from_json(doc: Mapping[str, Any]) -> Prices:
    return Prices(**{k: v for k, v in doc.items() if k in Prices.__dataclass_fields__})


def _iso(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, timezone.utc).isoformat().replace("+00:00", "Z")


def _r(value: float | None, digits: int = 3) -> float | None:
    if value is None or not math.isfinite(value):
        return None
    return round(value, digits)
