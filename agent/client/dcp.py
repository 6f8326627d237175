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
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import socket
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import async_save as dcp_async_save
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.tensor import DTensor

from agent.client.preempted import record_emergency
from agent.client.reporting import Reporter
from agent.client.store import (
    _TMP_PREFIX,
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    Checkpoint,
    CheckpointError,
    CheckpointStore,
    CheckpointWarning,
    FileEntry,
    Verify,
    _file_crc,
    _fsync_dir,
    _fsync_file,
    _hash_workers,
    _write_durably,
)

DCP_METADATA = ".metadata"
# Deferred CRCs of an emergency save: each rank adds its own file's sums here after the commit.
CRC_SIDECAR = "crc32-rank-{rank}.json"
_PROBE_PREFIX = ".preemptd-shared-"
_log = logging.getLogger(__name__)


class TrainState:
    """A model and its optimizer as one DCP ``Stateful``, through torch's ``get_state_dict`` /
    ``set_state_dict`` (sharded DTensor state under FSDP2 or tensor parallel, plain tensors otherwise).

    Put it in the dict given to :meth:`ShardedStore.save` / :meth:`ShardedStore.load` next to other
    ``Stateful`` objects (step, RNG, data position)::

        state = {"train": TrainState(model, optimizer), "progress": progress}
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        options: StateDictOptions | None = None,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.options = options

    def state_dict(self) -> dict[str, Any]:
        if self.optimizer is None:
            model_state, _ = get_state_dict(self.model, [], options=self.options)
            return {"model": model_state}
        model_state, optim_state = get_state_dict(self.model, self.optimizer, options=self.options)
        return {"model": model_state, "optimizer": optim_state}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_state_dict(
            self.model,
            [] if self.optimizer is None else self.optimizer,
            model_state_dict=state_dict["model"],
            optim_state_dict=state_dict.get("optimizer", {}),
            options=self.options,
        )


@dataclass
class Progress:
    """Training position as a DCP ``Stateful``: the step, and the generators' states (CPU RNG, and CUDA's
    when present) so that a resumed run draws the same numbers. ``extra`` carries any small values (data
    position, epoch)."""

    step: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    rng: bool = True

    def state_dict(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"step": self.step, "extra": json.dumps(self.extra)}
        if self.rng:
            doc["rng_cpu"] = torch.get_rng_state()
        return doc

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"])
        self.extra = json.loads(state_dict.get("extra") or "{}")
        if self.rng and "rng_cpu" in state_dict:
            torch.set_rng_state(state_dict["rng_cpu"])


@dataclass(frozen=True)
class ShardedCheckpoint:
    """A committed sharded step: the store's :class:`Checkpoint` plus the world size it was saved at."""

    checkpoint: Checkpoint
    world_size: int

    @property
    def step(self) -> int:
        return self.checkpoint.step

    @property
    def path(self) -> Path:
        return self.checkpoint.path

    @property
    def notice_id(self) -> str | None:
        return self.checkpoint.notice_id

    @property
    def emergency(self) -> bool:
        return self.checkpoint.emergency


@dataclass(frozen=True)
class Budget:
    """The deadline budget of one save: the duration predicted from earlier saves, the seconds left before
    the notice's deadline, and whether the prediction exceeds them (the save runs all the same)."""

    step: int
    predicted_s: float | None
    time_left_s: float | None
    predicted_miss: bool


@dataclass
class AsyncSave:
    """A background save: ``blocked_s`` is how long it blocked training (staging); ``result`` is set once
    committed, ``error`` if it failed."""

    step: int
    started: float
    blocked_s: float
    thread: threading.Thread | None = None
    result: ShardedCheckpoint | None = None
    error: BaseException | None = None


