"""The commit protocol of a sharded checkpoint and its manifest: which rank owns which file, how every rank
makes its files durable and describes them, how rank 0 commits the step once for all, and how a committed
step is read back and verified (split between the ranks, or by one process before the group exists:
:func:`latest_committed`).
Part of :mod:`agent.client.dcp`; import from there.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import socket
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, cast

import torch.distributed as dist

from agent.checkpoint.durable import fsync_dir, fsync_file, write_durably
from agent.checkpoint.manifest import (
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    Checkpoint,
    CheckpointError,
    FileEntry,
    Verify,
    default_hash_workers,
    file_crc,
    file_crcs,
    hash_pool,
    reason_of,
)
from agent.client import group_exit  # noqa: F401  (its exit handler: the job's destroyed groups released)
from agent.client.store import _TMP_PREFIX, CheckpointStore, Skipped
from agent.client.store_failure import os_error, summary

DCP_METADATA = ".metadata"
# Deferred CRCs of an emergency save: each rank adds its own file's sums here after the commit.
CRC_SIDECAR = "crc32-rank-{rank}.json"
_PROBE_PREFIX = ".preemptd-shared-"
# Every Ranks whose groups are alive; a store never closed releases them at exit (see Ranks), after its
# background save's commit has had up to this long to end (as close() would wait for it).
_LIVE: weakref.WeakSet[Ranks] = weakref.WeakSet()
EXIT_WAIT_S = 10.0


@atexit.register
def _release_at_exit() -> None:
    for ranks in list(_LIVE):
        if ranks.worker is not None:
            ranks.worker.join(EXIT_WAIT_S)
        ranks.release()


def zip_crc_off() -> AbstractContextManager[Any]:
    """``torch.save`` skips its own CRC32 of each zip record while the store writes on this thread (torch's
    ``compute_crc32`` serialization setting; ``torch.load`` reads such files). The store computes its own
    CRC32 of every file, the one a resume verifies, so torch's is a second pass over the same bytes, time a
    flush on busy cores cannot spare (bench/RESULTS.md, "Sharded flush"). Torch keeps the setting
    per thread, so this covers DCP's writes on the calling thread (all of them with ``thread_count=1``) and
    no other thread's ``torch.save``. A no-op on a torch without the setting."""
    try:
        from torch.utils.serialization import config
    except ImportError:
        return nullcontext()
    patched: AbstractContextManager[Any] = cast(Any, config).patch({"save.compute_crc32": False})
    return patched


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


