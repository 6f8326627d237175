"""The ``preemptd report`` document: each job's figures and their total, the notices, flushes and resumes, and
with prices the money: the realised discount, the break-even preemption rate, and what the notices save in
checkpoint I/O. Pure and standard library only; docs/ledger.md derives every formula.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from agent.ledger.facts import Facts, ReportFact
from agent.ledger.reforms import Reforms, reform_figures, reforms
from agent.ledger.snapshots import Snapshots, snapshot_figures, snapshots
from agent.ledger.tally import Rules, Tally, goodput, iso, rounded, tally, timeline

REPORT_SCHEMA = 1


@dataclass(frozen=True)
class Prices:
    spot_per_gpu_hour: float | None = None
    on_demand_per_gpu_hour: float | None = None
    storage_per_gb_month: float | None = None
    per_1000_requests: float | None = None
    keep_days: float = 7.0


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
    useful = t.useful_gpu_hours
    doc: dict[str, Any] = {
        "missing": [],
        "assumed_zero": [
            f"cost.{name}"
            for name in ("storage_per_gb_month", "per_1000_requests")
            if getattr(prices, name) is None
        ],
        "spot": rounded(t.gpu_hours * p_s + storage, 4),
        "storage": rounded(storage, 4),
        "on_demand_equivalent": rounded(useful * p_o, 4),
        "list_discount": rounded(1.0 - p_s / p_o, 4) if p_o > 0 else None,
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
        doc["effective_discount"] = rounded(1.0 - (p_s + s) / (u * p_o), 4)
    events = t.announced + t.unannounced
    if t.job_hours > 0:
        doc["preemptions_per_day"] = rounded(24.0 * events / t.job_hours, 4)
    if events:
        # ell: job-hours lost per interruption, at the job's mean GPUs (GPU-hours / job-hours).
        loss = (t.flush_gpu_hours + t.redone_gpu_hours + t.restart_gpu_hours) / events
        ell = loss / (t.gpu_hours / t.job_hours)
        if ell > 0:
            doc["break_even_per_day"] = rounded(max(0.0, 24.0 * (1.0 - c - (p_s + s) / p_o) / ell), 4)
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
        "covered_share": rounded(a, 4),
        "interval_factor": rounded(factor, 4),
        "checkpoint_gpu_hours_saved": rounded(t.checkpoint_gpu_hours * (factor - 1.0), 4),
        "checkpoint_bytes_saved": round(t.periodic_bytes * (factor - 1.0)),
    }


def figures(
    t: Tally, prices: Prices | None, shrunk: Reforms | None = None, snaps: Snapshots | None = None
) -> dict[str, Any]:
    """The ``--json`` figures of one job or of the total (each key in docs/ledger.md); ``shrunk``: its
    re-forms (an elastic job's); ``snaps``: its peer snapshots."""
    events = t.announced + t.unannounced
    return {
        "jobs": t.jobs,
        "gpus": t.gpus,
        "job_hours": rounded(t.job_hours, 4),
        "gpu_hours": rounded(t.gpu_hours, 4),
        "interruptions": {"announced": t.announced, "unannounced": t.unannounced, "total": events},
        "notice_coverage": rounded(t.announced / events, 4) if events else None,
        "flushes": {"in_time": t.in_time, "late": t.late, "lost": t.lost},
        "checkpoints": t.checkpoints,
        "checkpoint_bytes": t.checkpoint_bytes,
        "checkpoint_gpu_hours": rounded(t.checkpoint_gpu_hours, 4),
        "flush_gpu_hours": rounded(t.flush_gpu_hours, 4),
        "redone_gpu_hours": rounded(t.redone_gpu_hours, 4),
        "restart_gpu_hours": rounded(t.restart_gpu_hours, 4),
        "steps_redone": t.steps_redone,
        "useful_gpu_hours": rounded(t.useful_gpu_hours, 4),
        "goodput": rounded(goodput(t), 4),
        "notice_benefit": notice_benefit(t),
        "cost": cost(t, prices) if prices is not None else {"missing": ["cost"]},
        "reforms": reform_figures(shrunk or Reforms()),
        "snapshots": snapshot_figures(snaps or Snapshots()),
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
    total, shrunk, snapped = Tally(), Reforms(), Snapshots()
    jobs: dict[str, Any] = {}
    for name, rows in sorted(by_job.items()):
        tl = timeline(name, rows, notices, at, rules)
        one, its, snaps = tally(tl, rules), reforms(tl, rules), snapshots(tl, rules)
        jobs[name] = figures(one, prices, its, snaps)
        total, shrunk, snapped = total + one, shrunk + its, snapped + snaps
    leads = [n.lead_s for n in notices if n.lead_s is not None and (rules.drills or not n.drill)]
    kinds: dict[str, int] = {}
    sources: dict[str, int] = {}
    for notice in notices:
        kinds[notice.kind] = kinds.get(notice.kind, 0) + 1
        sources[notice.source] = sources.get(notice.source, 0) + 1
    return {
        "schema": REPORT_SCHEMA,
        "source": source,
        "generated_at": iso(at),
        "since": iso(start) if start is not None else None,
        "job": job,
        "drills_counted": rules.drills,
        "notices": {
            "total": len(notices),
            "drills": sum(1 for n in notices if n.drill),
            "by_kind": kinds,
            "by_source": sources,
            "lead_s": {
                "min": rounded(min(leads)) if leads else None,
                "median": rounded(statistics.median(leads)) if leads else None,
                "max": rounded(max(leads)) if leads else None,
            },
        },
        "total": figures(total, prices, shrunk, snapped),
        "jobs": jobs,
        "flushes": list(total.flushes),
        "resumes": sorted(total.resumes, key=lambda r: r["time"]),
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
