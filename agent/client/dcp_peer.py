"""The sharded store's peer tier (``ShardedStore(tier="peer")``): an emergency save evacuated into the RAM
tiers of the hosts without a notice (:mod:`agent.client.evacuate`), reported and recorded for ``preemptd
exec`` like a durable one, or handed back to the durable save with a warning saying why; and a resume that
looks at the hosts' RAM tiers before the durable root (:mod:`agent.client.peer_resume`). Part of
:mod:`agent.client.dcp`; import from there.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Collection, Mapping
from typing import Any

from agent.client.dcp_commit import Ranks, ShardedCheckpoint
from agent.client.evacuate import Evacuation, PeerTierUnusable
from agent.client.manifest import CheckpointError, CheckpointWarning
from agent.client.peer_resume import PeerResume
from agent.client.preempted import record_emergency
from agent.client.ramtier import RamTier
from agent.client.store import CheckpointStore
from agent.client.store_failure import fall_back, summary


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
    ) -> None:
        self.ranks = ranks
        self.local = local
        self.tiers = tiers
        self.job = job
        self.thread_count = thread_count
        self._report = report

    def save(
        self,
        step: int,
        state: Mapping[str, Any],
        notice_id: str | None,
        metadata: Mapping[str, Any] | None,
        noticed: Collection[int] | None,
    ) -> ShardedCheckpoint | None:
        """The emergency step into the surviving hosts' RAM tiers; None (with a CheckpointWarning saying
        why, on every rank) when that cannot be done and the durable save follows. When the group itself fails
        under it (a rank died), CheckpointError with the newest earlier committed durable step as its
        ``fallback`` (recorded for ``preemptd exec``), as a failed durable emergency save does."""
        started = time.monotonic()
        flush = {"sharded": True, "world_size": self.ranks.world_size}
        self._report("started", step, emergency=True, notice_id=notice_id, flush=flush)
        # The run a durable save of this step would have, so that a resume orders RAM and durable steps alike.
        run = int(self.ranks.from_zero(self.local.run_for(step) if self.ranks.rank == 0 else 0))
        try:
            if noticed is None:
                raise PeerTierUnusable("the ranks with a notice are unknown: pass noticed=decision.noticed")
            evacuation = Evacuation(self.ranks, self.ranks.group, self.tiers, self.job, self.thread_count)
            done = evacuation.run(step, run, state, noticed, notice_id)
        except PeerTierUnusable as exc:
            warnings.warn(
                f"step {step} was not evacuated into the RAM of the hosts without a notice ({exc}); "
                f"saving it to {self.local.root} instead",
                CheckpointWarning,
                stacklevel=4,
            )
            return None
        except Exception as exc:  # the group failed under it (a rank died mid-transfer): nothing committed
            error = CheckpointError(
                f"evacuation of step {step} failed, nothing was committed: {summary(exc)}"
            )
            error.fallback = fall_back(self.local.committed, step, notice_id, error, sharded=True)
            if error.fallback is not None:
                flush = {**flush, "fallback_step": error.fallback.step}
            self._report("failed", step, emergency=True, notice_id=notice_id, flush=flush)
            raise error from exc
        duration = time.monotonic() - started
        extra = {"world_size": self.ranks.world_size, "tier": "peer", "job": done.job}
        checkpoint = done.checkpoint(notice_id, {**dict(metadata or {}), **extra}, run, duration)
        self._report("finished", step, duration_s=duration, size=done.sent_bytes, emergency=True,
                     notice_id=notice_id, path=checkpoint.path, flush=flush)  # fmt: skip
        record_emergency(step, path=checkpoint.path, notice_id=notice_id, sharded=True, tier="peer")
        return ShardedCheckpoint(checkpoint, self.ranks.world_size)

    def load(self, state: Mapping[str, Any]) -> ShardedCheckpoint | None:
        """The newest RAM step complete across the hosts and newer than the newest durable step, loaded into
        ``state``; None when there is none (the durable resume follows)."""
        newest = self.ranks.from_zero(self._durable_newest() if self.ranks.rank == 0 else None)
        durable = (int(newest[0]), int(newest[1])) if newest else None
        return PeerResume(self.ranks, self.ranks.group, self.tiers, self.job).load(state, durable)

    def _durable_newest(self) -> tuple[int, int] | None:
        try:
            return next(iter(self.local._ordered()), None)
        except CheckpointError:  # the root cannot be listed: the durable resume says so
            return None