class Ranks:
    """This process's place among the ranks, and the store's own gloo groups: ``group`` for saves and
    loads on the training thread, ``async_group`` for a background save's collectives, which run on another
    thread while the training thread may need ``group`` for an emergency save, and ``stream`` (made by
    :meth:`add_stream` for the peer tier). Saves never mix with the training's own (NCCL or gloo) traffic.
    Constructing it is a collective when distributed.

    The groups it made are destroyed by :meth:`release` (the stores' ``close()``, and at exit for a store
    never closed): a gloo group still alive when the interpreter finalizes can abort the process, as its
    worker threads free a finished collective's tensors and need the GIL then ("terminate called without
    an active exception"); ``destroy_process_group()`` alone does not join them while the store holds them.
    """

    def __init__(self, group: Any = None) -> None:
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world_size = dist.get_world_size() if self.distributed else 1
        self._owned: list[Any] = []
        self._groups: dict[str, Any] = {"group": group, "async_group": None, "stream": None}
        self.released = False
        # The thread running a background save on ``async_group``, if any: release() leaves that group alone
        # while it runs (destroying a group under a collective in flight would hang its worker's join).
        self.worker: threading.Thread | None = None
        if self.distributed:
            if group is None:
                self._groups["group"] = self._new_group()
            self._groups["async_group"] = self._new_group()
            _LIVE.add(self)

    def _new_group(self) -> Any:
        made = dist.new_group(backend="gloo")
        self._owned.append(made)
        return made

    def _get(self, name: str) -> Any:
        if self.released:
            raise RuntimeError("the checkpoint store is closed: close() released its process groups")
        return self._groups[name]

    @property
    def group(self) -> Any:
        return self._get("group")

    @property
    def async_group(self) -> Any:
        return self._get("async_group")

    @property
    def stream(self) -> Any:
        return self._get("stream")

    def add_stream(self) -> None:
        """Make ``stream``, the gloo group a notified rank streams its shard to its buddy on (a collective)."""
        if self.distributed and self._groups["stream"] is None:
            self._groups["stream"] = self._new_group()

    def release(self) -> bool:
        """Destroy the groups this object made (a group given to it is only let go) and drop every reference
        to them; idempotent. False, with the background save's group kept, while that save still runs."""
        busy = self.worker is not None and self.worker.is_alive()
        kept = self._groups["async_group"] if busy else None
        for made in self._owned:
            if made is kept:
                continue
            # Already destroyed by destroy_process_group(), with the default group: only let go of it.
            with contextlib.suppress(ValueError, RuntimeError, AssertionError):
                dist.destroy_process_group(made)
        self._owned = [kept] if busy else []
        self._groups = {"group": None, "async_group": kept, "stream": None}
        self.released = True
        if not busy:
            _LIVE.discard(self)
        return not busy

    def gather(self, value: Any, group: Any = None) -> list[Any]:
        if not self.distributed:
            return [value]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, value, group=group or self.group)
        return out

    def from_zero(self, value: Any, group: Any = None) -> Any:
        if not self.distributed:
            return value
        group = group or self.group
        box = [value if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
        return box[0]

    def agree(self, error: CheckpointError | None, group: Any = None) -> None:
        """One gather of every rank's outcome of the same step (``error``: this rank's failure, or None): the
        same CheckpointError on every rank when any rank failed (``mismatch`` when any rank's was), so that
        no rank goes on with a step another one could not load. A collective."""
        said = self.gather(None if error is None else (error.reason, str(error)), group)
        failed = [s for s in said if s is not None]
        if not failed:
            return
        if error is not None and error.reason == "mismatch":
            raise error
        reasons = [reason for reason, _ in failed]
        reason = "mismatch" if "mismatch" in reasons else reasons[0]
        # DCP gathers a failure to every rank: the same words from each, said once.
        raise CheckpointError("; ".join(dict.fromkeys(text for _, text in failed)), reason=reason)

    def agree_tmp(self, root: Path) -> Path:
        """One temporary directory name for all ranks (rank 0's), so that they write into the same one."""
        name = f"{_TMP_PREFIX}{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        return root / str(self.from_zero(name))

    def check_shared(self, root: Path) -> None:
        """Rank 0 creates an empty probe file under ``root`` (empty: a full disk still takes it, and the job
        can start and resume); every rank must see it, or CheckpointError on every rank. A root rank 0 cannot
        write is a CheckpointError on every rank too."""
        probe = None
        problem = None
        if self.rank == 0:
            probe = root / f"{_PROBE_PREFIX}{uuid.uuid4().hex}"
            try:
                write_durably(probe, b"")
            except OSError as exc:
                problem = (f"checkpoint root {root} cannot be written by rank 0: {exc}", reason_of(exc))
        name, problem = self.from_zero((probe.name if probe is not None else None, problem))
        if problem is not None:
            raise CheckpointError(problem[0], reason=problem[1])
        seen = self.gather((self.rank, socket.gethostname(), (root / name).is_file()))
        if self.rank == 0 and probe is not None:
            probe.unlink(missing_ok=True)
        blind = [(rank, host) for rank, host, ok in seen if not ok]
        if blind:
            who = ", ".join(f"rank {rank} on {host}" for rank, host in blind)
            raise CheckpointError(
                f"checkpoint root {root} is not shared between the ranks: {who} cannot see the file "
                f"rank 0 on {seen[0][1]} wrote there. A sharded checkpoint is one directory that every rank "
                "writes into; put the root on a file system all hosts mount (NFS, Lustre, a mounted bucket)."
            )


@dataclass(frozen=True)
class Commit:
    """What the manifest of one save says besides its files."""

    step: int
    layout: Mapping[str, Any]
    started: float
    emergency: bool = False
    notice_id: str | None = None
    metadata: Mapping[str, Any] | None = None
    run: int = 0
    deferred: bool = False  # an emergency save: each rank adds its CRCs after the commit (CRC_SIDECAR)


def commit(
    ranks: Ranks, group: Any, local: CheckpointStore, tmp: Path, what: Commit, checksum: bool
) -> Checkpoint:
    """Every rank makes its own files in ``tmp`` durable and describes them; one gather confirms them all;
    rank 0 writes the manifest and renames ``tmp`` into ``local``'s step directory; a broadcast says whether
    the step is committed. CheckpointError on every rank when it is not."""
    described: list[dict[str, Any]] | str
    try:
        described = describe_own(tmp, ranks.rank, ranks.world_size, checksum)
    except Exception as exc:  # every failure goes to the gather, or the other ranks would wait there forever
        described = f"rank {ranks.rank} on {socket.gethostname()}: {exc}"
    everyone = ranks.gather(described, group)
    failures = [d for d in everyone if isinstance(d, str)]
    if failures:
        raise CheckpointError(f"sharded save of step {what.step} failed: {'; '.join(failures)}")
    outcome: tuple[str, str] = ("", "")
    if ranks.rank == 0:
        try:
            final = local.path_of(what.step)
            doc = manifest(what, everyone, ranks.world_size)
            write_durably(tmp / MANIFEST, json.dumps(doc, indent=1).encode())
            fsync_dir(tmp)
            local._replace(tmp, final)
            fsync_dir(local.root)
            outcome = ("ok", str(final))
        except OSError as exc:
            outcome = ("error", f"rank 0 could not commit step {what.step}: {exc}")
    status, detail = ranks.from_zero(outcome, group)
    if status != "ok":
        raise CheckpointError(detail)
    return Checkpoint.load(Path(detail))


def owner(name: str, world_size: int) -> int:
    """Which rank makes a file durable and checksums it: DCP names a rank's data files ``__<rank>_<n>``;
    everything else (``.metadata``) belongs to rank 0."""
    name = name.rsplit("/", 1)[-1]
    if name.startswith("__"):
        head = name[2:].split("_", 1)[0]
        if head.isdigit() and int(head) < world_size:
            return int(head)
    return 0


def describe_own(directory: Path, rank: int, world_size: int, checksum: bool) -> list[dict[str, Any]]:
    """Fsync (again: cheap after DCP's own fsync, and it covers writers that skip it) and checksum the files
    this rank owns in ``directory``; their entries as plain dicts for the gather."""
    mine = sorted(
        p
        for p in directory.rglob("*")
        if p.is_file() and owner(p.relative_to(directory).as_posix(), world_size) == rank
    )
    entries: list[dict[str, Any]] = []
    with hash_pool(default_hash_workers() + 1) as pool:
        pending: list[tuple[str, int, Future[None], Callable[[], int] | None]] = []
        for path in mine:
            size = path.stat().st_size
            crc = file_crc(pool, path, size) if checksum else None
            pending.append((path.relative_to(directory).as_posix(), size, pool.submit(fsync_file, path), crc))
        for name, size, synced, crc in pending:
            synced.result()
            entry: dict[str, Any] = {"path": name, "bytes": size, "rank": rank}
            if crc is not None:
                entry["crc32"] = crc()
            entries.append(entry)
    return entries


def manifest(what: Commit, everyone: list[Any], world_size: int) -> dict[str, Any]:
    """The manifest document: every rank's files (as gathered), sizes, CRCs, world size and layout."""
    files = sorted((entry for entries in everyone for entry in entries), key=lambda e: e["path"])
    return {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "step": what.step,
        "run": what.run,
        "time": datetime.now(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z"),
        "bytes": sum(int(f["bytes"]) for f in files),
        "emergency": what.emergency,
        "notice_id": what.notice_id,
        "duration_s": round(time.monotonic() - what.started, 6),
        "files": files,
        "checksum": "crc32" if all("crc32" in f for f in files) else "deferred" if what.deferred else None,
        "host": socket.gethostname(),
        "metadata": {**dict(what.metadata or {}), "world_size": world_size},
        "sharded": {
            "writer": "torch.distributed.checkpoint",
            "world_size": world_size,
            "layout": dict(what.layout),
        },
    }


def load_sharded(directory: Path, *, require_dcp: bool = True) -> Checkpoint:
    """The manifest, with the CRCs that ranks added after an emergency commit merged in."""
    checkpoint = Checkpoint.load(directory)
    sums: dict[str, int] = {}
    for sidecar in directory.glob(CRC_SIDECAR.format(rank="*")):
        try:
            sums.update({str(k): int(v) for k, v in json.loads(sidecar.read_bytes()).items()})
        except (OSError, ValueError, AttributeError, TypeError, OverflowError, RecursionError):
            continue  # its files stay without CRCs: the step does not verify at the checksum level
    if sums:
        files = tuple(
            replace(f, crc32=sums[f.path]) if f.crc32 is None and f.path in sums else f
            for f in checkpoint.files
        )
        checkpoint = replace(checkpoint, files=files)
    world_size = checkpoint.metadata.get("world_size", 0)
    if world_size is not None and (
        isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 0
    ):
        raise CheckpointError(
            f"{directory / MANIFEST}: malformed: 'metadata.world_size' must be a whole number, got {world_size!r}"
        )
    if require_dcp and (
        not (directory / DCP_METADATA).is_file() or DCP_METADATA not in {f.path for f in checkpoint.files}
    ):
        raise CheckpointError(f"{directory / DCP_METADATA}: missing (not a committed DCP checkpoint)")
    return checkpoint


def verify_share(checkpoint: Checkpoint, level: Verify, rank: int, world_size: int) -> None:
    """Sizes of every file; CRCs of this rank's share (files spread by index, so the reading is split). At
    the ``checksum`` level a step is refused whose files lack the CRC32s its manifest promised (the ranks'
    sidecars of an emergency save never written) or that holds a DCP file its manifest does not list: either
    file could be damaged without anything telling."""
    if level == "none":
        return
    checkpoint.check_listed(lambda name: not name.endswith(".distcp"))
    checkpoint.verify("size")
    if level != "checksum":
        return
    require_crcs(checkpoint)
    share = tuple(f for index, f in enumerate(checkpoint.files) if index % world_size == rank)
    replace(checkpoint, files=share).verify("checksum")


def require_crcs(checkpoint: Checkpoint) -> None:
    """CheckpointError naming the files without the CRC32 the manifest promised, and the sidecars of the
    ranks that were to add them after an emergency commit (``CRC_SIDECAR``)."""
    unchecked = checkpoint.unchecked()
    if not unchecked:
        return
    saved = int(checkpoint.metadata.get("world_size", 0) or 0) or 1
    sidecars = sorted({CRC_SIDECAR.format(rank=owner(f.path, saved)) for f in unchecked})
    names = ", ".join(f.path for f in unchecked[:4]) + (
        f" and {len(unchecked) - 4} more" if len(unchecked) > 4 else ""
    )
    raise CheckpointError(
        f"{checkpoint.path}: no CRC32 for {names}: {', '.join(sidecars)} missing or unreadable (the emergency "
        "save's deferred checksums were never written: the process ended first), so a damaged shard could "
        "not be detected"
    )


def add_own_checksums(directory: Path, own: list[FileEntry], rank: int) -> None:
    """After an emergency commit: this rank's CRCs into its sidecar (atomic write), so later resumes can
    detect a corrupt shard. A step removed meanwhile is left alone."""
    try:
        doc = file_crcs(directory, {e.path: e.bytes for e in own}, default_hash_workers())
        target = directory / CRC_SIDECAR.format(rank=rank)
        staged = directory / f".{target.name}.tmp"
        write_durably(staged, json.dumps(doc).encode())
        os.rename(staged, target)
        fsync_dir(directory)
    except (OSError, CheckpointError):
        pass


def load_failure(path: Path, exc: BaseException) -> CheckpointError:
    """The CheckpointError for a failed ``dcp.load`` of ``path``: ``mismatch`` when DCP's plan found keys or
    shapes that do not fit the state; else the step cannot be read (its metadata or data: the storage's
    errno when there is one, ``unreadable`` otherwise)."""
    failures = getattr(exc, "failures", None)
    planning = bool(exc.args) and exc.args[0] == "plan" and isinstance(failures, Mapping)
    reading_metadata = isinstance(failures, Mapping) and any(
        frame.name == "read_metadata"
        for value in failures.values()
        if isinstance(value, tuple) and value[1] is not None
        for frame in value[1]
    )
    found = os_error(exc)
    if planning and found is None and not reading_metadata:
        return CheckpointError(
            f"{path} does not match the state to load into: {summary(exc)}", reason="mismatch"
        )
    reason = reason_of(found) if found is not None else "unreadable"
    return CheckpointError(f"{path} cannot be loaded: {summary(exc)}", reason=reason)


def latest_committed(
    root: str | Path, verify: Verify = "checksum", *, require_dcp: bool = True
) -> ShardedCheckpoint | None:
    """The newest committed sharded step under ``root`` that verifies, read by this process alone (every
    file's size and CRC): for choosing a resume path before the process group exists (Lightning's
    ``ckpt_path``). Skipped steps raise a CheckpointWarning naming the step and the file (and when none is
    left, one more lists them)."""
    local = CheckpointStore(root, keep=0, report=False)

    skipped = Skipped(local.root)
    for step in local.steps():
        try:
            checkpoint = load_sharded(local.path_of(step), require_dcp=require_dcp)
            verify_share(checkpoint, verify, 0, 1)
        except CheckpointError as exc:
            skipped.add(f"step {step}", exc)
            continue
        return ShardedCheckpoint(checkpoint, int(checkpoint.metadata.get("world_size", 0) or 0))
    skipped.none_left()
    return None
