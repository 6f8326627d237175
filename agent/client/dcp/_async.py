"""Background saves of a sharded store and the deadline budget: ``dcp.async_save`` with at most one save in
flight, committed on a thread when its write ends; the rule for a notice that arrives while one is in
flight; and the duration a save is predicted to take, against the time left before the deadline.
Part of :mod:`agent.client.dcp`; import from there.
"""

from __future__ import annotations

import logging
import math
import shutil
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.state_dict_saver import async_save as dcp_async_save

from agent.client.background import InFlight, OneInFlight
from agent.client.dcp._commit import Commit, Ranks, ShardedCheckpoint
from agent.client.dcp._state import layout
from agent.client.preempted import record_emergency
from agent.client.store import Checkpoint, CheckpointError, CheckpointStore
from agent.client.store_failure import convertible, free_bytes

_log = logging.getLogger("agent.client.dcp")

# The store's hooks: report a phase; commit a written directory (group, directory, what, checksum now);
# finish a committed save (checkpoint, blocked_s, total_s, flush report) into what the caller gets; turn a
# failure into the CheckpointError every rank raises (exception, step, directory, free bytes at the start,
# the group the save ran on) and remove the directory.
Report = Callable[..., None]
CommitHook = Callable[[Any, Path, Commit, bool], Checkpoint]
FinishHook = Callable[[Checkpoint, float, float, dict[str, Any]], ShardedCheckpoint]
FailHook = Callable[[BaseException, int, Path, "int | None", Any], CheckpointError]


@dataclass(frozen=True)
class Budget:
    """The deadline budget of one save: the duration predicted from earlier saves, the seconds left before
    the notice's deadline, and whether the prediction exceeds them (the save runs all the same)."""

    step: int
    predicted_s: float | None
    time_left_s: float | None
    predicted_miss: bool


@dataclass
class AsyncSave(InFlight):
    """A background save (see :class:`InFlight`): ``result`` is set once committed."""

    result: ShardedCheckpoint | None = None


class DeadlineBudget:
    """Durations of this process's saves, and the prediction each new save is reported with."""

    def __init__(self, local: CheckpointStore, world_size: int) -> None:
        self.local = local
        self.world_size = world_size
        self.last: Budget | None = None
        self.durations: list[float] = []
        # What the tier planner adds to the next save's reports (``fallback``: why the peer tier was not used).
        self.planned: dict[str, Any] = {}

    def predict(self) -> float | None:
        """Seconds a save of this state should take: the slowest of this process's last three saves (the
        whole write, also for background saves); before any, of the newest three committed steps."""
        if self.durations:
            return max(self.durations[-3:])
        found = []
        for step in self.local.steps()[:3]:
            try:
                duration = Checkpoint.load(self.local.path_of(step)).duration_s
            except CheckpointError:
                continue
            if duration is not None:
                found.append(float(duration))
        return max(found) if found else None

    def report(self, step: int, deadline: datetime | None, choice: str | None) -> dict[str, Any]:
        """The ``flush`` fields of a save's reports (the tier: ``durable``, and what the planner added); a
        warning when the save is predicted to miss."""
        predicted = self.predict()
        left = seconds_to(deadline)
        miss = predicted is not None and left is not None and predicted > left
        self.last = Budget(step, predicted, left, miss)
        planned, self.planned = self.planned, {}
        if miss:
            _log.warning(
                "the save of step %s is predicted to take %.1f s with %.1f s left before the deadline: "
                "it runs all the same",
                step,
                predicted,
                left,
            )
        return {
            "sharded": True,
            "world_size": self.world_size,
            "predicted_s": None if predicted is None else round(predicted, 3),
            "time_left_s": None if left is None else round(max(0.0, left), 3),
            "predicted_miss": miss,
            "async": choice,
            "tier": "durable",
            **planned,
        }


