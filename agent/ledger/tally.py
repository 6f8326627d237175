"""Counting one job's interruptions, flushes, resumes and hours from its reports and the notices: the
arithmetic under ``preemptd report``, the ``preemptd_ledger_*`` metrics and the ``goodput`` status section
(agent/ledger/report.py turns it into the document and the money). Pure and standard library only;
docs/ledger.md says how each figure is counted.

The facts of a job are first frozen into a :class:`Timeline` (its generations of processes, its checkpoints,
the notices that may concern it); small functions read it: :func:`announced` and :func:`unannounced` find the
interruptions, :func:`cost` prices one, :func:`tally` adds them up, and :func:`goodput` is the one goodput
every reader of the ledger shows.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass, fields, replace
from datetime import datetime, timezone
from typing import Any

from agent.ledger.facts import NoticeFact, ReportFact

# Reports are stamped on arrival: a flush that finished this close after the deadline was still in time.
DEADLINE_SLACK_S = 1.0
# A flush that names no notice belongs to the notice it came in the window of, or up to this long after.
LATE_LIMIT_S = 600.0
HOUR = 3600.0
IN_TIME, LATE, LOST = "in_time", "late", "lost"
SNAPSHOT = "snapshot"  # the flush tier of a peer snapshot's report


@dataclass(frozen=True)
class Rules:
    interrupting_kinds: tuple[str, ...] = ("termination", "maintenance")
    active_s: float = 86400.0
    drills: bool = False  # count drill notices as interruptions (a rehearsal costs a flush and a restart too)


# ----- the timeline: one job's facts, frozen ------------------------------------------------------------


@dataclass(frozen=True)
class Generation:
    """The job's processes between two resumes (``index`` 0 is the first); its reports, oldest first."""

    index: int
    start: float
    last: float
    reports: tuple[ReportFact, ...]


@dataclass(frozen=True)
class Checkpoint:
    """A finished checkpoint of one generation, one per step and kind (a peer snapshot and a durable save of
    the same step are two): ranks block for the slowest (its duration) and each writes its share (the bytes
    add up). A snapshot is finished when committed on the peers, ``complete_s`` (the slowest rank's) after
    it started."""

    generation: int
    step: int | None
    emergency: bool
    end: float
    duration_s: float
    bytes: int
    saves: int  # ranks that reported it finished
    snapshot: bool = False  # a peer snapshot (``flush.tier`` "snapshot"), docs/snapshots.md
    complete_s: float | None = None

    @property
    def state_at(self) -> float:
        """When the work it keeps was done: its end; a snapshot's state is the step it staged, so the end of
        its stall (start + duration), the work done while it was copied to the peers is not in it."""
        if self.snapshot and self.complete_s is not None:
            return min(self.end, self.end - self.complete_s + self.duration_s)
        return self.end


@dataclass(frozen=True)
class Timeline:
    job: str
    gpus: int
    first: float  # the first report, or the start of the first checkpoint when that is earlier
    last: float
    generations: tuple[Generation, ...]
    checkpoints: tuple[Checkpoint, ...]  # by end
    notices: tuple[NoticeFact, ...]  # of the interrupting kinds
    now: float


@dataclass(frozen=True)
class Flush:
    """A notice's emergency checkpoint: the saves of the one generation the notice found."""

    notice: NoticeFact
    generation: int
    reports: tuple[ReportFact, ...]  # finished and failed

    @property
    def finished(self) -> tuple[ReportFact, ...]:
        """The ranks' finished saves of its newest finished step (a retry is not added to the first try)."""
        done = [r for r in self.reports if r.phase == "finished"]
        return tuple(r for r in done if r.step == done[-1].step) if done else ()

    @property
    def end(self) -> float | None:
        return max((r.time for r in self.finished), default=None)

    @property
    def step(self) -> int | None:
        return self.finished[0].step if self.finished else None

    @property
    def outcome(self) -> str:
        end, deadline = self.end, self.notice.deadline
        if end is None:
            return LOST
        return IN_TIME if deadline is None or end <= deadline + DEADLINE_SLACK_S else LATE

    @property
    def fallback_step(self) -> int | None:
        return next((r.fallback_step for r in self.reports if r.fallback_step is not None), None)


@dataclass(frozen=True)
class Interruption:
    """The end of one generation (``generation``): with the notice that announced it, or none."""

    generation: int
    notice: NoticeFact | None
    flush: Flush | None
    resume: float | None  # when the job came back on this host (the next generation's start)
    counted: bool  # drills count only when Rules.drills
    outlived: bool = False  # the generation kept working after the deadline: it lost nothing


