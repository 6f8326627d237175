"""PyTorch helpers: state-dict writers for the checkpoint store, and cross-rank agreement on the job's own
``torch.distributed`` process group, so every rank checkpoints at the same step when any host gets a notice.

Only this module (and the Lightning and Hugging Face callbacks) imports torch; ``agent.client`` stays
standard library only.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from agent.checkpoint.durable import DurableFile
from agent.checkpoint.manifest import reason_of
from agent.client.events import Trigger
from agent.client.group_exit import hold
from agent.client.hazard import Siblings, hazard_of, steps_between
from agent.client.reporting import CheckpointSchedule, advised_snapshot_steps
from agent.client.store import (
    Checkpoint,
    CheckpointError,
    CheckpointStore,
    FileEntry,
    Skipped,
    Verify,
    Writer,
)
from agent.client.store_failure import os_error
from agent.client.watcher import WatcherBase

STATE_FILE = "state.pt"
SAFETENSORS_FILE = "model.safetensors"
_Loaded = TypeVar("_Loaded")


def torch_writer(obj: Any, filename: str = STATE_FILE, checksum: bool | None = None) -> Writer:
    """A store writer that ``torch.save``s ``obj`` (a state dict, or a dict of them) into one file, written
    back and checksummed while it is serialised (:class:`~agent.checkpoint.durable.DurableFile`)."""

    def write(directory: Path) -> dict[str, FileEntry]:
        with DurableFile(directory / filename, checksum=checksum) as handle:
            torch.save(obj, handle)  # type: ignore[arg-type]  # a binary file object, as torch.save wants
        assert handle.entry is not None
        return {filename: handle.entry}

    return write


def load_torch(
    checkpoint: Checkpoint, filename: str = STATE_FILE, map_location: Any = "cpu", weights_only: bool = True
) -> Any:
    """Load what :func:`torch_writer` saved (``weights_only`` by default: tensors, numbers, strings).
    CheckpointError naming the file when torch cannot read it (so a resume can fall back to an earlier
    step: see :meth:`CheckpointStore.load_latest` and :func:`agree_load`)."""
    path = checkpoint.file(filename)
    try:
        return torch.load(path, map_location=map_location, weights_only=weights_only)
    except Exception as exc:
        found = os_error(exc)
        reason = "unreadable" if found is None else reason_of(found)
        raise CheckpointError(f"{path}: torch cannot load it: {exc}", reason=reason) from exc


def safetensors_writer(
    tensors: Mapping[str, torch.Tensor],
    filename: str = SAFETENSORS_FILE,
    metadata: Mapping[str, str] | None = None,
) -> Writer:
    """A store writer for a flat name → tensor mapping in the safetensors format (needs ``safetensors``)."""
    from safetensors.torch import save_file

    def write(directory: Path) -> None:
        contiguous = {name: t.detach().contiguous() for name, t in tensors.items()}
        save_file(contiguous, str(directory / filename), metadata=dict(metadata or {}))

    return write


def load_safetensors(
    checkpoint: Checkpoint, filename: str = SAFETENSORS_FILE, device: str = "cpu"
) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(checkpoint.file(filename)), device=device)


@dataclass(frozen=True)
class Decision:
    """What all ranks agreed to do after a step.

    ``emergency``: some rank has an unacknowledged trigger (a notice or a signal) — save now and, usually,
    stop. ``periodic``: some rank's schedule says a periodic checkpoint is due. ``deadline`` is the earliest
    deadline any rank knows of. ``notice_id`` is this rank's own trigger's notice, if it has one. ``noticed``:
    the ranks (of the group) that have a trigger themselves, so that an evacuation knows which hosts are
    going away (see :class:`agent.client.dcp.ShardedStore`'s ``tier="peer"``).
    """

    checkpoint: bool = False
    emergency: bool = False
    periodic: bool = False
    deadline: datetime | None = None
    notice_id: str | None = None
    noticed: tuple[int, ...] = ()

    def time_left(self, now: datetime | None = None) -> float | None:
        if self.deadline is None:
            return None
        return max(0.0, (self.deadline - (now or datetime.now(timezone.utc))).total_seconds())


NOTHING = Decision()


class Coordinator:
    """Agrees across ranks, every ``every`` steps, whether to checkpoint now.

    Call :meth:`check` after every step on every rank (it is a collective on the steps where
    ``step % every == 0``, a no-op otherwise), then :meth:`done` once the checkpoint it asked for is durable.
    One ``all_reduce`` (MAX) carries the notice flag, the periodic flag, the earliest deadline, the hazard
    factor of this rank's host (:mod:`agent.client.hazard`) and each rank's own notice flag (one slot per rank),
    on the job's own process group (``group``; the default group when None). Without an initialised process
    group the decision is the local one. Keep ``every`` times the step time well inside a notice window.
    After each check, :attr:`hazard` is the job's agreed factor (the largest of any rank's, ``siblings``'
    included); :meth:`snapshot_due` says when the next peer snapshot is due under it.
    """

    def __init__(
        self,
        watcher: WatcherBase | None = None,
        schedule: CheckpointSchedule | None = None,
        *,
        every: int = 1,
        group: Any = None,
        device: torch.device | None = None,
        leaves: Callable[[Trigger], bool] | None = None,
        siblings: Siblings | None = None,
    ) -> None:
        if every < 1:
            raise ValueError(f"every must be at least 1, got {every}")
        self.watcher = watcher
        self.schedule = schedule
        self.every = every
        self.group = group
        self._device = device
        self.leaves = leaves
        self.hazard = 1.0  # the job's hazard factor, as agreed at the last check
        self.advised_every: int | None = None  # the steps between snapshots the agents advise, as agreed
        self.last_snapshot = 0  # the step of the last snapshot snapshot_due said was due
        self.siblings = siblings if siblings is not None else Siblings()

    def snapshot_due(self, step: int, every: int) -> bool:
        """Whether a peer snapshot is due after ``step`` for a job that takes one every ``every`` steps until
        its agents advise a number (:attr:`advised_every`, agreed at each check: the smallest any rank's agent
        advises): ``steps_between(K, hazard)`` steps after the last one (the same on every rank). A job resumed
        at step N sets :attr:`last_snapshot` to N. A notice on another host of the job makes one due at once
        (:class:`~agent.client.hazard.Siblings`)."""
        rule = steps_between(self.advised_every or every, self.hazard)
        if not self.siblings.take_snapshot() and step - self.last_snapshot < rule:
            return False
        self.last_snapshot = step
        return True

    @property
    def distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    def _reduce_device(self) -> torch.device:
        if self._device is None:
            backend = dist.get_backend(self.group)
            if backend == "nccl" and torch.cuda.is_available():
                self._device = torch.device("cuda", torch.cuda.current_device())
            else:
                self._device = torch.device("cpu")
        return self._device

    def check(self, step: int) -> Decision:
        if step % self.every:
            return NOTHING
        trigger = self.watcher.trigger if self.watcher is not None else None
        # Whether this rank's host goes away with its trigger (Decision.noticed): any trigger, unless ``leaves``
        # says otherwise (agent.client.elastic: torchrun stopping its workers to grow leaves the host in place).
        leaving = trigger is not None and (self.leaves is None or self.leaves(trigger))
        values, noticed = self._agree(self._local(trigger), leaving)
        emergency, periodic, deadline_ts = values[0] > 0, values[1] > 0, -values[2]
        self.hazard = values[3]
        # MAX of -K: the smallest K any rank's agent advises; -inf where none does.
        self.advised_every = int(-values[4]) if math.isfinite(values[4]) else None
        if not (emergency or periodic):
            return NOTHING
        deadline = datetime.fromtimestamp(deadline_ts, timezone.utc) if math.isfinite(deadline_ts) else None
        return Decision(
            checkpoint=True,
            emergency=emergency,
            periodic=periodic and not emergency,
            deadline=deadline,
            notice_id=trigger.notice_id if trigger is not None else None,
            noticed=noticed,
        )

    def _local(self, trigger: Trigger | None) -> list[float]:
        """This rank's flags, each agreed by MAX: emergency, periodic, -deadline, hazard, -advised K."""
        periodic = self.schedule.due() if self.schedule is not None else False
        deadlines = [d for d in (trigger.deadline if trigger else None,) if d is not None]
        if self.watcher is not None and self.watcher.deadline is not None:
            deadlines.append(self.watcher.deadline)
        deadline = min(d.timestamp() for d in deadlines) if deadlines else math.inf
        hazard = hazard_of(self.watcher.notices, self.watcher.policy).factor if self.watcher else 1.0
        hazard = max(hazard, self.siblings.hazard().factor)
        advised = advised_snapshot_steps(self.schedule.advice) if self.schedule is not None else None
        minus_k = -float(advised) if advised is not None else -math.inf
        return [float(trigger is not None), float(periodic), -deadline, hazard, minus_k]

    def _agree(self, local: list[float], leaving: bool) -> tuple[list[float], tuple[int, ...]]:
        """``local`` reduced by MAX over the group (one all_reduce, with one slot per rank for its own notice
        flag), and the ranks whose host leaves; the local values alone without a process group."""
        if not self.distributed:
            return local, (0,) if leaving else ()
        hold(self.group)  # its last reference dropped at exit, from Python (agent/client/group_exit.py)
        rank, world = dist.get_rank(self.group), dist.get_world_size(self.group)
        slots = [0.0] * world
        slots[rank] = float(leaving)
        flags = torch.tensor([*local, *slots], dtype=torch.float64, device=self._reduce_device())
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        values = flags.tolist()
        count = len(local)
        return values[:count], tuple(r for r, flag in enumerate(values[count:]) if flag > 0)

    def done(self, decision: Decision) -> None:
        """The checkpoint ``decision`` asked for is durable: acknowledge triggers, restart the interval."""
        if decision.emergency and self.watcher is not None:
            self.watcher.acknowledge()
        if decision.checkpoint and self.schedule is not None:
            self.schedule.mark()


