"""Files made durable and checksummed: :func:`seal` (fsync a directory of finished files while their CRC32s
are computed, then write its manifest), :class:`DurableFile` (a file written back and checksummed *while* it is
written), the fsync helpers and the deferred checksums of an emergency save. The checkpoint stores
(:mod:`agent.client.store`, :mod:`agent.client.dcp`), the framework callbacks and the RAM tier's drain build
on them; the manifest format and the CRC arithmetic itself are :mod:`agent.checkpoint.manifest`'s. Standard
library only.
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from contextvars import ContextVar
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from agent.checkpoint.manifest import (
    FORMAT,
    FORMAT_VERSION,
    HASH_PIECE,
    MANIFEST,
    Checkpoint,
    CheckpointError,
    FileEntry,
    crc32_combine,
    crc_fd_range,
    default_hash_workers,
    file_crc,
    file_crcs,
)

# Whether files written for the save in progress should be checksummed now (see DurableFile): the store sets
# it around its writer, so a deferred emergency save's DurableFile skips the CRC.
CHECKSUM_NOW: ContextVar[bool] = ContextVar("preemptd_checksum_now", default=True)


# How long the exit waits, in all, for deferred checksums still running (as ``close()`` would): a step whose
# deferred CRCs were never written does not verify, so a resume would skip it for the one before.
EXIT_WAIT_S = 10.0


class ChecksumThreads:
    """The deferred-checksum threads of a store (one per emergency save): started once the data is durable,
    waited for before the process exits (``close()``; else at exit, up to :data:`EXIT_WAIT_S`)."""

    def __init__(self) -> None:
        self._threads: list[threading.Thread] = []

    def start(self, name: str, target: Callable[..., None], *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)
        with _lock:  # held here, not by the store: a store dropped before the exit is waited for too
            _running[:] = [t for t in _running if t.is_alive()] + [thread]

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


_running: list[threading.Thread] = []
_lock = threading.Lock()


@atexit.register
def _wait_at_exit() -> None:
    end = time.monotonic() + EXIT_WAIT_S
    with _lock:
        running = list(_running)
    for thread in running:
        thread.join(max(0.0, end - time.monotonic()))


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
    deferred: bool = False,
) -> Checkpoint:
    """Make a directory of finished files durable and describe it: fsync every file (checksumming them at the
    same time on a thread pool), write the manifest last, fsync the directories. Used by the store before its
    rename, and by callbacks whose framework writes checkpoint directories itself.

    ``presealed`` maps relative paths to the entries of files already made durable and checksummed while
    they were written (:class:`DurableFile`); only their sizes are checked here. ``deferred`` (without
    ``checksum``): the CRCs will be added after the commit (:func:`add_checksums`), and until they are, the
    step does not verify at the ``checksum`` level (the manifest says ``"checksum": "deferred"``)."""
    paths = sorted(
        p for p in directory.rglob("*") if p.is_file() and not p.is_symlink() and p.name != manifest
    )
    if not paths:
        raise CheckpointError(f"the writer put no files into {directory}")
    files = _sync_files(
        directory, paths, dict(presealed or {}), checksum, hash_workers or default_hash_workers()
    )
    for sub in sorted({p.parent for p in paths if p.parent != directory}, key=lambda p: -len(p.parts)):
        fsync_dir(sub)
    now = datetime.now(timezone.utc)
    total = sum(f.bytes for f in files)
    # A file a writer sealed without its CRC (DurableFile(checksum=False)) leaves the step by sizes alone.
    marker = "crc32" if all(f.crc32 is not None for f in files) else "deferred" if deferred else None
    checkpoint = Checkpoint(
        step=step,
        path=directory,
        time=now,
        bytes=total,
        files=tuple(files),
        emergency=emergency,
        notice_id=notice_id,
        duration_s=round(time.monotonic() - started, 6) if started is not None else None,
        metadata=dict(metadata or {}),
        run=run,
        checksum=marker,
    )
    write_durably(directory / manifest, json.dumps(_manifest_doc(checkpoint), indent=1).encode())
    fsync_dir(directory)
    return checkpoint


def _sync_files(
    directory: Path, paths: list[Path], done: dict[str, FileEntry], checksum: bool, workers: int
) -> list[FileEntry]:
    """The entries of ``paths`` (under ``directory``), each fsynced and, with ``checksum``, checksummed on a
    thread pool; a file in ``done`` was sealed while it was written and only its size is checked."""
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
    return files


def _manifest_doc(checkpoint: Checkpoint) -> dict[str, Any]:
    """The manifest that describes ``checkpoint``, as JSON values."""
    return {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "step": checkpoint.step,
        "run": checkpoint.run,
        "time": checkpoint.time.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
        "bytes": checkpoint.bytes,
        "emergency": checkpoint.emergency,
        "notice_id": checkpoint.notice_id,
        "duration_s": checkpoint.duration_s,
        "files": [
            {"path": f.path, "bytes": f.bytes, **({"crc32": f.crc32} if f.crc32 is not None else {})}
            for f in checkpoint.files
        ],
        "checksum": checkpoint.checksum,
        "host": socket.gethostname(),
        "metadata": dict(checkpoint.metadata),
    }


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


def write_durably(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def add_checksums(directory: Path, workers: int) -> None:
    """Add the CRCs an emergency save deferred to its manifest (an atomic rewrite). A checkpoint removed or
    replaced meanwhile is left alone."""
    path = directory / MANIFEST
    try:
        doc = json.loads(path.read_text())
        lacking = {f["path"]: int(f["bytes"]) for f in doc["files"] if f.get("crc32") is None}
        sums = file_crcs(directory, lacking, workers)  # also while the process exits (see _wait_at_exit)
        for entry in doc["files"]:
            if entry["path"] in sums:
                entry["crc32"] = sums[entry["path"]]
        doc["checksum"] = "crc32"
        staged = directory / (MANIFEST + ".tmp")
        write_durably(staged, json.dumps(doc, indent=1).encode())
        os.rename(staged, path)
        fsync_dir(directory)
    except (OSError, ValueError, KeyError, CheckpointError):
        pass


def _known(value: int | None) -> Callable[[], int | None]:
    return lambda: value


def presealed(written: Any) -> dict[str, FileEntry]:
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
        self.checksum = checksum if checksum is not None else CHECKSUM_NOW.get()
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