@dataclass(frozen=True)
class Cost:
    """What one interruption cost; ``stop``: when it stopped the job's work."""

    stop: float
    redone_s: float
    restart_s: float
    from_step: int | None
    steps_redone: int | None


def _rank_key(report: ReportFact) -> int:
    return report.rank if report.rank is not None else -1


def _gpus(reports: Sequence[ReportFact]) -> int:
    """The job's GPUs on this host: each rank's latest ``gpus``, one for a rank that does not say. A process
    counts under the rank it first reported: an elastic job that re-forms renumbers its ranks in the same
    processes (agent/client/elastic.py), which adds no GPU."""
    per_rank: dict[int, int] = {}
    first_rank: dict[int, int] = {}  # pid -> the rank it first reported
    for report in reports:
        rank = _rank_key(report)
        if report.pid is not None:
            rank = first_rank.setdefault(report.pid, rank)
        if report.gpus is not None and report.gpus > 0:
            per_rank[rank] = report.gpus
        else:
            per_rank.setdefault(rank, 1)
    return sum(per_rank.values())


def _generations(reports: Sequence[ReportFact]) -> tuple[Generation, ...]:
    """A new process for a rank that already has one in the current generation starts the next generation
    (the other ranks' new processes join it). A process stays in its generation (its late reports start
    nothing); a report without a process belongs to the current one."""
    members: list[list[ReportFact]] = [[]]
    owner: dict[int, int] = {}  # pid -> generation
    current: dict[int, int] = {}  # rank -> pid, in the newest generation
    for report in reports:
        pid = report.pid
        if pid is not None and pid not in owner:
            if _rank_key(report) in current:
                members.append([])
                current = {}
            current[_rank_key(report)] = pid
            owner[pid] = len(members) - 1
        members[owner[pid] if pid is not None else -1].append(report)
    return tuple(
        Generation(index, rows[0].time, rows[-1].time, tuple(rows))
        for index, rows in enumerate(members)
        if rows
    )


def is_snapshot(report: ReportFact) -> bool:
    """A peer snapshot's report (agent/client/peer/snapshot.py): ``flush.tier`` "snapshot"."""
    return report.tier == SNAPSHOT and not report.emergency


def _checkpoints(generations: Sequence[Generation]) -> tuple[Checkpoint, ...]:
    found: list[Checkpoint] = []
    for gen in generations:
        groups: dict[Any, list[ReportFact]] = {}
        for index, r in enumerate(gen.reports):
            if r.kind == "checkpoint" and r.phase == "finished":
                key = (r.step, r.emergency, is_snapshot(r)) if r.step is not None else index
                groups.setdefault(key, []).append(r)
        found += [
            Checkpoint(
                gen.index,
                rows[0].step,
                rows[0].emergency,
                max(r.time for r in rows),
                max(r.duration_s or 0.0 for r in rows),
                sum(r.bytes or 0 for r in rows),
                len(rows),
                is_snapshot(rows[0]),
                max((r.complete_s for r in rows if r.complete_s is not None), default=None),
            )
            for rows in groups.values()
        ]
    return tuple(sorted(found, key=lambda c: c.end))


def timeline(
    job: str, reports: Sequence[ReportFact], notices: Sequence[NoticeFact], now: float, rules: Rules
) -> Timeline:
    """One job's facts, frozen: ``reports`` (the job's, oldest first) and every notice."""
    generations = _generations(reports)
    checkpoints = _checkpoints(generations)
    times = [r.time for r in reports]
    first = min(times[:1] + [c.end - c.duration_s for c in checkpoints], default=now)
    kinds = set(rules.interrupting_kinds)
    relevant = tuple(n for n in notices if n.kind in kinds)
    return Timeline(
        job, _gpus(reports), first, max(times, default=now), generations, checkpoints, relevant, now
    )


# ----- which interruptions: announced, unannounced --------------------------------------------------------


def _found(tl: Timeline, notice: NoticeFact) -> Generation | None:
    """The generation the notice found: the newest one started when it came (the first one, when the job
    started between the notice and its deadline)."""
    starts = [g.start for g in tl.generations]
    index = bisect.bisect_right(starts, notice.detected_at + DEADLINE_SLACK_S)
    if index:
        return tl.generations[index - 1]
    deadline = notice.deadline
    if tl.generations and deadline is not None and starts[0] <= deadline + DEADLINE_SLACK_S:
        return tl.generations[0]
    return None


