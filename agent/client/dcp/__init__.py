"""Sharded checkpoints through ``torch.distributed.checkpoint`` (DCP), committed once for all ranks.

:class:`ShardedStore` keeps ``step-<N>`` directories under one root that every rank sees. A save is a
collective: every rank writes its shard files with DCP into one shared temporary directory (fsynced by DCP's
``FileSystemWriter``), fsyncs and describes its own files, and one ``all_gather`` confirms that every rank's
files are durable; rank 0 then writes the manifest (every rank's files with sizes and CRCs, the world size,
the DTensor layout), renames the directory and fsyncs the root, and a broadcast tells every rank that the
step is committed. A rank that dies before the commit leaves a temporary directory that ``latest()`` never
accepts. The directory stays a plain DCP checkpoint: ``torch.distributed.checkpoint.load`` reads it.

State goes through torch's own helpers: :class:`TrainState` wraps a model and its optimizer with
``get_state_dict`` / ``set_state_dict`` as a DCP ``Stateful``, so a job saved on N ranks resumes on M with
DCP's resharding.

This package's ``__init__`` is the public face; the parts live in the package: the commit protocol and manifest
(``_commit``), background saves and the deadline budget (``_async``), the state helpers
(``_state``), the peer tier and the planner (``_peer``: ``tier="peer"`` and ``"auto"``).
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import replace
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from agent.checkpoint.durable import ChecksumThreads
from agent.client.dcp._async import AsyncSave, BackgroundSaves, Budget, DeadlineBudget, with_slack
from agent.client.dcp._commit import (
    CRC_SIDECAR,
    DCP_METADATA,
    Commit,
    Ranks,
    ShardedCheckpoint,
    add_own_checksums,
    commit,
    latest_committed,
    load_failure,
    load_sharded,
    owner,
    verify_share,
    zip_crc_off,
)
from agent.client.dcp._peer import PeerTier
from agent.client.dcp._state import Progress, TrainState, layout
from agent.client.peer.ramtier import RamTier, resolve_job_id
from agent.client.preempted import record_emergency
from agent.client.reporting import Reporter
from agent.client.store import (
    Checkpoint,
    CheckpointError,
    CheckpointStore,
    CheckpointWarning,
    Skipped,
    Verify,
    valid_only,
)
from agent.client.store_failure import convertible, fall_back, free_bytes, save_failure

if TYPE_CHECKING:  # imported on use (agent.client.peer's modules import this package first)
    from agent.client.peer.snapshot import SnapshotRun

__all__ = [
    "CRC_SIDECAR",
    "DCP_METADATA",
    "AsyncSave",
    "Budget",
    "CheckpointError",
    "CheckpointWarning",
    "Progress",
    "ShardedCheckpoint",
    "ShardedStore",
    "TrainState",
    "latest_committed",
]

_log = logging.getLogger(__name__)


class ShardedStore:
    """Sharded DCP checkpoints under ``root``, which every rank must see (a shared file system).

    Construct it on every rank after ``init_process_group`` (it is a collective): it makes its own gloo group
    for its collectives, so saves never mix with the training's own (NCCL or gloo) traffic, and it checks
    at once that the root is shared — a root each rank sees on its own disk raises :class:`CheckpointError`
    before training starts, not at the emergency. ``keep`` newest steps are kept (0: all).

    ``tier="peer"``: emergency saves go into the RAM of the hosts without a notice, resumes look there first
    (:mod:`agent.client.dcp._peer`; ``job`` or :func:`agent.client.peer.ramtier.resolve_job_id` names the
    job); ``"auto"``: to the root when the durable save's predicted duration times ``margin`` fits the time
    left, else as "peer".
    """

    def __init__(
        self,
        root: str | Path,
        keep: int = 3,
        *,
        checksum: bool = True,
        defer_emergency_checksum: bool = True,
        reporter: Reporter | None = None,
        report: bool = True,
        socket_path: str | Path | None = None,
        thread_count: int = 1,
        group: Any = None,
        recent_s: float = 30.0,
        tier: str = "durable",
        job: str | None = None,
        ram_tier: RamTier | None = None,
        margin: float = 1.5,
    ) -> None:
        if tier not in ("durable", "peer", "auto"):
            raise ValueError(f"tier must be 'durable', 'peer' or 'auto', got {tier!r}")
        tiers = ram_tier or RamTier(socket_path)  # no job id: an error before training, not at the emergency
        self.tier, job = tier, resolve_job_id(job, tiers.socket) if tier != "durable" else job
        # The plain store's: step directories, listing, replacing, pruning, shared argument checks, reporter.
        self._local = CheckpointStore(
            root,
            keep,
            checksum=checksum,
            reporter=reporter,
            report=report,
            socket_path=socket_path,
            defer_emergency_checksum=defer_emergency_checksum,
        )
        self.root = self._local.root
        self.keep = keep
        self.checksum = checksum
        self.defer_emergency_checksum = defer_emergency_checksum
        self.thread_count = thread_count
        self.reporter = self._local.reporter
        self.ranks = Ranks(group)
        self.distributed = self.ranks.distributed
        self.rank = self.ranks.rank
        self.world_size = self.ranks.world_size
        self._budget = DeadlineBudget(self._local, self.world_size)
        self._background = self._background_saves(recent_s)
        self._checksummers = ChecksumThreads()
        # The steps whose deferred checksums this store started (on every rank alike: the saves are collective).
        self._deferred: set[str] = set()
        self.last_save: ShardedCheckpoint | None = None
        auto = margin if tier == "auto" else None
        args = (self.ranks, self._local, tiers, str(job), thread_count, self._report, self._budget, auto)
        self.peer = PeerTier(*args) if tier != "durable" else None  # none for "durable": no stream group
        self.root.mkdir(parents=True, exist_ok=True)
        self.ranks.check_shared(self.root)

    def _background_saves(self, recent_s: float) -> BackgroundSaves:
        """The store's background saves (:meth:`save_async`), committed and reported as its own saves are."""
        return BackgroundSaves(
            self.ranks,
            self.root,
            self._budget,
            thread_count=self.thread_count,
            checksum=self.checksum,
            recent_s=recent_s,
            report=self._report,
            commit=self._commit,
            finish=lambda checkpoint, blocked, total, flush: self._finished(
                checkpoint, blocked, total, False, None, False, flush
            ),
            fail=self._failure,
        )

    @property
    def recent_s(self) -> float:
        """How recent a background save must be for an emergency save to wait for it (see :meth:`save_async`)."""
        return self._background.recent_s

    @recent_s.setter
    def recent_s(self, value: float) -> None:
        self._background.recent_s = value

    @property
    def group(self) -> Any:
        """The store's gloo group for its saves and loads (a writer given to :meth:`save_files` may use it)."""
        return self.ranks.group

    @property
    def last_budget(self) -> Budget | None:
        """The deadline budget of the newest save."""
        return self._budget.last

    # -- saving -------------------------------------------------------------------------------------------

    def save(
        self,
        step: int,
        state: Mapping[str, Any],
        *,
        emergency: bool = False,
        notice_id: str | None = None,
        metadata: Mapping[str, Any] | None = None,
        deadline: datetime | None = None,
        noticed: Collection[int] | None = None,
    ) -> ShardedCheckpoint:
        """Save ``state`` (DTensors, tensors, ``Stateful`` objects) as step ``step`` on every rank; returns
        on every rank once the step is committed. On failure nothing is committed and every rank raises the
        same :class:`CheckpointError` naming the cause (torch's own ``CheckpointException``, a
        ``BaseException``, is chained to it); a failed emergency save falls back to the newest earlier
        committed step as :meth:`CheckpointStore.save` describes. A step lower than the newest committed one
        starts a new run (see there).

        ``deadline`` (the notice's): the save is reported with the duration predicted from earlier saves
        and whether that misses the deadline (:attr:`last_budget`); it runs all the same. An emergency save
        while a background save is in flight follows the rule of :meth:`save_async`: it may return that
        save's (earlier) step instead.

        ``tier="peer"``/``"auto"``: an emergency save is evacuated (``noticed``: :attr:`~agent.client.torch.Decision.noticed`)
        into a RAM tier's step directory (``metadata["tier"] == "peer"``), else saved here (with a warning)."""
        if emergency and self.peer is not None:
            evacuated = self.peer.save(step, state, notice_id, metadata, noticed, deadline)
            if evacuated is not None:
                self.last_save = evacuated
                return evacuated

        def write(directory: Path) -> None:
            writer = FileSystemWriter(directory, sync_files=True, thread_count=self.thread_count)
            dcp_save(dict(state), storage_writer=writer, process_group=self.ranks.group)

        return self.save_files(
            step,
            write,
            emergency=emergency,
            notice_id=notice_id,
            metadata=metadata,
            deadline=deadline,
            layout=layout(state),
        )

    def save_files(
        self,
        step: int,
        writer: Callable[[Path], Any],
        *,
        emergency: bool = False,
        notice_id: str | None = None,
        metadata: Mapping[str, Any] | None = None,
        deadline: datetime | None = None,
        layout: Mapping[str, Any] | None = None,
    ) -> ShardedCheckpoint:
        """:meth:`save` for a framework that writes a sharded checkpoint itself on every rank (Lightning's
        ``trainer.save_checkpoint`` under FSDP or ModelParallel): every rank calls ``writer(directory)``
        with the same shared temporary directory; the commit is the same. Files named ``__<rank>_…`` belong
        to that rank, the others to rank 0."""
        if step < 0:
            raise ValueError(f"step must be non-negative, got {step}")
        choice = None
        if self._background.inflight is not None:
            if emergency:
                served, choice = self._background.settle(deadline, notice_id)
                if served is not None:
                    return served
            else:
                self.wait_async()  # at most one save at a time
        started = time.monotonic()
        flush = self._budget.report(step, deadline, choice)
        self._report("started", step, emergency=emergency, notice_id=notice_id, flush=flush)
        free_before = free_bytes(self.root)
        run = self._local.run_for(step) if self.rank == 0 else 0  # rank 0 writes the manifest
        tmp = self.ranks.agree_tmp(self.root)
        defer = emergency and self.checksum and self.defer_emergency_checksum
        what = Commit(step, layout or {}, started, emergency, notice_id, metadata, run, defer)
        try:
            with zip_crc_off():
                writer(tmp)
            checkpoint = self._commit(self.ranks.group, tmp, what, self.checksum and not defer)
        except BaseException as exc:
            if not convertible(exc):
                if self.rank == 0:
                    shutil.rmtree(tmp, ignore_errors=True)
                self._report("failed", step, emergency=emergency, notice_id=notice_id, flush=flush)
                raise
            error = self._failure(exc, step, tmp, free_before)
            if emergency:
                error.fallback = fall_back(self._local.committed, step, notice_id, error, sharded=True)
                if error.fallback is not None:
                    flush = {**flush, "fallback_step": error.fallback.step}
            self._report("failed", step, emergency=emergency, notice_id=notice_id, flush=flush)
            raise error from exc
        duration = time.monotonic() - started
        return self._finished(checkpoint, duration, duration, emergency, notice_id, defer, flush)

    def save_async(
        self, step: int, state: Mapping[str, Any], *, metadata: Mapping[str, Any] | None = None
    ) -> AsyncSave:
        """A periodic save that blocks training only while DCP stages ``state`` into CPU memory (pinned when
        CUDA is present); DCP writes in the background and the store commits when the write ends, on a
        thread. At most one is in flight: a second call (or a periodic :meth:`save`) first waits for it.

        The rule for a notice that arrives meanwhile (:meth:`save` with ``emergency=True``): when the
        in-flight save started at most ``recent_s`` ago and its predicted end comes before the deadline,
        every rank waits for it and it is the emergency checkpoint (reported ``async:
        waited_for_in_flight``); otherwise the emergency save starts at once, next to it (``async:
        emergency_while_in_flight``). Rank 0 decides, so every rank does the same."""
        if self.peer is not None:
            self.peer.settle()  # one background collective at a time on the store's second group
        return self._background.start(step, state, metadata)

    def snapshot(
        self, step: int, state: Mapping[str, Any], *, avoid_pools: Collection[str] = ()
    ) -> SnapshotRun | None:
        """A peer snapshot of ``state`` as ``step`` (``tier="peer"``/``"auto"``): staged now, copied into the
        RAM of this host and of the next one in the background (:mod:`agent.client.peer.snapshot`); None when
        it could not start (a warning says why). A background save in flight is waited for first.
        ``avoid_pools``: capacity pools (``Domain.pool_name``) where the job lost hosts lately, whose hosts hold
        copies only when no other can (:meth:`agent.client.hazard.Siblings.pools`; the same on every rank)."""
        if self.peer is None:
            raise ValueError("snapshots go into the peers' RAM tiers: construct the store with tier='peer'")
        self._background.wait()
        return self.peer.snapshot(step, state, avoid_pools)

    def wait_async(self, timeout: float | None = None) -> ShardedCheckpoint | None:
        """Wait for the background save in flight (if any) to be committed; its checkpoint, or None when
        none was in flight. Its failure is raised here. TimeoutError when it is still running."""
        return self._background.wait(timeout)

    @property
    def in_flight(self) -> AsyncSave | None:
        """The background save not yet waited for, if any."""
        return self._background.inflight

    def predict(self) -> float | None:
        """Seconds a save of this state should take (see :class:`~agent.client.dcp._async.DeadlineBudget`)."""
        return self._budget.predict()

    def _commit(self, group: Any, tmp: Path, what: Commit, checksum: bool) -> Checkpoint:
        return commit(self.ranks, group, self._local, tmp, what, checksum)

    def _failure(
        self, exc: BaseException, step: int, tmp: Path, free_before: int | None, group: Any = None
    ) -> CheckpointError:
        """The one CheckpointError every rank raises for a failed save: rank 0 reads the cause (before it
        removes the temporary directory: a full disk tells) and tells the others, for failures every rank
        has (DCP's CheckpointException, a failed commit); any other stays this rank's own."""
        shared = getattr(exc, "failures", None) is not None or isinstance(exc, CheckpointError)
        error = save_failure(exc, step, self.root, tmp, free_before, self._local.newest)
        if shared and self.distributed:
            try:
                told = self.ranks.from_zero((str(error), error.reason), group)
                error = CheckpointError(told[0], reason=told[1])
            except Exception as lost:  # the group itself failed: this rank's own reading stands
                _log.warning("could not agree on why the save of step %s failed: %s", step, lost)
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        return error

    def _finished(
        self,
        checkpoint: Checkpoint,
        blocked_s: float,
        total_s: float,
        emergency: bool,
        notice_id: str | None,
        defer: bool,
        flush: dict[str, Any],
    ) -> ShardedCheckpoint:
        self._local._new_run = False  # the run start_run asked for has its first step
        own = [f for f in checkpoint.files if owner(f.path, self.world_size) == self.rank]
        self._budget.durations.append(total_s)
        self._report(
            "finished",
            checkpoint.step,
            duration_s=blocked_s,  # what the advisor calls δ: the time training was blocked
            size=sum(f.bytes for f in own),
            emergency=emergency,
            notice_id=notice_id,
            path=checkpoint.path,
            flush=with_slack(flush, total_s),
        )
        if emergency:  # committed on every rank: `preemptd exec` may turn the launcher's failure into 75
            record_emergency(checkpoint.step, path=checkpoint.path, notice_id=notice_id, sharded=True)
        if defer:
            name = f"preemptd-checksum {checkpoint.path.name} rank {self.rank}"
            self._checksummers.start(name, add_own_checksums, checkpoint.path, own, self.rank)
            self._deferred.add(checkpoint.path.name)
        sharded = ShardedCheckpoint(replace(checkpoint, duration_s=total_s), self.world_size)
        self.last_save = sharded
        if not emergency:  # never spend a notice window deleting old checkpoints
            self.prune(protect=checkpoint.path)
        return sharded

    def wait_checksums(self, timeout: float | None = None) -> bool:
        """Wait for deferred checksums (bounded by ``timeout`` in all); False if some are still running."""
        return self._checksummers.wait(timeout)

    def close(self, timeout: float = 10.0) -> None:
        """Before exit: finish a background save, deferred checksums and queued reports, each bounded by
        ``timeout``; then destroy the store's process groups (see :class:`._commit.Ranks`): the store
        saves and loads no more. Call it before ``destroy_process_group()``, or at least before exit."""
        try:
            self.wait_async(timeout)
            if self.peer is not None:
                self.peer.settle(timeout)
        except TimeoutError as exc:  # its group stays alive: released at exit
            _log.warning("%s after %s s: closing without it", exc, timeout)
        except Exception as exc:  # reported as failed already; exiting must not raise it again
            _log.warning("background save failed: %s", exc)
        self.wait_checksums(timeout)
        if self.reporter is not None:
            self.reporter.close(timeout)
        self.ranks.release()

    def _report(self, phase: str, step: int, **fields: Any) -> None:
        if self.reporter is not None:
            self.reporter.checkpoint(phase, step, **fields)

    # -- listing, resuming, pruning -------------------------------------------------------------------------

    def steps(self) -> list[int]:
        return self._local.steps()

    def path_of(self, step: int) -> Path:
        return self._local.path_of(step)

    def start_run(self) -> None:
        """Make the next save start a new run in this root (see :meth:`CheckpointStore.start_run`); call it
        on every rank (rank 0 writes the manifest)."""
        self._local.start_run()

    def get(self, step: int, verify: Verify = "checksum") -> ShardedCheckpoint:
        """Step ``step``, verified by every rank together (each checksums its share of the files; one
        gather); a collective. CheckpointError naming the file when it fails."""
        path = self.path_of(step)
        if path.name in self._deferred:  # this store's ranks may still be adding its CRCs
            self._deferred.discard(path.name)  # each rank waits for its own, then for every other
            self._checksummers.join_named(f"preemptd-checksum {path.name} rank {self.rank}")
            self.ranks.gather(None)
        problem: str | None = None
        checkpoint: Checkpoint | None = None
        try:
            checkpoint = load_sharded(path)
            verify_share(checkpoint, verify, self.rank, self.world_size)
        except CheckpointError as exc:
            problem = str(exc)
        problems = sorted({p for p in self.ranks.gather(problem) if p})
        if problems or checkpoint is None:
            raise CheckpointError("; ".join(problems))
        return ShardedCheckpoint(checkpoint, int(checkpoint.metadata.get("world_size", 0) or 0))

    def checkpoints(self, verify: Verify = "checksum") -> Iterator[ShardedCheckpoint]:
        """Committed steps that verify, newest first, the same on every rank (rank 0's listing); the others
        are skipped with a CheckpointWarning naming the step and the file."""
        steps = self.ranks.from_zero(self.steps())
        return valid_only(steps, lambda step: self.get(step, verify), lambda step: f"step {step}")

    def latest(self, verify: Verify = "checksum") -> ShardedCheckpoint | None:
        """The newest committed step that verifies on every rank, or None (a collective); each step skipped
        raises a CheckpointWarning naming it and why, and when none verifies one more lists them all."""
        skipped = Skipped(self.root)
        for step in self.ranks.from_zero(self.steps()):
            try:
                return self.get(step, verify)
            except CheckpointError as exc:
                skipped.add(f"step {step}", exc)
        skipped.none_left()
        return None

    def load(self, checkpoint: ShardedCheckpoint, state: Mapping[str, Any]) -> None:
        """Load ``checkpoint`` into ``state`` in place through ``dcp.load`` (resharding to this world size).

        Keys or shapes that do not match raise :class:`CheckpointError` (reason ``mismatch``) naming them,
        before anything in ``state`` is overwritten (DCP plans the whole load before it reads). Files that
        cannot be read raise CheckpointError with the cause on every rank (DCP gathers the failures)."""
        try:
            dcp_load(dict(state), checkpoint_id=checkpoint.path, process_group=self.ranks.group)
        except (CheckpointException, OSError) as exc:
            raise load_failure(checkpoint.path, exc) from exc

    def load_latest(self, state: Mapping[str, Any], verify: Verify = "checksum") -> ShardedCheckpoint | None:
        """Load the newest committed step that verifies *and* loads into ``state`` (a collective); that
        step, or None when there is none. Every rank resumes the same step: a step that fails on any rank
        — a file missing, of another size or failing its CRC32 (each rank checks its share, one gather), the
        CRCs an emergency save deferred never written, DCP's reader raising — is skipped on every rank with a
        CheckpointWarning naming the step and why, and the next older one is tried; when none is left, one
        more warning lists them (``state`` is then as the last try left it: DCP may have read part of a step
        that failed). A ``mismatch`` is raised at once.

        ``tier="peer"``/``"auto"``: the complete steps across the hosts' RAM tiers that are newer than the
        root's newest come first, newest first (``_peer``)."""
        skipped = Skipped(self.root)
        if self.peer is not None:
            resumed = self.peer.load(state, verify, skipped)
            if resumed is not None:
                return resumed
        for step in self.ranks.from_zero(self.steps()):
            try:
                checkpoint = self.get(step, verify)
                self._load_agreed(checkpoint, state)
            except CheckpointError as exc:
                if exc.reason == "mismatch":
                    raise
                skipped.add(f"step {step}", exc)
                continue
            return checkpoint
        skipped.none_left()
        return None

    def _load_agreed(self, checkpoint: ShardedCheckpoint, state: Mapping[str, Any]) -> None:
        """:meth:`load`, then one gather: CheckpointError on every rank when it failed on any (DCP gathers
        its reader's failures already; this covers what fails outside them)."""
        error: CheckpointError | None = None
        try:
            self.load(checkpoint, state)
        except CheckpointError as exc:
            error = exc
        self.ranks.agree(error)

    def prune(self, protect: Path | None = None) -> list[Path]:
        """Rank 0 removes steps beyond ``keep`` and dead saves' leftovers, never ``protect`` (no collective)."""
        if self.rank != 0:
            return []
        return self._local.prune(protect)
