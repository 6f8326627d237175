"""What peer snapshots cost and saved a job on this host (docs/snapshots.md): its snapshot reports (a
``checkpoint`` report with ``flush.tier`` "snapshot": taken, failed, their stall, the time until committed,
the bytes) and, for each unannounced interruption the ledger finds (agent/ledger/tally.py), the work the job
redid from the newest checkpoint it had at the stop, a snapshot maybe, against what it would have redone from
the newest checkpoint but snapshots. Pure and standard library only; docs/ledger.md, "Snapshots", says how
each figure is counted."""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from agent.ledger.tally import (
    HOUR,
    Checkpoint,
    Rules,
    Timeline,
    announced,
    base,
    is_snapshot,
    redone,
    rounded,
    stop_of,
    unannounced,
)


@dataclass(frozen=True)
class Snapshots:
    """One job's peer snapshots on this host (or their sum over jobs: ``+``; the intervals and the time
    until committed are then those of every job's snapshots together)."""

    taken: int = 0  # finished: committed on the peers, one per step and generation
    failed: int = 0  # steps whose snapshot failed (and none of the same step finished)
    stall_gpu_s: float = 0.0  # the stalls (the slowest rank's duration_s) x the job's GPUs
    bytes: int = 0  # the bytes the finished snapshots' reports said
    bytes_reported: int = 0  # finished snapshots that said their bytes
    complete_s: tuple[float, ...] = ()  # each finished snapshot's time until committed (the slowest rank's)
    gaps: tuple[tuple[int, float], ...] = ()  # (steps, seconds) between consecutive snapshots, one generation
    durable_gaps: tuple[tuple[int, float], ...] = ()  # likewise between periodic non-snapshot checkpoints
    interruptions: int = 0  # the job's unannounced interruptions (counted only for a job that took snapshots)
    resumed_from_snapshot: int = 0  # those the job came back from a snapshot after (tally.base)
    saved_steps: int = 0  # steps durable-only would have added, where both step counts are known
    saved_gpu_s: float = 0.0  # GPU-seconds durable-only would have added

    def __add__(self, other: Snapshots) -> Snapshots:
        return Snapshots(
            taken=self.taken + other.taken,
            failed=self.failed + other.failed,
            stall_gpu_s=self.stall_gpu_s + other.stall_gpu_s,
            bytes=self.bytes + other.bytes,
            bytes_reported=self.bytes_reported + other.bytes_reported,
            complete_s=self.complete_s + other.complete_s,
            gaps=self.gaps + other.gaps,
            durable_gaps=self.durable_gaps + other.durable_gaps,
            interruptions=self.interruptions + other.interruptions,
            resumed_from_snapshot=self.resumed_from_snapshot + other.resumed_from_snapshot,
            saved_steps=self.saved_steps + other.saved_steps,
            saved_gpu_s=self.saved_gpu_s + other.saved_gpu_s,
        )


def _gaps(checkpoints: Sequence[Checkpoint]) -> tuple[tuple[int, float], ...]:
    """(steps, seconds) between consecutive checkpoints of one generation, by end (those with a step)."""
    found: list[tuple[int, float]] = []
    for before, after in itertools.pairwise(checkpoints):
        if before.generation == after.generation and before.step is not None and after.step is not None:
            found.append((after.step - before.step, after.end - before.end))
    return tuple(found)


def _failed(tl: Timeline) -> int:
    """Steps (per generation) whose snapshot was reported failed and not finished."""
    done = {(c.generation, c.step) for c in tl.checkpoints if c.snapshot}
    failed = {
        (gen.index, r.step)
        for gen in tl.generations
        for r in gen.reports
        if r.kind == "checkpoint" and r.phase == "failed" and is_snapshot(r)
    }
    return len(failed - done)


def _bytes(tl: Timeline) -> tuple[int, int]:
    """The bytes the finished snapshots' reports said, and how many snapshots said any."""
    said: dict[tuple[int, int | None], int] = {}
    for gen in tl.generations:
        for r in gen.reports:
            if r.kind == "checkpoint" and r.phase == "finished" and is_snapshot(r) and r.bytes is not None:
                key = (gen.index, r.step)
                said[key] = said.get(key, 0) + r.bytes
    return sum(said.values()), len(said)


def _saved(tl: Timeline, rules: Rules) -> Snapshots:
    """Each unannounced interruption: the steps and GPU-seconds redone from the checkpoint the job came back
    from (:func:`base`: a snapshot maybe) against from the one it had but snapshots."""
    said = announced(tl, rules)
    events = unannounced(tl, {e.generation for e in said if e.resume is not None})
    resumed = steps = 0
    gpu_s = 0.0
    for event in events:
        stop = stop_of(tl, event)
        newest = base(tl, event, stop)
        if newest is None or not newest.snapshot:
            continue
        resumed += 1
        had = redone(tl, event, stop, newest)
        durable = redone(tl, event, stop, base(tl, event, stop, snapshots=False))
        gpu_s += (durable.redone_s - had.redone_s) * tl.gpus
        if had.steps_redone is not None and durable.steps_redone is not None:
            steps += durable.steps_redone - had.steps_redone
    return Snapshots(
        interruptions=len(events), resumed_from_snapshot=resumed, saved_steps=steps, saved_gpu_s=gpu_s
    )


def snapshots(tl: Timeline, rules: Rules) -> Snapshots:
    """The job's peer snapshots on this host and what they saved; nothing for a job that reported none."""
    taken = [c for c in tl.checkpoints if c.snapshot]
    failed = _failed(tl)
    if not taken and not failed:
        return Snapshots()
    durable = [c for c in tl.checkpoints if not c.snapshot and not c.emergency]
    written, said = _bytes(tl)
    by_generation = sorted(taken, key=lambda c: (c.generation, c.end))
    return _saved(tl, rules) + Snapshots(
        taken=len(taken),
        failed=failed,
        stall_gpu_s=sum(c.duration_s for c in taken) * tl.gpus,
        bytes=written,
        bytes_reported=said,
        complete_s=tuple(c.complete_s for c in taken if c.complete_s is not None),
        gaps=_gaps(by_generation),
        durable_gaps=_gaps(sorted(durable, key=lambda c: (c.generation, c.end))),
    )


def _interval(gaps: Sequence[tuple[int, float]]) -> dict[str, Any]:
    return {
        "steps": rounded(statistics.fmean(g[0] for g in gaps), 1) if gaps else None,
        "seconds": rounded(statistics.fmean(g[1] for g in gaps)) if gaps else None,
        "pairs": len(gaps),
    }


def snapshot_figures(s: Snapshots) -> dict[str, Any]:
    """The ``snapshots`` object of a job's (or the total's) ``--json`` figures (docs/ledger.md: each key)."""
    return {
        "taken": s.taken,
        "failed": s.failed,
        "stall_gpu_hours": rounded(s.stall_gpu_s / HOUR, 6),
        "complete_s_median": rounded(statistics.median(s.complete_s)) if s.complete_s else None,
        "bytes": s.bytes if s.bytes_reported else None,
        "bytes_reported": s.bytes_reported,
        "interval": _interval(s.gaps),
        "durable_interval": _interval(s.durable_gaps),
        "interruptions": s.interruptions,
        "resumed_from_snapshot": s.resumed_from_snapshot,
        "saved_steps": s.saved_steps,
        "saved_gpu_hours": rounded(s.saved_gpu_s / HOUR, 6),
    }