def agree_latest(store: CheckpointStore, group: Any = None, verify: Verify = "checksum") -> Checkpoint | None:
    """The newest step that every rank has a valid checkpoint of (each rank reads its own ``store``), so all
    ranks resume from the same step. Without a process group it is ``store.latest()``. Prefer
    :func:`agree_load`, which also falls back when a step verifies but does not load."""
    found = agree_load(store, lambda checkpoint: None, group, verify)
    return None if found is None else found[0]


def agree_load(
    store: CheckpointStore,
    load: Callable[[Checkpoint], _Loaded],
    group: Any = None,
    verify: Verify = "checksum",
) -> tuple[Checkpoint, _Loaded] | None:
    """The newest step that every rank has a checkpoint of that verifies *and* loads on every rank (each
    rank reads its own ``store`` and calls ``load(checkpoint)``, e.g. :func:`load_torch`), with what ``load``
    returned; None when there is none. A step that fails on any rank (CheckpointError: a file damaged or
    missing, a CRC the emergency save deferred and never wrote, torch cannot read it) is skipped on every
    rank, each warning with the step and every rank's reason, so all ranks resume from the same step; when
    none is left, one more warning lists what was skipped. The order is rank 0's (newest run first, see
    :meth:`CheckpointStore.save`). A ``mismatch`` on any rank raises on every rank."""
    if not (dist.is_available() and dist.is_initialized()):
        return store.load_latest(load, verify)
    hold(group)
    return load_agreed(store, load, group, verify, Skipped(store.root))


