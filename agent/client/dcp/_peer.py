"""The sharded store's peer tier (``ShardedStore(tier="peer")``): an emergency save evacuated into the RAM
tiers of the hosts without a notice (:mod:`agent.client.peer.evacuate`), reported and recorded for ``preemptd
exec`` like a durable one, or handed back to the durable save with a warning saying why; and a resume that
looks at the hosts' RAM tiers before the durable root (:mod:`agent.client.peer.resume`). With
``tier="auto"`` the planner (:func:`choose_tier`) picks the durable save when it is predicted to fit the time
left with a margin, else the evacuation. Part of :mod:`agent.client.dcp`; import from there.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Callable, Collection, Mapping
from datetime import datetime
from typing import TYPE_CHECKING, Any

from agent.checkpoint.manifest import CheckpointError, CheckpointWarning, Verify
from agent.client.dcp._async import DeadlineBudget, seconds_to, with_slack
from agent.client.dcp._commit import Ranks, ShardedCheckpoint
from agent.client.peer.ramtier import RamTier
from agent.client.preempted import record_emergency
from agent.client.store import CheckpointStore, Skipped
from agent.client.store_failure import fall_back, summary

if TYPE_CHECKING:  # imported on use at run time: see PeerTier.save
    from agent.client.peer.evacuate import Evacuated
    from agent.client.peer.snapshot import PeerSnapshots, SnapshotRun

_log = logging.getLogger("agent.client.dcp")


def choose_tier(predicted_s: float | None, time_left_s: float | None, margin: float) -> tuple[str, str]:
    """The tier ``tier="auto"`` saves an emergency step to, and why: ``durable`` when the durable save's
    predicted duration times ``margin`` fits the time left before the deadline (or when there is no deadline
    to race), else ``peer`` (also when nothing predicts the durable save yet: the fast tier is the safe bet)."""
    if time_left_s is None:
        return "durable", "no deadline"
    if predicted_s is None:
        return "peer", f"no durable save to predict from, {time_left_s:.1f} s left"
    fits = predicted_s * margin <= time_left_s
    verdict = "fits" if fits else "does not fit"
    why = f"a durable save predicted at {predicted_s:.1f} s (x{margin:g}) {verdict} {time_left_s:.1f} s left"
    return ("durable" if fits else "peer"), why


class PeerTier:
    """Saves into and resumes from the peers' RAM tiers for one sharded store (its ranks, group and root)."""

    def __init__(
        self,
        ranks: Ranks,
        local: CheckpointStore,
        tiers: RamTier,
        job: str,
        thread_count: int,
        report: Callable[..., None],
        budget: DeadlineBudget,
        margin: float | None = None,
    ) -> None:
        """``margin``: ``tier="auto"``'s (see :func:`choose_tier`); None: always evacuate (``tier="peer"``)."""
        if margin is not None and not margin >= 1.0:
            raise ValueError(f"margin must be at least 1, got {margin!r}")
        self.budget = budget
        self.margin = margin
        self.ranks = ranks
        self.local = local
        self.tiers = tiers
        self.job = job
        self.thread_count = thread_count
        self._report = report
        # The gloo group a notified rank streams its shard to its buddy on, beside DCP's collectives on
        # ranks.group: made here, with the store (a collective), never inside the window. (streaming False:
        # the shard is written into the notified host's RAM tier and its files sent afterwards; bench/.)
        ranks.add_stream()
        self.streaming = True
        self.snapshots: PeerSnapshots | None = None  # made by the first snapshot()

    def snapshot(
        self, step: int, state: Mapping[str, Any], avoid: Collection[str] = ()
    ) -> SnapshotRun | None:
        """Start a peer snapshot of ``state`` as ``step`` (:mod:`agent.client.peer.snapshot`), holders in the
        pools in ``avoid`` a last choice; None when it could not start (a warning says why)."""
        from agent.client.peer.snapshot import PeerSnapshots  # on use: see save()

        if self.snapshots is None:
            self.snapshots = PeerSnapshots(self.ranks, self.tiers, self.job, self._report, self.thread_count)
        run = int(self.ranks.from_zero(self.local.run_for(step) if self.ranks.rank == 0 else 0))
        return self.snapshots.start(step, run, state, avoid)

    def settle(self, timeout: float | None = None) -> None:
        """Wait for the snapshot in flight, if any (an emergency save never races one)."""
        if self.snapshots is not None:
            self.snapshots.settle(timeout)

    def save(
        self,
        step: int,
        state: Mapping[str, Any],
        notice_id: str | None,
        metadata: Mapping[str, Any] | None,
        noticed: Collection[int] | None,
        deadline: datetime | None = None,
    ) -> ShardedCheckpoint | None:
        """The emergency step into the surviving hosts' RAM tiers; None when the durable save follows: the
        planner chose it (``tier="auto"``), or the evacuation cannot be done (a CheckpointWarning saying why
        on every rank, and the durable save's reports say ``fallback``). When the group itself fails under
        it (a rank died), CheckpointError with the newest earlier committed durable step as its ``fallback``
        (recorded for ``preemptd exec``), as a failed durable emergency save does."""
        started = time.monotonic()
        self.settle()
        flush = self._plan(step, deadline)
        if flush is None:
            return None
        self._report("started", step, emergency=True, notice_id=notice_id, flush=flush)
        # The run a durable save of this step would have, so that a resume orders RAM and durable steps alike.
        run = int(self.ranks.from_zero(self.local.run_for(step) if self.ranks.rank == 0 else 0))
        # Imported here, not at the top: agent.client.peer's modules import agent.client.dcp._commit, which
        # runs this package's __init__ (and this module) first; a top-level import would find them half-made.
        from agent.client.peer.evacuate import PeerTierUnusable

        try:
            done = self._evacuate(step, run, state, noticed, notice_id)
        except PeerTierUnusable as exc:
            warnings.warn(
                f"step {step} was not evacuated into the RAM of the hosts without a notice ({exc}); "
                f"saving it to {self.local.root} instead",
                CheckpointWarning,
                stacklevel=4,
            )
            self.budget.planned = {"fallback": exc.reason}  # the durable save's reports say why
            return None
        except Exception as exc:  # the group failed under it (a rank died mid-transfer): nothing committed
            raise self._group_failed(exc, step, notice_id, flush) from exc
        duration = time.monotonic() - started
        extra = {"world_size": self.ranks.world_size, "tier": "peer", "job": done.job}
        checkpoint = done.checkpoint(notice_id, {**dict(metadata or {}), **extra}, run, duration)
        self._report(
            "finished",
            step,
            duration_s=duration,
            size=done.sent_bytes,
            emergency=True,
            notice_id=notice_id,
            path=checkpoint.path,
            flush=with_slack(flush, duration),
        )
        record_emergency(step, path=checkpoint.path, notice_id=notice_id, sharded=True, tier="peer")
        return ShardedCheckpoint(checkpoint, self.ranks.world_size)

    def _plan(self, step: int, deadline: datetime | None) -> dict[str, Any] | None:
        """The reports' ``flush`` of an emergency step into the RAM tiers, or None when the planner chose
        the durable save; rank 0 decides for every rank alike."""
        mine = (self.budget.predict(), seconds_to(deadline))
        predicted, left = self.ranks.from_zero(mine if self.ranks.rank == 0 else None)
        if self.margin is not None:
            tier, why = choose_tier(predicted, left, self.margin)
            _log.info("emergency save of step %s: %s (%s)", step, tier, why)
            if tier == "durable":
                return None
        return {
            "sharded": True,
            "world_size": self.ranks.world_size,
            "tier": "peer",
            "predicted_s": None if predicted is None else round(predicted, 3),
            "time_left_s": None if left is None else round(max(0.0, left), 3),
        }

    def _evacuate(
        self,
        step: int,
        run: int,
        state: Mapping[str, Any],
        noticed: Collection[int] | None,
        notice_id: str | None,
    ) -> Evacuated:
        """``step`` evacuated into the RAM of the hosts without a notice; PeerTierUnusable when it cannot be."""
        from agent.client.peer.evacuate import Evacuation, PeerTierUnusable  # on use: see save()

        if noticed is None:
            raise PeerTierUnusable(
                "the ranks with a notice are unknown: pass noticed=decision.noticed", "noticed_unknown"
            )
        evacuation = Evacuation(
            self.ranks,
            self.ranks.group,
            self.tiers,
            self.job,
            self.thread_count,
            self.ranks.stream if self.streaming else None,
        )
        return evacuation.run(step, run, state, noticed, notice_id)

    def _group_failed(
        self, exc: Exception, step: int, notice_id: str | None, flush: dict[str, Any]
    ) -> CheckpointError:
        """The error of an evacuation the group failed under (a rank died mid-transfer), with the newest
        earlier committed durable step as its ``fallback``; the failure reported."""
        error = CheckpointError(f"evacuation of step {step} failed, nothing was committed: {summary(exc)}")
        error.fallback = fall_back(self.local.committed, step, notice_id, error, sharded=True)
        if error.fallback is not None:
            flush = {**flush, "fallback_step": error.fallback.step}
        self._report("failed", step, emergency=True, notice_id=notice_id, flush=flush)
        return error

    def load(
        self, state: Mapping[str, Any], verify: Verify = "checksum", skipped: Skipped | None = None
    ) -> ShardedCheckpoint | None:
        """The newest RAM step complete across the hosts, newer than the newest durable step, that verifies
        and loads into ``state``, newest first (a step that does not is skipped: ``skipped``); None when there
        is none (the durable resume follows)."""
        newest = self.ranks.from_zero(self._durable_newest() if self.ranks.rank == 0 else None)
        durable = (int(newest[0]), int(newest[1])) if newest else None
        from agent.client.peer.resume import PeerResume  # on use: see save()

        resume = PeerResume(self.ranks, self.ranks.group, self.tiers, self.job)
        return resume.load(state, durable, verify, skipped)

    def _durable_newest(self) -> tuple[int, int] | None:
        try:
            return next(iter(self.local._ordered()), None)
        except CheckpointError:  # the root cannot be listed: the durable resume says so
            return None