class BackgroundSaves(OneInFlight[AsyncSave]):
    """At most one ``dcp.async_save`` in flight for a store, committed through the store's hooks."""

    what = "the background save"

    def __init__(
        self,
        ranks: Ranks,
        root: Path,
        budget: DeadlineBudget,
        *,
        thread_count: int,
        checksum: bool,
        recent_s: float,
        report: Report,
        commit: CommitHook,
        finish: FinishHook,
        fail: FailHook,
    ) -> None:
        self.ranks = ranks
        self.root = root
        self.budget = budget
        self.thread_count = thread_count
        self.checksum = checksum
        self.recent_s = recent_s
        self._report = report
        self._commit = commit
        self._finish = finish
        self._fail = fail
        super().__init__()
        self._writer: FileSystemWriter | None = None

    def start(self, step: int, state: Mapping[str, Any], metadata: Mapping[str, Any] | None) -> AsyncSave:
        """Stage ``state`` and write it in the background (after waiting for the save in flight, if any)."""
        if step < 0:
            raise ValueError(f"step must be non-negative, got {step}")
        self.wait()
        started = time.monotonic()
        flush = self.budget.report(step, None, "background")
        self._report("started", step, flush=flush)
        free_before = free_bytes(self.root)
        run = self.budget.local.run_for(step) if self.ranks.rank == 0 else 0  # rank 0 writes the manifest
        tmp = self.ranks.agree_tmp(self.root)
        what = Commit(step, layout(state), started, metadata=metadata, run=run)
        group = self.ranks.async_group  # the thread keeps it: a close() that times out leaves it to it
        if self._writer is None:
            self._writer = FileSystemWriter(
                tmp,
                sync_files=True,
                thread_count=self.thread_count,
                cache_staged_state_dict=torch.cuda.is_available(),  # a pinned staging buffer, reused
            )
        try:
            future = dcp_async_save(
                dict(state),
                checkpoint_id=tmp,
                storage_writer=self._writer,
                process_group=group,
            )
        except BaseException:
            if self.ranks.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            self._report("failed", step, flush=flush)
            raise
        handle = AsyncSave(step=step, started=started, blocked_s=time.monotonic() - started)
        args = (future, group, tmp, what, flush, free_before)
        self._launch(self.ranks, handle, self._complete, args, f"preemptd-async-save step {step}")
        return handle

    def _complete(
        self,
        handle: AsyncSave,
        future: Any,
        group: Any,
        tmp: Path,
        what: Commit,
        flush: dict[str, Any],
        free_before: int | None,
    ) -> None:
        try:
            future.result()
            checkpoint = self._commit(group, tmp, what, self.checksum)
            total = time.monotonic() - handle.started
            handle.result = self._finish(checkpoint, handle.blocked_s, total, flush)
        except BaseException as exc:  # kept for the training thread, which raises it in wait()
            if convertible(exc):
                handle.error = self._fail(exc, handle.step, tmp, free_before, group)
                handle.error.__cause__ = exc
            else:
                handle.error = exc
                if self.ranks.rank == 0:
                    shutil.rmtree(tmp, ignore_errors=True)
            self._report("failed", handle.step, flush=flush)
            # The error waits for wait(): its traceback keeps its lines but not the frames' locals (the group
            # among them), so that a closed store's groups end (Ranks.release) even when its save failed.
            cause: BaseException | None = exc
            while cause is not None:
                traceback.clear_frames(cause.__traceback__)
                cause = cause.__cause__ or cause.__context__
        finally:
            del future, group

    def wait(self, timeout: float | None = None) -> ShardedCheckpoint | None:
        """Wait for the save in flight (if any) to be committed; its checkpoint, or None when none was in
        flight. Its failure is raised here. TimeoutError when it is still running."""
        handle = self._join(timeout)
        if handle is None:
            return None
        if handle.error is not None:
            raise handle.error
        return handle.result

    def settle(
        self, deadline: datetime | None, notice_id: str | None
    ) -> tuple[ShardedCheckpoint | None, str]:
        """An emergency save was asked for while a save is in flight: wait for that one when it started at
        most ``recent_s`` ago and is predicted to end before the deadline (it is the emergency checkpoint,
        returned), else return None so the emergency save starts at once. Rank 0 decides for every rank.
        The second value is the choice, as reported."""
        handle = self.inflight
        assert handle is not None
        began = time.monotonic()
        age = began - handle.started
        predicted = self.budget.predict()
        left = seconds_to(deadline)
        ends_in = None if predicted is None else max(0.0, predicted - age)
        local = age <= self.recent_s and ends_in is not None and (left is None or ends_in < left)
        if not self.ranks.from_zero(local):
            _log.warning(
                "emergency save of a new step while the save of step %s (started %.1f s ago, predicted to "
                "end in %s s, %s s left) is in flight",
                handle.step,
                age,
                "?" if ends_in is None else f"{ends_in:.1f}",
                "?" if left is None else f"{left:.1f}",
            )
            return None, "emergency_while_in_flight"
        try:
            served = self.wait()
        except Exception as exc:  # it failed: the emergency save must still happen
            _log.warning("the background save of step %s failed (%s): saving a new step", handle.step, exc)
            return None, "emergency_after_in_flight_failed"
        assert served is not None
        flush = {**self.budget.report(served.step, deadline, "waited_for_in_flight"), "predicted_s": ends_in}
        self._report(
            "finished",
            served.step,
            duration_s=time.monotonic() - began,
            size=served.checkpoint.bytes,
            emergency=True,
            notice_id=notice_id,
            path=served.path,
            flush=flush,
        )
        record_emergency(served.step, path=served.path, notice_id=notice_id, sharded=True)
        return served, "waited_for_in_flight"


def with_slack(flush: dict[str, Any], duration_s: float) -> dict[str, Any]:
    """A finished save's ``flush`` fields with ``slack_s``: the time left before the deadline at its start
    less its duration (negative: it ended after the deadline); unchanged without a deadline."""
    left = flush.get("time_left_s")
    return flush if left is None else {**flush, "slack_s": round(float(left) - duration_s, 3)}


def seconds_to(deadline: datetime | None) -> float | None:
    if deadline is None:
        return None
    left = (deadline - datetime.now(timezone.utc)).total_seconds()
    return left if math.isfinite(left) else None