class ShardedStore:
    """Sharded DCP checkpoints under ``root``, which every rank must see (a shared file system).

    Construct it on every rank after ``init_process_group`` (it is a collective): it makes its own gloo group
    for its collectives, so saves never mix with the training's own (NCCL or gloo) traffic, and it checks
    at once that the root is shared — a root each rank sees on its own disk raises :class:`CheckpointError`
    before training starts, not at the emergency. ``keep`` newest steps are kept (0: all).
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
    ) -> None:
        if keep < 0:
            raise ValueError(f"keep must be 0 (keep all) or more, got {keep}")
        self.root = Path(root)
        self.keep = keep
        self.checksum = checksum
        self.defer_emergency_checksum = defer_emergency_checksum
        self.thread_count = thread_count
        self.reporter = reporter if reporter is not None or not report else Reporter(socket_path)
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world_size = dist.get_world_size() if self.distributed else 1
        if self.distributed and group is None:
            group = dist.new_group(backend="gloo")
        self.group = group
        # Background saves get a group of their own: their collectives run on another thread while the
        # training thread may need `group` for an emergency save.
        self.async_group = dist.new_group(backend="gloo") if self.distributed else None
        self.recent_s = recent_s
        self.last_budget: Budget | None = None
        self._durations: list[float] = []
        self._inflight: AsyncSave | None = None
        self._async_writer: FileSystemWriter | None = None
        self._local = CheckpointStore(self.root, keep, checksum=checksum, report=False)
        self._checksummers: list[threading.Thread] = []
        self.last_save: ShardedCheckpoint | None = None
        self.root.mkdir(parents=True, exist_ok=True)
        self._check_shared()

    # -- collectives on the store's own group --------------------------------------------------------------

    def _gather(self, value: Any, group: Any = None) -> list[Any]:
        if not self.distributed:
            return [value]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, value, group=group or self.group)
        return out

    def _from_zero(self, value: Any, group: Any = None) -> Any:
        if not self.distributed:
            return value
        group = group or self.group
        box = [value if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
        return box[0]

    def _check_shared(self) -> None:
        """Rank 0 writes a probe file under the root; every rank must see it."""
        probe = None
        if self.rank == 0:
            probe = self.root / f"{_PROBE_PREFIX}{uuid.uuid4().hex}"
            _write_durably(probe, socket.gethostname().encode())
        name = self._from_zero(probe.name if probe is not None else None)
        seen = self._gather((self.rank, socket.gethostname(), (self.root / name).is_file()))
        if self.rank == 0 and probe is not None:
            probe.unlink(missing_ok=True)
        blind = [(rank, host) for rank, host, ok in seen if not ok]
        if blind:
            who = ", ".join(f"rank {rank} on {host}" for rank, host in blind)
            raise CheckpointError(
                f"checkpoint root {self.root} is not shared between the ranks: {who} cannot see the file "
                f"rank 0 on {seen[0][1]} wrote there. A sharded checkpoint is one directory that every rank "
                "writes into; put the root on a file system all hosts mount (NFS, Lustre, a mounted bucket)."
            )

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
    ) -> ShardedCheckpoint:
        """Save ``state`` (DTensors, tensors, ``Stateful`` objects) as step ``step`` on every rank; returns
        on every rank once the step is committed. On failure nothing is committed and every rank raises.

        ``deadline`` (the notice's): the save is reported with the duration predicted from earlier saves
        and whether that misses the deadline (:attr:`last_budget`); it runs all the same. An emergency save
        while a background save is in flight follows the rule of :meth:`save_async`: it may return that
        save's (earlier) step instead."""

        def write(directory: Path) -> None:
            writer = FileSystemWriter(directory, sync_files=True, thread_count=self.thread_count)
            dcp_save(dict(state), storage_writer=writer, process_group=self.group)

        return self.save_files(
            step,
            write,
            emergency=emergency,
            notice_id=notice_id,
            metadata=metadata,
            deadline=deadline,
            layout=_layout(state),
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
        if self._inflight is not None:
            if emergency:
                served, choice = self._settle_in_flight(deadline, notice_id)
                if served is not None:
                    return served
            else:
                self.wait_async()  # at most one save at a time
        started = time.monotonic()
        flush = self._budget(step, deadline, choice)
        self._report("started", step, emergency=emergency, notice_id=notice_id, flush=flush)
        tmp = self._agree_tmp()
        defer = emergency and self.checksum and self.defer_emergency_checksum
        try:
            writer(tmp)
            checkpoint = self._commit(
                self.group,
                tmp,
                step,
                layout or {},
                started,
                emergency,
                notice_id,
                metadata,
                self.checksum and not defer,
            )
        except BaseException:
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            self._report("failed", step, emergency=emergency, notice_id=notice_id, flush=flush)
            raise
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
        if step < 0:
            raise ValueError(f"step must be non-negative, got {step}")
        self.wait_async()
        started = time.monotonic()
        flush = self._budget(step, None, "background")
        self._report("started", step, flush=flush)
        tmp = self._agree_tmp()
        layout = _layout(state)
        if self._async_writer is None:
            self._async_writer = FileSystemWriter(
                tmp,
                sync_files=True,
                thread_count=self.thread_count,
                cache_staged_state_dict=torch.cuda.is_available(),  # a pinned staging buffer, reused
            )
        try:
            future = dcp_async_save(
                dict(state),
                checkpoint_id=tmp,
                storage_writer=self._async_writer,
                process_group=self.async_group,
            )
        except BaseException:
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            self._report("failed", step, flush=flush)
            raise
        handle = AsyncSave(step=step, started=started, blocked_s=time.monotonic() - started)
        handle.thread = threading.Thread(
            target=self._complete_async,
            args=(handle, future, tmp, layout, metadata, flush),
            name=f"preemptd-async-save step {step}",
            daemon=True,
        )
        self._inflight = handle
        handle.thread.start()
        return handle

    def _complete_async(
        self,
        handle: AsyncSave,
        future: Any,
        tmp: Path,
        layout: Mapping[str, Any],
        metadata: Mapping[str, Any] | None,
        flush: dict[str, Any],
    ) -> None:
        try:
            future.result()
            checkpoint = self._commit(
                self.async_group,
                tmp,
                handle.step,
                layout,
                handle.started,
                False,
                None,
                metadata,
                self.checksum,
            )
            total = time.monotonic() - handle.started
            handle.result = self._finished(checkpoint, handle.blocked_s, total, False, None, False, flush)
        except BaseException as exc:  # kept for the training thread, which raises it in wait_async()
            handle.error = exc
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            self._report("failed", handle.step, flush=flush)

    def wait_async(self, timeout: float | None = None) -> ShardedCheckpoint | None:
        """Wait for the background save in flight (if any) to be committed; its checkpoint, or None when
        none was in flight. Its failure is raised here. TimeoutError when it is still running."""
        handle = self._inflight
        if handle is None or handle.thread is None:
            return None
        handle.thread.join(timeout)
        if handle.thread.is_alive():
            raise TimeoutError(f"the background save of step {handle.step} is still running")
        self._inflight = None
        if handle.error is not None:
            raise handle.error
        return handle.result

    @property
    def in_flight(self) -> AsyncSave | None:
        """The background save not yet waited for, if any."""
        return self._inflight

    def _settle_in_flight(
        self, deadline: datetime | None, notice_id: str | None
    ) -> tuple[ShardedCheckpoint | None, str]:
        handle = self._inflight
        assert handle is not None
        began = time.monotonic()
        age = began - handle.started
        predicted = self.predict()
        left = _seconds_to(deadline)
        ends_in = None if predicted is None else max(0.0, predicted - age)
        local = age <= self.recent_s and ends_in is not None and (left is None or ends_in < left)
        if not self._from_zero(local):
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
            served = self.wait_async()
        except Exception as exc:  # it failed: the emergency save must still happen
            _log.warning("the background save of step %s failed (%s): saving a new step", handle.step, exc)
            return None, "emergency_after_in_flight_failed"
        assert served is not None
        flush = {**self._budget(served.step, deadline, "waited_for_in_flight"), "predicted_s": ends_in}
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

    def _agree_tmp(self) -> Path:
        """One temporary directory name for all ranks (rank 0's), so that they write into the same one."""
        name = f"{_TMP_PREFIX}{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        return self.root / str(self._from_zero(name))

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
        own = [f for f in checkpoint.files if _owner(f.path, self.world_size) == self.rank]
        self._durations.append(total_s)
        self._report(
            "finished",
            checkpoint.step,
            duration_s=blocked_s,  # what the advisor calls δ: the time training was blocked
            size=sum(f.bytes for f in own),
            emergency=emergency,
            notice_id=notice_id,
            path=checkpoint.path,
            flush=flush,
        )
        if emergency:  # committed on every rank: `preemptd exec` may turn the launcher's failure into 75
            record_emergency(checkpoint.step, path=checkpoint.path, notice_id=notice_id, sharded=True)
        if defer:
            thread = threading.Thread(
                target=_add_own_checksums,
                args=(checkpoint.path, own, self.rank),
                name=f"preemptd-checksum {checkpoint.path.name} rank {self.rank}",
                daemon=True,
            )
            thread.start()
            self._checksummers.append(thread)
        sharded = ShardedCheckpoint(replace(checkpoint, duration_s=total_s), self.world_size)
        self.last_save = sharded
        if not emergency:  # never spend a notice window deleting old checkpoints
            self.prune()
        return sharded

    # -- the deadline budget ------------------------------------------------------------------------------

    def predict(self) -> float | None:
        """Seconds a save of this state should take: the slowest of this process's last three saves (the
        whole write, also for background saves); before any, of the newest three committed steps."""
        if self._durations:
            return max(self._durations[-3:])
        found = []
        for step in self.steps()[:3]:
            try:
                duration = Checkpoint.load(self.path_of(step)).duration_s
            except CheckpointError:
                continue
            if duration is not None:
                found.append(float(duration))
        return max(found) if found else None

    def _budget(self, step: int, deadline: datetime | None, choice: str | None) -> dict[str, Any]:
        predicted = self.predict()
        left = _seconds_to(deadline)
        miss = predicted is not None and left is not None and predicted > left
        self.last_budget = Budget(step, predicted, left, miss)
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
        }

    def _commit(
        self,
        group: Any,
        tmp: Path,
        step: int,
        layout: Mapping[str, Any],
        started: float,
        emergency: bool,
        notice_id: str | None,
        metadata: Mapping[str, Any] | None,
        checksum: bool,
    ) -> Checkpoint:
        """Every rank makes its own files durable and describes them; one gather confirms them all; rank 0
        writes the manifest and renames; a broadcast says whether the step is committed."""
        described: list[dict[str, Any]] | str
        try:
            described = _describe_own(tmp, self.rank, self.world_size, checksum)
        except OSError as exc:
            described = f"rank {self.rank} on {socket.gethostname()}: {exc}"
        everyone = self._gather(described, group)
        failures = [d for d in everyone if isinstance(d, str)]
        if failures:
            raise CheckpointError(f"sharded save of step {step} failed: {'; '.join(failures)}")
        outcome: tuple[str, str] = ("", "")
        if self.rank == 0:
            try:
                final = self._local.path_of(step)
                doc = _manifest(
                    step, everyone, emergency, notice_id, metadata, started, self.world_size, layout
                )
                _write_durably(tmp / MANIFEST, json.dumps(doc, indent=1).encode())
                _fsync_dir(tmp)
                self._local._replace(tmp, final)
                _fsync_dir(self.root)
                outcome = ("ok", str(final))
            except OSError as exc:
                outcome = ("error", f"rank 0 could not commit step {step}: {exc}")
        status, detail = self._from_zero(outcome, group)
        if status != "ok":
            raise CheckpointError(detail)
        return Checkpoint.load(Path(detail))

    def wait_checksums(self, timeout: float | None = None) -> bool:
        end = None if timeout is None else time.monotonic() + timeout
        for thread in self._checksummers:
            thread.join(None if end is None else max(0.0, end - time.monotonic()))
        self._checksummers = [t for t in self._checksummers if t.is_alive()]
        return not self._checksummers

    def close(self, timeout: float = 10.0) -> None:
        """Before exit: finish a background save, deferred checksums and queued reports, each bounded by
        ``timeout``."""
        try:
            self.wait_async(timeout)
        except Exception as exc:  # reported as failed already; exiting must not raise it again
            _log.warning("background save failed: %s", exc)
        self.wait_checksums(timeout)
        if self.reporter is not None:
            self.reporter.close(timeout)

    def _report(self, phase: str, step: int, **fields: Any) -> None:
        if self.reporter is not None:
            self.reporter.checkpoint(phase, step, **fields)

    # -- listing, resuming, pruning -------------------------------------------------------------------------

    def steps(self) -> list[int]:
        return self._local.steps()

    def path_of(self, step: int) -> Path:
        return self._local.path_of(step)

    def get(self, step: int, verify: Verify = "checksum") -> ShardedCheckpoint:
        """Step ``step``, verified by every rank together (each checksums its share of the files; one
        gather); a collective. CheckpointError naming the file when it fails."""
        problem: str | None = None
        checkpoint: Checkpoint | None = None
        try:
            checkpoint = _load_sharded(self.path_of(step))
            _verify_share(checkpoint, verify, self.rank, self.world_size)
        except CheckpointError as exc:
            problem = str(exc)
        problems = sorted({p for p in self._gather(problem) if p})
        if problems or checkpoint is None:
            raise CheckpointError("; ".join(problems))
        return ShardedCheckpoint(checkpoint, int(checkpoint.metadata.get("world_size", 0) or 0))

    def checkpoints(self, verify: Verify = "checksum") -> Iterator[ShardedCheckpoint]:
        """Committed steps that verify, newest first, the same on every rank (rank 0's listing); the others
        are skipped with a CheckpointWarning naming the file."""
        for step in self._from_zero(self.steps()):
            try:
                yield self.get(step, verify)
            except CheckpointError as exc:
                warnings.warn(f"skipping checkpoint: {exc}", CheckpointWarning, stacklevel=3)

    def latest(self, verify: Verify = "checksum") -> ShardedCheckpoint | None:
        """The newest committed step that verifies on every rank, or None (a collective)."""
        return next(self.checkpoints(verify), None)

    def load(self, checkpoint: ShardedCheckpoint, state: Mapping[str, Any]) -> None:
        """Load ``checkpoint`` into ``state`` in place through ``dcp.load`` (resharding to this world size).

        Keys or shapes that do not match raise :class:`CheckpointError` naming them, before anything in
        ``state`` is overwritten (DCP plans the whole load before it reads)."""
        try:
            dcp_load(dict(state), checkpoint_id=checkpoint.path, process_group=self.group)
        except CheckpointException as exc:
            raise CheckpointError(
                f"{checkpoint.path} does not match the state to load into: {_dcp_reasons(exc)}"
            ) from exc

    def prune(self) -> list[Path]:
        """Rank 0 removes steps beyond ``keep`` and leftovers of dead saves (not a collective)."""
        if self.rank != 0:
            return []
        return self._local.prune()


# -- helpers ----------------------------------------------------------------------------------------------


def latest_committed(
    root: str | Path, verify: Verify = "checksum", *, require_dcp: bool = True
) -> ShardedCheckpoint | None:
    """The newest committed sharded step under ``root`` that verifies, read by this process alone (every
    file's size and CRC): for choosing a resume path before the process group exists (Lightning's
    ``ckpt_path``). Skipped steps raise a CheckpointWarning naming the file."""
    local = CheckpointStore(root, keep=0, report=False)
    for step in local.steps():
        try:
            checkpoint = _load_sharded(local.path_of(step), require_dcp=require_dcp)
            checkpoint.verify(verify)
        except CheckpointError as exc:
            warnings.warn(f"skipping checkpoint: {exc}", CheckpointWarning, stacklevel=2)
            continue
        return ShardedCheckpoint(checkpoint, int(checkpoint.metadata.get("world_size", 0) or 0))
    return None


def _seconds_to(deadline: datetime | None) -> float | None:
    if deadline is None:
        return None
    left = (deadline - datetime.now(timezone.utc)).total_seconds()
    return left if math.isfinite(left) else None


def _owner(name: str, world_size: int) -> int:
    """Which rank makes a file durable and checksums it: DCP names a rank's data files ``__<rank>_<n>``;
    everything else (``.metadata``) belongs to rank 0."""
    name = name.rsplit("/", 1)[-1]
    if name.startswith("__"):
        head = name[2:].split("_", 1)[0]
        if head.isdigit() and int(head) < world_size:
            return int(head)
    return 0


def _describe_own(directory: Path, rank: int, world_size: int, checksum: bool) -> list[dict[str, Any]]:
    """Fsync (again: cheap after DCP's own fsync, and it covers writers that skip it) and checksum the files
    this rank owns in ``directory``; their entries as plain dicts for the gather."""
    mine = sorted(
        p
        for p in directory.rglob("*")
        if p.is_file() and _owner(p.relative_to(directory).as_posix(), world_size) == rank
    )
    entries: list[dict[str, Any]] = []
    with ThreadPoolExecutor(max_workers=_hash_workers() + 1) as pool:
        pending: list[tuple[str, int, Future[None], Callable[[], int] | None]] = []
        for path in mine:
            size = path.stat().st_size
            crc = _file_crc(pool, path, size) if checksum else None
            pending.append(
                (path.relative_to(directory).as_posix(), size, pool.submit(_fsync_file, path), crc)
            )
        for name, size, synced, crc in pending:
            synced.result()
            entry: dict[str, Any] = {"path": name, "bytes": size, "rank": rank}
            if crc is not None:
                entry["crc32"] = crc()
            entries.append(entry)
    return entries


def _manifest(
    step: int,
    everyone: list[Any],
    emergency: bool,
    notice_id: str | None,
    metadata: Mapping[str, Any] | None,
    started: float,
    world_size: int,
    layout: Mapping[str, Any],
) -> dict[str, Any]:
    files = sorted((entry for entries in everyone for entry in entries), key=lambda e: e["path"])
    return {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "step": step,
        "time": datetime.now(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z"),
        "bytes": sum(int(f["bytes"]) for f in files),
        "emergency": emergency,
        "notice_id": notice_id,
        "duration_s": round(time.monotonic() - started, 6),
        "files": files,
        "checksum": "crc32" if all("crc32" in f for f in files) else None,
        "host": socket.gethostname(),
        "metadata": {**dict(metadata or {}), "world_size": world_size},
        "sharded": {"writer": "torch.distributed.checkpoint", "world_size": world_size, "layout": layout},
    }


def _layout(state: Mapping[str, Any]) -> dict[str, Any]:
    """The device mesh and placements of every DTensor in ``state`` (``Stateful`` values through their
    ``state_dict()``), for the manifest: what the job looked like when it saved."""
    found: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, DTensor):
            mesh = value.device_mesh
            found[prefix] = {
                "mesh": list(mesh.shape),
                "mesh_dims": list(mesh.mesh_dim_names or ()),
                "placements": [str(p) for p in value.placements],
                "shape": list(value.shape),
            }
        elif isinstance(value, Mapping):
            for key, item in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), item)
        elif hasattr(value, "state_dict") and hasattr(value, "load_state_dict"):
            walk(prefix, value.state_dict())

    walk("", state)
    return found