def load_agreed(
    store: CheckpointStore,
    load: Callable[[Checkpoint], _Loaded],
    group: Any,
    verify: Verify,
    skipped: Skipped,
) -> tuple[Checkpoint, _Loaded] | None:
    """:func:`agree_load` on an initialised ``group`` that the caller keeps (a store's own group is not held
    for the exit, its store releases it); the steps passed over go into ``skipped``. One gather of the
    ranks' listings, then one gather per step tried, of each rank's outcome."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    listings: list[Any] = [None] * world
    dist.all_gather_object(listings, store.steps(), group=group)
    for step in listings[0] or ():
        lacking = [str(r) for r, steps in enumerate(listings) if step not in (steps or ())]
        if lacking:
            skipped.add(f"step {step}", f"not on rank {', '.join(lacking)}")
            continue
        found: tuple[Checkpoint, _Loaded] | None = None
        error: CheckpointError | None = None
        try:
            checkpoint = store.get(step, verify)
            found = (checkpoint, load(checkpoint))
        except CheckpointError as exc:
            error = exc
        mine = None if error is None else (error.reason == "mismatch", f"rank {rank}: {error}")
        said: list[Any] = [None] * world
        dist.all_gather_object(said, mine, group=group)
        failed = [s for s in said if s is not None]
        if not failed and found is not None:
            return found
        if any(mismatch for mismatch, _ in failed):
            if error is not None and error.reason == "mismatch":
                raise error
            why = next(text for mismatch, text in failed if mismatch)
            raise CheckpointError(
                f"step {step} does not match the state to load into: {why}", reason="mismatch"
            )
        skipped.add(f"step {step}", "; ".join(text for _, text in failed))
    skipped.none_left()
    return None


def rank_and_world() -> tuple[int, int]:
    """This process's rank and the world size: from the process group, else ``RANK``/``WORLD_SIZE``."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


__all__ = [
    "NOTHING",
    "SAFETENSORS_FILE",
    "STATE_FILE",
    "Coordinator",
    "Decision",
    "agree_latest",
    "agree_load",
    "load_agreed",
    "load_safetensors",
    "load_torch",
    "rank_and_world",
    "safetensors_writer",
    "torch_writer",
]
