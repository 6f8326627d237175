"""The advisor's rules of what counts as lost work, one notice or one restart at a time (docs/advisor.md).

A loss is a GPU fault; an interrupting notice (termination, maintenance) that reached its deadline while a
training client was reporting and no emergency checkpoint finished before the deadline; a restart after an
unclean stop that no such notice explains. Drills never count. Announced interruptions whose flush finished
are counted apart: they cost a flush and a restart, not lost work. Pure: callers pass the parsed history.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from agent.advisor.history import Checkpoint, Notice, Timeline

GPU_FAULT = "gpu_fault"
UNCOVERED_NOTICE = "uncovered_notice"
UNCLEAN_RESTART = "unclean_restart"
LOSS_CAUSES = (GPU_FAULT, UNCOVERED_NOTICE, UNCLEAN_RESTART)
# Tolerance on "the flush finished before the deadline": reports are stamped on arrival.
DEADLINE_SLACK = timedelta(seconds=1)


@dataclass(frozen=True)
class Loss:
    time: datetime
    cause: str
    notice_id: str | None = None


class Outcome(enum.Enum):
    """What one notice counts as."""

    DRILL = "drill"
    PENDING = "pending"  # its deadline is still ahead
    LOST = "lost"
    ANNOUNCED = "announced"  # it took the host, but no work was lost
    NONE = "none"  # not an interruption, or withdrawn in time


@dataclass
class Tally:
    """The notices' outcomes, in the order of the notices."""

    losses: list[Loss] = field(default_factory=list)
    announced: list[str] = field(default_factory=list)
    drills: int = 0
    pending: int = 0


def tally(
    notices: Iterable[Notice],
    timeline: Timeline,
    emergency: Sequence[Checkpoint],
    interrupting: Collection[str],
) -> Tally:
    """Judge every notice (:func:`judge`) and count the outcomes."""
    counted = Tally()
    for notice in notices:
        outcome, loss = judge(notice, timeline, emergency, interrupting)
        if outcome is Outcome.DRILL:
            counted.drills += 1
        elif outcome is Outcome.PENDING:
            counted.pending += 1
        elif outcome is Outcome.ANNOUNCED:
            counted.announced.append(notice.id)
        elif loss is not None:
            counted.losses.append(loss)
    return counted


def judge(
    notice: Notice, timeline: Timeline, emergency: Sequence[Checkpoint], interrupting: Collection[str]
) -> tuple[Outcome, Loss | None]:
    """What one notice counts as, with its loss when it lost work."""
    if notice.drill:
        return Outcome.DRILL, None
    if notice.kind == GPU_FAULT:
        return Outcome.LOST, Loss(notice.detected_at, GPU_FAULT, notice.id)
    if notice.kind not in interrupting:
        return Outcome.NONE, None
    if notice.deadline is not None and notice.deadline > timeline.now:
        return Outcome.PENDING, None
    due = _due(notice, timeline)
    if due is None:
        return Outcome.NONE, None
    if _covered(notice, due, emergency):
        return Outcome.ANNOUNCED, None
    first_report = timeline.first_reports.get(notice.run)
    if first_report is not None and first_report <= due:
        return Outcome.LOST, Loss(due, UNCOVERED_NOTICE, notice.id)
    return Outcome.ANNOUNCED, None  # no training client was reporting: nothing to lose, nothing to flush


def _due(notice: Notice, timeline: Timeline) -> datetime | None:
    """When an interrupting notice whose deadline has passed took the host; None when it did not."""
    if notice.deadline is not None:
        if notice.cleared_at is not None and notice.cleared_at < notice.deadline - DEADLINE_SLACK:
            return None  # withdrawn before it took the host
        return notice.deadline
    if notice.cleared_at is not None or timeline.still_running(notice.run):
        return None  # no deadline: it happened only if the agent went down with it active
    return timeline.end_of(notice.run)


def _covered(notice: Notice, due: datetime, emergency: Sequence[Checkpoint]) -> bool:
    for checkpoint in emergency:
        if checkpoint.finished_at > due + DEADLINE_SLACK:
            continue
        if checkpoint.notice_id == notice.id:
            return True
        if checkpoint.notice_id is None and checkpoint.finished_at >= notice.detected_at:
            return True
    return False


def unclean_restarts(
    notices: Collection[Notice], timeline: Timeline, interrupting: Collection[str]
) -> list[Loss]:
    """A loss at the end of each run that stopped uncleanly with no active fault or interruption to explain it."""
    losses: list[Loss] = []
    runs, ends = timeline.runs, timeline.ends
    for i in range(1, len(runs)):
        if runs[i].previous_clean is not False:
            continue
        explained = any(
            not n.drill
            and n.run == i - 1
            and (n.kind == GPU_FAULT or n.kind in interrupting)
            and (n.cleared_at is None or n.cleared_at >= ends[i - 1])
            for n in notices
        )
        if not explained:
            losses.append(Loss(ends[i - 1], UNCLEAN_RESTART))
    return losses


def coalesce(losses: Sequence[Loss], window_s: float) -> list[Loss]:
    """``losses`` (sorted by time) less those within ``window_s`` of the last one kept: one event, one loss."""
    kept: list[Loss] = []
    for loss in losses:
        if kept and window_s > 0 and (loss.time - kept[-1].time).total_seconds() <= window_s:
            continue
        kept.append(loss)
    return kept
