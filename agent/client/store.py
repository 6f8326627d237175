"""The checkpoint store: atomic, durable, format-agnostic checkpoint directories with a manifest.

``save(step, writer)`` gives ``writer`` a fresh temporary directory to fill with any files, then fsyncs them
(checksumming in parallel with the fsync), writes ``manifest.json``, renames the directory to ``step-N`` and
fsyncs the parent: a checkpoint either exists whole or not at all. ``latest()`` finds the newest checkpoint that
verifies, skipping incomplete, corrupt or malformed ones with a :class:`CheckpointWarning`. "Newest" is by run,
then step: a save of a step lower than the newest one starts a new run that outranks the older one (see
:meth:`CheckpointStore.save`). Every failure to save or read is a :class:`CheckpointError` naming its cause.
Each save is reported to the agent (started, finished or failed) so the advisor learns what a checkpoint costs.

The manifest and its verification live in :mod:`agent.client.manifest`, the reading of a failure's cause in
:mod:`agent.client.store_failure`. Over 450 lines because saving (with :class:`DurableFile`), resuming and
pruning share the store's directory layout and its invariants, which are kept in one place.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from contextvars import ContextVar
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TypeVar

from agent.client.manifest import (
    FORMAT,
    FORMAT_VERSION,
    HASH_PIECE,
    MANIFEST,
    Checkpoint,
    CheckpointError,
    CheckpointWarning,
    FileEntry,
    Verify,
    crc32_combine,
    crc_fd_range,
    default_hash_workers,
    file_crc,
    reason_of,
    run_of,
)
from agent.client.preempted import record_emergency
from agent.client.reporting import Reporter
from agent.client.store_failure import convertible, fall_back, free_bytes, save_failure

# What other modules (and users) import from here: the on-disk format comes from agent.client.manifest.
__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "HASH_PIECE",
    "MANIFEST",
    "Checkpoint",
    "CheckpointError",
    "CheckpointStore",
    "CheckpointWarning",
    "ChecksumThreads",
    "DurableFile",
    "FileEntry",
    "Verify",
    "Writer",
    "crc32_combine",
    "fsync_dir",
    "fsync_file",
    "loaded_only",
    "seal",
    "valid_only",
]

_STEP_DIR = re.compile(r"^step-(\d+)$")
_TMP_PREFIX = ".tmp-"
_TRASH_PREFIX = ".trash-"

Writer = Callable[[Path], Any]
# Whether files written for the save in progress should be checksummed now (see DurableFile).
_CHECKSUM_NOW: ContextVar[bool] = ContextVar("preemptd_checksum_now", default=True)
_Loaded = TypeVar("_Loaded")


class ChecksumThreads:
    """The deferred-checksum threads of a store (one per emergency save): started once the data is durable,
    waited for before the process exits."""

    def __init__(self) -> None:
        self._threads: list[threading.Thread] = []

    def start(self, name: str, target: Callable[..., None], *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    def join_named(self, name: str) -> None:
        for thread in self._threads:
            if thread.name == name:
                thread.join()

    def wait(self, timeout: float | None = None) -> bool:
        """Join them all, bounded by ``timeout`` in all; False if some are still running."""
        end = None if timeout is None else time.monotonic() + timeout
        for thread in self._threads:
            thread.join(None if end is None else max(0.0, end - time.monotonic()))
        self._threads = [t for t in self._threads if t.is_alive()]
        return not self._threads


class CheckpointStore:
    """Checkpoints under ``root`` as ``step-<N>`` directories; keeps the newest ``keep`` (0 keeps all).

    ``checksum=False`` skips CRCs (sizes are still recorded and checked). With ``defer_emergency_checksum``
    an emergency save returns as soon as its data is durable and the CRCs are added to its manifest on a
    background thread (an atomic manifest rewrite; :meth:`wait_checksums` or :meth:`close` waits for them):
    inside a notice window durability comes first. ``reporter`` sends save reports to the agent; pass
    ``report=False`` for none.
    """

    def __init__(
        self,
        root: str | Path,
        keep: int = 3,
        *,
        checksum: bool = True,
        reporter: Reporter | None = None,
        report: bool = True,
        socket_path: str | Path | None = None,
        hash_workers: int | None = None,
        defer_emergency_checksum: bool = True,
    ) -> None:
        if keep < 0:
            raise ValueError(f"keep must be 0 (keep all) or more, got {keep}")
        self.root = Path(root)
        self.keep = keep
        self.checksum = checksum
        self.reporter = reporter if reporter is not None or not report else Reporter(socket_path)
        self.hash_workers = hash_workers or default_hash_workers()
        self.defer_emergency_checksum = defer_emergency_checksum
        self.last_save: Checkpoint | None = None
        self._checksummers = ChecksumThreads()
        self._runs: dict[str, tuple[tuple[int, int, int], int | None]] = {}
        self._new_run = False

    # -- saving -----------------------------------------------------------------------------------------

    def save(
        self,
        step: int,
        writer: Writer,
        *,
        emergency: bool = False,
        notice_id: str | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> Checkpoint:
        """Write a checkpoint for ``step`` atomically; ``writer(directory)`` puts the files in it.

        Returns when the checkpoint is durable (files, manifest and the rename are fsynced). An existing
        checkpoint of the same step is replaced. A step lower than the newest committed one starts a new run
        in the root (with a :class:`CheckpointWarning`): its steps outrank the earlier run's, so a resume
        loads them and pruning removes the earlier run's first.

        On failure the temporary directory is removed, a ``failed`` report is sent and
        :class:`CheckpointError` is raised naming the cause (no space: how much was free and what the save
        used; permission; I/O error), the original exception chained. A failed emergency save falls back to
        the newest earlier committed checkpoint when there is one: it is recorded for ``preemptd exec`` (which
        then exits 75), reported with the failure, and set as the error's ``fallback``.
        """
        if step < 0:
            raise ValueError(f"step must be non-negative, got {step}")
        started = time.monotonic()
        self._report("started", step, emergency=emergency, notice_id=notice_id)
        tmp = self.root / f"{_TMP_PREFIX}{_owner_tag()}-{uuid.uuid4().hex[:8]}"
        defer = emergency and self.checksum and self.defer_emergency_checksum
        checksum_now = self.checksum and not defer
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            run = self.run_for(step)
        except OSError as exc:
            self._report("failed", step, emergency=emergency, notice_id=notice_id)
            raise save_failure(exc, step, self.root, None, None, self.newest) from exc
        except CheckpointError:  # the root cannot be listed: it says so already
            self._report("failed", step, emergency=emergency, notice_id=notice_id)
            raise
        free_before = free_bytes(self.root)
        try:
            tmp.mkdir()
            token = _CHECKSUM_NOW.set(checksum_now)
            try:
                written = writer(tmp)
            finally:
                _CHECKSUM_NOW.reset(token)
            sealed = seal(
                tmp,
                step,
                checksum=checksum_now,
                hash_workers=self.hash_workers,
                emergency=emergency,
                notice_id=notice_id,
                metadata=metadata,
                started=started,
                presealed=_presealed(written),
                run=run,
            )
            final = self.path_of(step)
            # A deferred checksum of this step still running would write the old manifest into the new one.
            self._checksummers.join_named(f"preemptd-checksum {final.name}")
            self._replace(tmp, final)
            fsync_dir(self.root)
        except BaseException as exc:
            if not convertible(exc):  # an interrupt or exit: not a storage failure, passed on as it is
                shutil.rmtree(tmp, ignore_errors=True)
                self._report("failed", step, emergency=emergency, notice_id=notice_id)
                raise
            error = save_failure(exc, step, self.root, tmp, free_before, self.newest)
            shutil.rmtree(tmp, ignore_errors=True)
            flush = None
            if emergency:
                error.fallback = fall_back(self.committed, step, notice_id, error, sharded=False)
                flush = {"fallback_step": error.fallback.step} if error.fallback is not None else None
            self._report("failed", step, emergency=emergency, notice_id=notice_id, flush=flush)
            raise error from exc
        duration = time.monotonic() - started
        checkpoint = replace(sealed, path=final, duration_s=duration)
        self.last_save = checkpoint
        self._new_run = False
        if emergency:  # durable now: `preemptd exec` may turn the launcher's failure into 75
            record_emergency(step, path=final, notice_id=notice_id)
        self._report(
            "finished",
            step,
            duration_s=duration,
            size=checkpoint.bytes,
            emergency=emergency,
            notice_id=notice_id,
            path=final,
        )
        if defer:
            self._checksummers.start(
                f"preemptd-checksum {final.name}", _add_checksums, final, self.hash_workers
            )
        if not emergency:  # never spend a notice window deleting old checkpoints: the next save prunes
            self.prune(protect=final)
        return checkpoint

    def wait_checksums(self, timeout: float | None = None) -> bool:
        """Wait for deferred checksums (bounded by ``timeout`` in all); False if some are still running."""
        return self._checksummers.wait(timeout)

    def close(self, timeout: float = 10.0) -> None:
        """Before exit: finish deferred checksums and deliver queued reports, each bounded by ``timeout``."""
        self.wait_checksums(timeout)
        if self.reporter is not None:
            self.reporter.close(timeout)

    def _replace(self, tmp: Path, final: Path) -> None:
        if final.exists():
            trash = self.root / f"{_TRASH_PREFIX}{final.name}-{uuid.uuid4().hex[:8]}"
            os.rename(final, trash)
            os.rename(tmp, final)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.rename(tmp, final)

    def _report(self, phase: str, step: int, **fields: Any) -> None:
        if self.reporter is not None:
            self.reporter.checkpoint(phase, step, **fields)

    # -- listing, resuming, pruning ---------------------------------------------------------------------

    def steps(self) -> list[int]:
        """Steps of the committed checkpoint directories, newest first: the latest run first, then by step
        (not verified; a step whose manifest cannot be read is placed in the latest run, so that a resume
        warns about it)."""
        return [step for _run, step in self._ordered()]

    def _ordered(self) -> list[tuple[int, int]]:
        """(run, step) of every step directory, newest first."""
        found = self._scan()
        latest = max((run for run, _step in found if run is not None), default=0)
        return sorted(((latest if run is None else run, step) for run, step in found), reverse=True)

    def _scan(self) -> list[tuple[int | None, int]]:
        """(run, step) of every step directory; the run is None where the manifest cannot be read."""
        try:
            entries = list(self.root.iterdir())
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise CheckpointError(
                f"{self.root}: cannot list the checkpoint root ({exc.strerror})", reason=reason_of(exc)
            ) from exc
        found = []
        for entry in entries:
            match = _STEP_DIR.match(entry.name)
            if match and entry.is_dir():
                found.append((self._run_of(entry), int(match.group(1))))
        return found

    def _run_of(self, directory: Path) -> int | None:
        """run_of, remembered while the manifest stays the same file (a root that keeps every step would
        otherwise have every manifest read again at each save)."""
        try:
            stat = (directory / MANIFEST).stat()
        except OSError:
            return None
        key = (stat.st_ino, stat.st_mtime_ns, stat.st_size)
        known = self._runs.get(directory.name)
        if known is not None and known[0] == key:
            return known[1]
        run = run_of(directory)
        self._runs[directory.name] = (key, run)
        return run

    def start_run(self) -> None:
        """Make the next save start a new run in this root, whatever its step and without a warning: for a
        job that trains from scratch (it does not resume) where an earlier run left its steps. That run's
        steps are then older than every step of the new one."""
        self._new_run = True

    def run_for(self, step: int) -> int:
        """The run a save of ``step`` belongs to: the newest committed step's, or the next one (with a
        CheckpointWarning) when ``step`` is lower than that step, since a new run is then starting here."""
        newest = max(((run, at) for run, at in self._scan() if run is not None), default=None)
        if self._new_run:  # until a save of the new run is committed
            return 0 if newest is None else newest[0] + 1
        if newest is None or step >= newest[1]:
            return 0 if newest is None else newest[0]
        run, at = newest
        warnings.warn(
            f"saving step {step} into {self.root}, whose newest checkpoint is step {at}: this starts run "
            f"{run + 1} there, whose steps a resume prefers to the earlier run's (those are pruned first). "
            "If that root belongs to another job, stop and give this one its own checkpoint root; if this job "
            "starts afresh there on purpose, call start_run() before its first save.",
            CheckpointWarning,
            stacklevel=3,
        )
        return run + 1

    def path_of(self, step: int) -> Path:
        return self.root / f"step-{step:012d}"

    def committed(self) -> list[Path]:
        """The committed step directories, newest first (not verified)."""
        return [self.path_of(step) for step in self.steps()]

    def get(self, step: int, verify: Verify = "checksum") -> Checkpoint:
        """The checkpoint of ``step``, verified; CheckpointError when it is missing, incomplete or corrupt."""
        checkpoint = Checkpoint.load(self.path_of(step))
        if checkpoint.step != step:
            raise CheckpointError(f"{checkpoint.path}: the manifest says step {checkpoint.step}")
        checkpoint.verify(verify, self.hash_workers)
        return checkpoint

    def checkpoints(self, verify: Verify = "checksum") -> Iterator[Checkpoint]:
        """Valid checkpoints, newest first; invalid ones are skipped with a CheckpointWarning."""
        return valid_only(self.steps(), lambda step: self.get(step, verify))

    def latest(self, verify: Verify = "checksum") -> Checkpoint | None:
        """The newest checkpoint that verifies, or None; skipped ones raise a CheckpointWarning each."""
        return next(self.checkpoints(verify), None)

    def load_latest(
        self, load: Callable[[Checkpoint], _Loaded], verify: Verify = "checksum"
    ) -> tuple[Checkpoint, _Loaded] | None:
        """The newest checkpoint that verifies *and* loads, with what ``load(checkpoint)`` returned (e.g.
        :func:`agent.client.torch.load_torch`); None when there is none. A checkpoint whose ``load`` raises
        CheckpointError (other than a ``mismatch``) is skipped with a CheckpointWarning like one that fails
        verification: an emergency step whose deferred CRCs were never written verifies by size alone."""
        return next(loaded_only(self.checkpoints(verify), load), None)

    def newest(self) -> Checkpoint | None:
        """The newest committed checkpoint whose manifest reads, not verified (for figures and fallbacks);
        None when there is none or the root cannot be listed."""
        try:
            committed = self.committed()
        except CheckpointError:
            return None
        for directory in committed:
            try:
                return Checkpoint.load(directory)
            except CheckpointError:
                continue
        return None

    def prune(self, protect: Path | None = None) -> list[Path]:
        """Remove checkpoints beyond the newest ``keep``, and temporary directories this host's dead
        processes left behind; never ``protect`` (the step just committed). Returns what was removed."""
        removed: list[Path] = []
        if self.keep:
            for step in self.steps()[self.keep :]:
                victim = self.path_of(step)
                if victim == protect:
                    continue
                trash = self.root / f"{_TRASH_PREFIX}{victim.name}-{uuid.uuid4().hex[:8]}"
                try:
                    os.rename(victim, trash)  # atomic: never seen half-deleted as a checkpoint
                except OSError:
                    continue
                shutil.rmtree(trash, ignore_errors=True)
                removed.append(victim)
        if self.root.is_dir():
            for entry in self.root.iterdir():
                if entry.name.startswith(_TRASH_PREFIX) or (
                    entry.name.startswith(_TMP_PREFIX) and _abandoned(entry.name)
                ):
                    shutil.rmtree(entry, ignore_errors=True)
                    removed.append(entry)
        return removed


# -- helpers ----------------------------------------------------------------------------------------------


_Key = TypeVar("_Key")
_Found = TypeVar("_Found")


def valid_only(keys: Iterable[_Key], get: Callable[[_Key], _Found]) -> Iterator[_Found]:
    """``get(key)`` for each key in order, skipping each one whose checkpoint raises CheckpointError with a
    CheckpointWarning that names the file: the resume rule of every store and callback."""
    for key in keys:
        try:
            found = get(key)
        except CheckpointError as exc:
            warnings.warn(f"skipping checkpoint: {exc}", CheckpointWarning, stacklevel=3)
            continue
        yield found


def loaded_only(
    found: Iterable[_Found], load: Callable[[_Found], _Loaded]
) -> Iterator[tuple[_Found, _Loaded]]:
    """Each checkpoint with what ``load`` made of it, skipping (with a CheckpointWarning) those whose load
    fails as storage (CheckpointError); a ``mismatch`` (the state does not fit) is raised, as every older
    step would not fit either."""
    for checkpoint in found:
        try:
            loaded = load(checkpoint)
        except CheckpointError as exc:
            if exc.reason == "mismatch":
                raise
            warnings.warn(f"skipping checkpoint: {exc}", CheckpointWarning, stacklevel=3)
            continue
        yield checkpoint, loaded


def seal(
    directory: Path,
    step: int,
    *,
    manifest: str = MANIFEST,
    checksum: bool = True,
    hash_workers: int | None = None,
    emergency: bool = False,
    notice_id: str | None = None,
    metadata: Mapping[str, Any] | None = None,
    started: float | None = None,
    presealed: Mapping[str, FileEntry] | None = None,
    run: int = 0,
) -> Checkpoint:
    """Make a directory of finished files durable and describe it: fsync every file (checksumming them at the
    same time on a thread pool), write the manifest last, fsync the directories. Used by the store before its
    rename, and by callbacks whose framework writes checkpoint directories itself.

    ``presealed`` maps relative paths to the entries of files already made durable and checksummed while
    they were written (:class:`DurableFile`); only their sizes are checked here."""
    paths = sorted(
        p for p in directory.rglob("*") if p.is_file() and not p.is_symlink() and p.name != manifest
    )
    if not paths:
        raise CheckpointError(f"the writer put no files into {directory}")
    done = dict(presealed or {})
    workers = hash_workers or default_hash_workers()
    with ThreadPoolExecutor(max_workers=workers + 1) as pool:
        pending: list[tuple[str, int, Future[None] | None, Callable[[], int | None]]] = []
        for path in paths:
            name = path.relative_to(directory).as_posix()
            size = path.stat().st_size
            entry = done.get(name)
            if entry is not None:
                if entry.bytes != size:
                    raise CheckpointError(f"{path}: {size} bytes on disk, {entry.bytes} written")
                pending.append((name, size, None, _known(entry.crc32)))
                continue
            synced: Future[None] = pool.submit(fsync_file, path)
            crc: Callable[[], int | None] = file_crc(pool, path, size) if checksum else _known(None)
            pending.append((name, size, synced, crc))
        files = []
        for name, size, sync, checksum_of in pending:
            if sync is not None:
                sync.result()
            files.append(FileEntry(name, size, checksum_of()))
    for sub in sorted({p.parent for p in paths if p.parent != directory}, key=lambda p: -len(p.parts)):
        fsync_dir(sub)
    now = datetime.now(timezone.utc)
    total = sum(f.bytes for f in files)
    duration = round(time.monotonic() - started, 6) if started is not None else None
    doc = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "step": step,
        "run": run,
        "time": now.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
        "bytes": total,
        "emergency": emergency,
        "notice_id": notice_id,
        "duration_s": duration,
        "files": [
            {"path": f.path, "bytes": f.bytes, **({"crc32": f.crc32} if f.crc32 is not None else {})}
            for f in files
        ],
        "checksum": "crc32" if checksum else None,
        "host": socket.gethostname(),
        "metadata": dict(metadata or {}),
    }
    _write_durably(directory / manifest, json.dumps(doc, indent=1).encode())
    fsync_dir(directory)
    return Checkpoint(
        step=step,
        path=directory,
        time=now,
        bytes=total,
        files=tuple(files),
        emergency=emergency,
        notice_id=notice_id,
        duration_s=duration,
        metadata=dict(metadata or {}),
        run=run,
    )


def _owner_tag() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


def _abandoned(name: str) -> bool:
    """Whether a temporary directory belongs to a process of this host that is gone."""
    rest = name[len(_TMP_PREFIX) :]
    host, _, _tail = rest.rpartition("-")  # tail: the random suffix
    host, _, pid_text = host.rpartition("-")
    if host != socket.gethostname() or not pid_text.isdigit():
        return False
    pid = int(pid_text)
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def _fsync(path: Path, flags: int) -> None:
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    """Flush a file's data to disk."""
    _fsync(path, os.O_RDONLY)