def flush_of(notice: NoticeFact, gen: Generation) -> Flush:
    """The saves of ``gen`` that name the notice; when none does, its saves naming no notice from the notice
    to LATE_LIMIT_S after its deadline. Never another generation's saves."""
    saves = [
        r for r in gen.reports if r.kind == "checkpoint" and r.emergency and r.phase in ("finished", "failed")
    ]
    named = tuple(r for r in saves if r.notice_id == notice.id)
    if named:
        return Flush(notice, gen.index, named)
    limit = (notice.deadline if notice.deadline is not None else math.inf) + LATE_LIMIT_S
    unnamed = (r for r in saves if r.notice_id is None and notice.detected_at <= r.time <= limit)
    return Flush(notice, gen.index, tuple(unnamed))


def _outlived(gen: Generation, notice: NoticeFact) -> bool:
    """The generation kept working after the deadline (a report other than an emergency save came later)."""
    if notice.deadline is None:
        return False
    after = notice.deadline + DEADLINE_SLACK_S
    return any(r.time > after and not r.emergency for r in gen.reports)


def _explains(tl: Timeline, flush: Flush, gen: Generation, resume: float) -> bool:
    """Whether the notice ended ``gen``, whose processes came back at ``resume``: the generation's last save
    was the notice's flush (finished or failed: what the resume loads) whatever the order of resume and
    deadline, or the notice was up while the job was down (a flush lost with the host)."""
    notice = flush.notice
    if _outlived(gen, notice):
        return False
    newest = max((c.end for c in tl.checkpoints if c.generation == gen.index), default=-math.inf)
    if flush.reports and newest <= max(r.time for r in flush.reports) + DEADLINE_SLACK_S:
        return True
    slack = DEADLINE_SLACK_S
    return (
        notice.deadline is not None
        and notice.detected_at <= resume + slack
        and gen.last <= notice.deadline + slack
        and (notice.cleared_at is None or gen.last <= notice.cleared_at + slack)
    )


def _took_host(tl: Timeline, notice: NoticeFact, gen: Generation, rules: Rules) -> bool:
    """The notice reached its deadline, not withdrawn before it, while ``gen`` was here (it reported within
    ``active_s`` before the deadline)."""
    deadline = notice.deadline
    if deadline is None or deadline > tl.now:
        return False
    if notice.cleared_at is not None and notice.cleared_at < deadline - DEADLINE_SLACK_S:
        return False
    seen = [r.time for r in gen.reports if r.time <= deadline + DEADLINE_SLACK_S]
    return bool(seen) and deadline - seen[-1] <= rules.active_s


def _announced_by(tl: Timeline, notice: NoticeFact, rules: Rules) -> Interruption | None:
    """The interruption a notice announced for this job, if any."""
    gen = _found(tl, notice)
    if gen is None:
        return None
    flush = flush_of(notice, gen)
    counted = rules.drills or not notice.drill
    following = tl.generations[gen.index + 1 :]
    if following and _explains(tl, flush, gen, following[0].start):
        return Interruption(gen.index, notice, flush, following[0].start, counted)
    if not _took_host(tl, notice, gen, rules):
        return None
    return Interruption(gen.index, notice, flush, None, counted, _outlived(gen, notice))


def announced(tl: Timeline, rules: Rules) -> tuple[Interruption, ...]:
    """The interruptions notices announced, drills included (see ``counted``). A generation ends once: of
    several notices ending it, the one whose flush finished is its cause (else the earliest deadline)."""
    found = [i for n in tl.notices if (i := _announced_by(tl, n, rules)) is not None]

    def rank(i: Interruption) -> tuple[bool, float]:
        assert i.notice is not None and i.flush is not None
        return (i.flush.end is None, i.notice.deadline if i.notice.deadline is not None else math.inf)

    kept: dict[tuple[int, str | None], Interruption] = {}
    for event in sorted(found, key=rank):
        assert event.notice is not None
        kept.setdefault((event.generation, event.notice.id if event.outlived else None), event)
    return tuple(sorted(kept.values(), key=lambda i: (i.generation, i.resume is None)))