def _load_sharded(directory: Path, *, require_dcp: bool = True) -> Checkpoint:
    """The manifest, with the CRCs that ranks added after an emergency commit merged in."""
    checkpoint = Checkpoint.load(directory)
    sums: dict[str, int] = {}
    for sidecar in directory.glob(CRC_SIDECAR.format(rank="*")):
        try:
            sums.update({str(k): int(v) for k, v in json.loads(sidecar.read_text()).items()})
        except (OSError, ValueError, AttributeError):
            continue  # a sidecar is an optimisation: without it the files verify by size
    if sums:
        files = tuple(
            replace(f, crc32=sums[f.path]) if f.crc32 is None and f.path in sums else f
            for f in checkpoint.files
        )
        checkpoint = replace(checkpoint, files=files)
    if require_dcp and (
        not (directory / DCP_METADATA).is_file() or DCP_METADATA not in {f.path for f in checkpoint.files}
    ):
        raise CheckpointError(f"{directory / DCP_METADATA}: missing (not a committed DCP checkpoint)")
    return checkpoint


def _verify_share(checkpoint: Checkpoint, level: Verify, rank: int, world_size: int) -> None:
    """Sizes of every file; CRCs of this rank's share (files spread by index, so the reading is split)."""
    if level == "none":
        return
    checkpoint.verify("size")
    if level != "checksum":
        return
    share = tuple(f for index, f in enumerate(checkpoint.files) if index % world_size == rank)
    replace(checkpoint, files=share).verify("checksum")


def _add_own_checksums(directory: Path, own: list[FileEntry], rank: int) -> None:
    """After an emergency commit: this rank's CRCs into its sidecar (atomic write), so later resumes can
    detect a corrupt shard. A step removed meanwhile is left alone."""
    try:
        with ThreadPoolExecutor(max_workers=_hash_workers()) as pool:
            sums = {e.path: _file_crc(pool, directory / e.path, e.bytes) for e in own}
            doc = {path: crc() for path, crc in sums.items()}
        target = directory / CRC_SIDECAR.format(rank=rank)
        staged = directory / f".{target.name}.tmp"
        _write_durably(staged, json.dumps(doc).encode())
        os.rename(staged, target)
        _fsync_dir(directory)
    except (OSError, CheckpointError):
        pass


def _dcp_reasons(exc: BaseException) -> str:
    """The per-rank causes inside DCP's CheckpointException, without tracebacks, deduplicated."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, Mapping) and failures:
        reasons = []
        for value in failures.values():
            cause = value[0] if isinstance(value, tuple) else value
            reasons.append(str(cause))
        return "; ".join(sorted(set(reasons)))
    return str(exc)