def fsync_dir(path: Path) -> None:
    """Flush a directory's entries (a rename or a new file in it) to disk."""
    _fsync(path, os.O_RDONLY | os.O_DIRECTORY)


def _write_durably(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def _add_checksums(directory: Path, workers: int) -> None:
    """Add the CRCs an emergency save deferred to its manifest (an atomic rewrite). A checkpoint removed or
    replaced meanwhile is left alone."""
    path = directory / MANIFEST
    try:
        doc = json.loads(path.read_text())
        with ThreadPoolExecutor(max_workers=workers) as pool:
            sums = {
                f["path"]: file_crc(pool, directory / f["path"], int(f["bytes"]))
                for f in doc["files"]
                if f.get("crc32") is None
            }
            for entry in doc["files"]:
                if entry["path"] in sums:
                    entry["crc32"] = sums[entry["path"]]()
        doc["checksum"] = "crc32"
        staged = directory / (MANIFEST + ".tmp")
        _write_durably(staged, json.dumps(doc, indent=1).encode())
        os.rename(staged, path)
        fsync_dir(directory)
    except (OSError, ValueError, KeyError, CheckpointError):
        pass


def _known(value: int | None) -> Callable[[], int | None]:
    return lambda: value


def _presealed(written: Any) -> dict[str, FileEntry]:
    """What a writer returned about the files it sealed itself: a mapping of relative path to FileEntry."""
    if not isinstance(written, Mapping):
        return {}
    return {str(k): v for k, v in written.items() if isinstance(v, FileEntry)}


class DurableFile:
    """A write-only binary file that is written back to disk and checksummed *while* it is being written.

    For writers that stream one large file (``torch.save`` into a file object): every ``piece`` bytes, a
    background thread starts writeback (``fdatasync``) and another computes that piece's CRC from the page
    cache, so the final fsync and the checksum cost little after the last write. Return
    ``{name: handle.entry}`` from the writer so the store does not fsync or hash the file again::

        def writer(directory):
            with DurableFile(directory / "state.pt") as handle:
                torch.save(state, handle)
            return {"state.pt": handle.entry}
    """

    def __init__(
        self,
        path: str | Path,
        *,
        checksum: bool | None = None,
        piece: int | None = None,
        workers: int | None = None,
    ) -> None:
        self.path = Path(path)
        # None: as the store's save in progress wants (no CRC now for a deferred emergency save), else yes.
        self.checksum = checksum if checksum is not None else _CHECKSUM_NOW.get()
        self._piece = piece or HASH_PIECE
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self._read_fd = os.open(self.path, os.O_RDONLY)
        self._hashers = ThreadPoolExecutor(
            max_workers=workers or default_hash_workers(), thread_name_prefix="crc"
        )
        self._flusher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="writeback")
        self._size = 0
        self._cut = 0
        self._pieces: list[tuple[Future[int], int]] = []
        self._sync: Future[None] | None = None
        self._closed = False
        self.entry: FileEntry | None = None

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data)
        if view.ndim != 1 or view.format != "B":
            view = view.cast("B")
        total = len(view)
        while view:
            view = view[os.write(self._fd, view) :]
        self._size += total
        while self._size - self._cut >= self._piece:
            self._submit(self._cut, self._piece)
        return total

    def flush(self) -> None:
        """Nothing is buffered in user space; durability comes with :meth:`close`."""

    def tell(self) -> int:
        return self._size

    def _submit(self, offset: int, length: int) -> None:
        if self.checksum:
            self._pieces.append((self._hashers.submit(crc_fd_range, self._read_fd, offset, length), length))
        if self._sync is None or self._sync.done():
            if self._sync is not None:
                self._sync.result()
            self._sync = self._flusher.submit(os.fdatasync, self._fd)
        self._cut = offset + length

    def close(self) -> FileEntry:
        """Finish the checksum, fsync the file and return its entry (name, size, CRC)."""
        if self.entry is not None:
            return self.entry
        try:
            if self._size > self._cut or self._size == 0:
                self._submit(self._cut, self._size - self._cut)
            crc = 0
            for piece, length in self._pieces:
                crc = crc32_combine(crc, piece.result(), length)
            if self._sync is not None:
                self._sync.result()
            os.fsync(self._fd)
            self.entry = FileEntry(self.path.name, self._size, crc if self.checksum else None)
            return self.entry
        finally:
            self._release()

    def _release(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._hashers.shutdown(wait=True, cancel_futures=True)
        self._flusher.shutdown(wait=True)
        os.close(self._read_fd)
        os.close(self._fd)

    def __enter__(self) -> DurableFile:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self._release()