def unannounced(tl: Timeline, explained: Collection[int]) -> tuple[Interruption, ...]:
    """A resume that no notice explains (``explained``: the generations notices ended): the job's processes
    died and came back on this host."""
    return tuple(
        Interruption(gen.index, None, None, tl.generations[gen.index + 1].start, True)
        for gen in tl.generations[:-1]
        if gen.index not in explained
    )


# ----- what they cost -------------------------------------------------------------------------------------


def stop_of(tl: Timeline, event: Interruption) -> float:
    """When the interruption stopped the job's work: the end of its flush; for a lost flush the deadline or
    the resume, whichever came first; for an unannounced one the resume (so its redone time includes the
    restart: an upper bound)."""
    if event.flush is not None and event.flush.end is not None:
        return event.flush.end
    notice = event.notice
    ends = [t for t in (notice.deadline if notice else None, event.resume) if t is not None]
    return min(ends, default=tl.generations[event.generation].last)


def base(tl: Timeline, event: Interruption, stop: float, snapshots: bool = True) -> Checkpoint | None:
    """The checkpoint the job came back from: of those its generation (or an earlier one) finished by the
    stop, of any kind, the one whose state is newest (of two as new, the later finished); ``snapshots``
    False: of those but peer snapshots (what it had without them)."""
    done = [
        c
        for c in tl.checkpoints
        if c.generation <= event.generation
        and c.end <= stop + DEADLINE_SLACK_S
        and (snapshots or not c.snapshot)
    ]
    return max(reversed(done), key=lambda c: c.state_at, default=None)


def redone(tl: Timeline, event: Interruption, stop: float, since: Checkpoint | None) -> Cost:
    """The work of ``event``'s generation done again when the job came back from ``since``: the time from
    the state it keeps (no further back than the generation's start) to the stop, and the steps from its
    step (a failed flush's ``fallback_step`` instead) to the highest the generation reported by the stop."""
    gen = tl.generations[event.generation]
    # Work before this generation started was counted with the interruption that ended the one before.
    start = max(since.state_at if since is not None else tl.first, gen.start if gen.index else tl.first)
    from_step = since.step if since is not None else None
    if event.flush is not None and event.flush.fallback_step is not None:
        from_step = event.flush.fallback_step
    steps = [r.step for r in gen.reports if r.step is not None and r.time <= stop + DEADLINE_SLACK_S]
    redone_steps = max(0, max(steps) - from_step) if steps and from_step is not None else None
    return Cost(stop, max(0.0, stop - start), 0.0, from_step, redone_steps)


def cost(tl: Timeline, event: Interruption) -> Cost:
    """Redone work and restart of one interruption (docs/ledger.md, "How the report counts")."""
    stop = stop_of(tl, event)
    restart = max(0.0, event.resume - stop) if event.resume is not None and event.notice else 0.0
    if event.outlived:
        return Cost(stop, 0.0, 0.0, None, 0)
    if event.flush is not None and event.flush.end is not None:
        return Cost(stop, 0.0, restart, event.flush.step, 0)
    return replace(redone(tl, event, stop, base(tl, event, stop)), restart_s=restart)


