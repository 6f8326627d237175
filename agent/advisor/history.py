"""The advisor's reading of the history log: records parsed into agent runs, notices and checkpoint reports,
the reports of all ranks merged into checkpoints, and where each run ended. Pure: no I/O, no clock.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from agent.core.errors import NoticeError
from agent.core.notice import parse_time


@dataclass(frozen=True)
class Checkpoint:
    """One checkpoint of one job, merged over the reports of all its ranks (the job blocks for the slowest)."""

    job: str
    step: int | None
    finished_at: datetime
    duration_s: float
    emergency: bool
    notice_id: str | None
    reports: int
    snapshot: bool = False  # a peer snapshot (``flush.tier`` "snapshot"), not a durable checkpoint
    complete_s: float | None = None  # a snapshot's time until committed on the peers (L1), slowest rank


@dataclass
class Notice:
    id: str
    kind: str
    drill: bool
    detected_at: datetime
    deadline: datetime | None
    cleared_at: datetime | None
    run: int


@dataclass
class Run:
    start: datetime
    previous_clean: bool | None
    last: datetime
    stopped: datetime | None = None


@dataclass
class Report:
    time: datetime
    phase: str
    duration_s: float | None
    emergency: bool
    notice_id: str | None
    step: int | None
    job: str
    run: int
    snapshot: bool = False
    complete_s: float | None = None


def _time(record: Mapping[str, Any], key: str = "time") -> datetime | None:
    value = record.get(key)
    if not isinstance(value, str):
        return None
    try:
        return parse_time(value)
    except NoticeError:
        return None


def parse(records: Iterable[Any]) -> tuple[list[Run], dict[str, Notice], list[Report]]:
    runs: list[Run] = []
    notices: dict[str, Notice] = {}
    reports: list[Report] = []
    for record in records:
        if not isinstance(record, Mapping):
            continue
        at = _time(record)
        if at is None:
            continue
        kind = record.get("type")
        if kind == "agent_start" or not runs:
            clean = record.get("previous_clean") if kind == "agent_start" else None
            runs.append(Run(start=at, previous_clean=clean if isinstance(clean, bool) else None, last=at))
            if kind == "agent_start":
                continue
        run = runs[-1]
        run.last = max(run.last, at)
        if kind == "agent_stop":
            run.stopped = at
        elif kind in ("notice", "update", "cleared"):
            _note_notice(notices, record.get("notice"), at, kind, len(runs) - 1)
        elif kind == "report":
            parsed = _report(record.get("report"), at, len(runs) - 1)
            if parsed is not None:
                reports.append(parsed)
    return runs, notices, reports


def _note_notice(notices: dict[str, Notice], doc: Any, at: datetime, kind: Any, run: int) -> None:
    if (
        not isinstance(doc, Mapping)
        or not isinstance(doc.get("id"), str)
        or not isinstance(doc.get("kind"), str)
    ):
        return
    deadline = _time(doc, "deadline")
    known = notices.get(doc["id"])
    if known is None:
        detected = _time(doc, "detected_at") or at
        known = notices[doc["id"]] = Notice(
            id=doc["id"],
            kind=doc["kind"],
            drill=bool(doc.get("drill")),
            detected_at=detected,
            deadline=deadline,
            cleared_at=None,
            run=run,
        )
    elif deadline is not None:
        known.deadline = deadline
    if kind == "cleared":
        known.cleared_at = _time(doc, "cleared_at") or at
    elif kind == "notice":
        known.cleared_at = None


def _report(doc: Any, at: datetime, run: int) -> Report | None:
    if not isinstance(doc, Mapping) or doc.get("kind", "checkpoint") != "checkpoint":
        return None
    phase = doc.get("phase")
    if phase not in ("started", "finished", "failed"):
        return None
    duration = doc.get("duration_s")
    if isinstance(duration, bool) or not isinstance(duration, (int, float)) or not math.isfinite(duration):
        duration = None
    client = doc.get("client") if isinstance(doc.get("client"), Mapping) else {}
    assert isinstance(client, Mapping)
    job = client.get("job") or client.get("name") or client.get("host") or doc.get("peer_pid") or ""
    step = doc.get("step")
    flush = doc.get("flush") if isinstance(doc.get("flush"), Mapping) else {}
    assert isinstance(flush, Mapping)
    return Report(
        time=_time(doc, "received_at") or at,
        phase=str(phase),
        duration_s=float(duration) if duration is not None and duration >= 0 else None,
        emergency=bool(doc.get("emergency")),
        notice_id=doc.get("notice_id") if isinstance(doc.get("notice_id"), str) else None,
        step=step if isinstance(step, int) and not isinstance(step, bool) else None,
        job=str(job),
        run=run,
        snapshot=flush.get("tier") == "snapshot",
        complete_s=_seconds(flush.get("complete_s")),
    )


def _seconds(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value) if value >= 0 else None


def merge_checkpoints(reports: Sequence[Report]) -> list[Checkpoint]:
    """Finished checkpoints, one per (job, step, kind): every rank reports the same checkpoint."""
    groups: dict[tuple[Any, ...], list[Report]] = {}
    for index, report in enumerate(reports):
        if report.phase != "finished" or report.duration_s is None:
            continue
        key: tuple[Any, ...] = (
            (report.job, report.step, report.emergency, report.notice_id, report.snapshot)
            if report.step is not None
            else (index,)
        )
        groups.setdefault(key, []).append(report)
    result = [
        Checkpoint(
            job=group[0].job,
            step=group[0].step,
            finished_at=max(r.time for r in group),
            duration_s=max(r.duration_s or 0.0 for r in group),
            emergency=group[0].emergency,
            notice_id=group[0].notice_id,
            reports=len(group),
            snapshot=group[0].snapshot,
            complete_s=max((r.complete_s for r in group if r.complete_s is not None), default=None),
        )
        for group in groups.values()
    ]
    result.sort(key=lambda c: c.finished_at)
    return result


@dataclass(frozen=True)
class Timeline:
    """The agent's runs with where each ended, the first checkpoint report of each, and ``now``."""

    runs: Sequence[Run]
    ends: Sequence[datetime]
    first_reports: Mapping[int, datetime]  # run index -> time of its first checkpoint report
    now: datetime

    @property
    def exposure_s(self) -> float:
        """Seconds the agent ran, over all runs."""
        return sum(
            max(0.0, (end - run.start).total_seconds()) for run, end in zip(self.runs, self.ends, strict=True)
        )

    def end_of(self, run: int) -> datetime:
        return self.ends[run] if run < len(self.ends) else self.now

    def still_running(self, run: int) -> bool:
        """Whether ``run`` is the current run and has not stopped."""
        return run == len(self.runs) - 1 and self.runs[-1].stopped is None


def timeline(runs: Sequence[Run], reports: Sequence[Report], now: datetime) -> Timeline:
    # Where each run ended: its stop record, else its last record when a later run started (an unclean stop:
    # the advisor's periodic record bounds what this hides), else now for the current run.
    ends: list[datetime] = []
    for i, run in enumerate(runs):
        if run.stopped is not None:
            ends.append(run.stopped)
        elif i + 1 < len(runs):
            ends.append(run.last)
        else:
            ends.append(max(now, run.last))
    first: dict[int, datetime] = {}
    for r in reports:
        if r.run not in first or r.time < first[r.run]:
            first[r.run] = r.time
    return Timeline(runs=runs, ends=ends, first_reports=first, now=now)