# ----- the figures ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tally:
    """One job's figures (or their sum over jobs: ``+``)."""

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
    flushes: tuple[dict[str, Any], ...] = ()
    resumes: tuple[dict[str, Any], ...] = ()

    def __add__(self, other: Tally) -> Tally:
        return Tally(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    @property
    def lost_gpu_hours(self) -> float:
        """What checkpointing and preemption cost: periodic checkpoints, flushes, redone work, restarts."""
        return (
            self.checkpoint_gpu_hours + self.flush_gpu_hours + self.redone_gpu_hours + self.restart_gpu_hours
        )

    @property
    def useful_gpu_hours(self) -> float:
        # Clients whose reported durations overlap (longer than the time between their reports) could make
        # it negative: 0 then.
        return max(0.0, self.gpu_hours - self.lost_gpu_hours)


def goodput(t: Tally) -> float | None:
    """The goodput: the useful share of the job's GPU-hours, 1 - (checkpointing + flushing + redone +
    restart) / GPU-hours, None without GPU-hours. The report, the metrics and the status all show this."""
    return t.useful_gpu_hours / t.gpu_hours if t.gpu_hours > 0 else None


def _flush_doc(tl: Timeline, flush: Flush) -> dict[str, Any]:
    finished, deadline, end = flush.finished, flush.notice.deadline, flush.end
    tiers = sorted({r.tier for r in flush.reports if r.tier})
    return {
        "job": tl.job,
        "notice_id": flush.notice.id,
        "outcome": flush.outcome,
        "step": flush.step,
        "tier": ",".join(tiers) or None,
        "duration_s": rounded(max(r.duration_s or 0.0 for r in finished)) if finished else None,
        "bytes": sum(r.bytes or 0 for r in finished) if finished else None,
        "slack_s": rounded(deadline - end) if end is not None and deadline is not None else None,
        "fallback_step": flush.fallback_step,
    }


def _resume_doc(tl: Timeline, event: Interruption, paid: Cost) -> dict[str, Any]:
    assert event.resume is not None
    return {
        "job": tl.job,
        "time": iso(event.resume),
        "from_step": paid.from_step,
        "steps_redone": paid.steps_redone,
        "announced": event.notice is not None,
        "notice_id": event.notice.id if event.notice is not None else None,
        "drill": event.notice.drill if event.notice is not None else False,
    }


def _uncounted_flushes(events: Sequence[Interruption]) -> set[tuple[int, int | None]]:
    """(generation, step) of the flushes of drills not counted: their GPU time is not counted either."""
    return {
        (e.flush.generation, e.flush.step)
        for e in events
        if not e.counted and e.flush is not None and e.flush.end is not None
    }


def _checkpoint_figures(tl: Timeline, skip: Collection[tuple[int, int | None]]) -> Tally:
    periodic = [c for c in tl.checkpoints if not c.emergency]
    flushes = [c for c in tl.checkpoints if c.emergency and (c.generation, c.step) not in skip]
    # A peer snapshot stalls training like a checkpoint, but it lives in the hosts' RAM: no storage, no requests.
    stored = [c for c in tl.checkpoints if not c.snapshot]
    return Tally(
        checkpoints=len(periodic),
        saves=sum(c.saves for c in stored),
        checkpoint_bytes=sum(c.bytes for c in stored),
        periodic_bytes=sum(c.bytes for c in periodic if not c.snapshot),
        checkpoint_gpu_hours=sum(c.duration_s for c in periodic) * tl.gpus / HOUR,
        flush_gpu_hours=sum(c.duration_s for c in flushes) * tl.gpus / HOUR,
    )


def tally(tl: Timeline, rules: Rules) -> Tally:
    """The job's figures: its interruptions (drills only when ``rules.drills``), their cost, its hours."""
    said = announced(tl, rules)
    explained = {e.generation for e in said if e.resume is not None}
    events = sorted(said + unannounced(tl, explained), key=lambda e: (e.generation, e.resume is None))
    priced = [(e, cost(tl, e)) for e in events]
    counted = [(e, paid) for e, paid in priced if e.counted]
    flushes = [e.flush for e, _ in counted if e.flush is not None]
    end = max([tl.last] + [paid.stop for _, paid in counted])
    job_hours = (end - tl.first) / HOUR if tl.generations else 0.0
    return _checkpoint_figures(tl, _uncounted_flushes(events)) + Tally(
        jobs=1,
        gpus=tl.gpus,
        job_hours=job_hours,
        gpu_hours=job_hours * tl.gpus,
        announced=sum(1 for e, _ in counted if e.notice is not None),
        unannounced=sum(1 for e, _ in counted if e.notice is None),
        in_time=sum(1 for f in flushes if f.outcome == IN_TIME),
        late=sum(1 for f in flushes if f.outcome == LATE),
        lost=sum(1 for f in flushes if f.outcome == LOST),
        redone_gpu_hours=sum(paid.redone_s for _, paid in counted) * tl.gpus / HOUR,
        restart_gpu_hours=sum(paid.restart_s for _, paid in counted) * tl.gpus / HOUR,
        steps_redone=sum(paid.steps_redone or 0 for _, paid in counted),
        flushes=tuple(_flush_doc(tl, f) for f in flushes),
        resumes=tuple(_resume_doc(tl, e, paid) for e, paid in priced if e.resume is not None),
    )


def tally_job(
    job: str, reports: Sequence[ReportFact], notices: Sequence[NoticeFact], now: float, rules: Rules
) -> Tally:
    """Interruptions, flushes, resumes and hours of one job (``reports`` oldest first)."""
    return tally(timeline(job, reports, notices, now, rules), rules)


def iso(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, timezone.utc).isoformat().replace("+00:00", "Z")


def rounded(value: float | None, digits: int = 3) -> float | None:
    if value is None or not math.isfinite(value):
        return None
    return round(value, digits)
