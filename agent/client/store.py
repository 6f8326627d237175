"""The checkpoint store: atomic, durable, format-agnostic checkpoint directories with a manifest.

``save(step, writer)`` gives ``writer`` a fresh temporary directory to fill with any files, then fsyncs them
(checksumming in parallel with the fsync), writes ``manifest.json``, renames the directory to ``step-N`` and
fsyncs the parent: a checkpoint either exists whole or not at all. ``latest()`` finds the newest checkpoint that
verifies, skipping incomplete or corrupt ones with a :class:`CheckpointWarning`. Each save is reported to the
agent (started, finished or failed) so the advisor learns what a checkpoint costs.

Over 450 lines because saving, verifying, resuming and pruning share the on-disk format and its
invariants, which are kept in one place.
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
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from contextvars import ContextVar
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal, TypeVar

from agent.client.preempted import record_emergency
from agent.client.reporting import Reporter

MANIFEST = "manifest.json"
FORMAT = "preemptd-checkpoint"
FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"^step-(\d+)$")
_TMP_PREFIX = ".tmp-"
_TRASH_PREFIX = ".trash-"
_READ_BLOCK = 8 * 1024 * 1024
# Large files are checksummed in pieces of this size on several threads; the CRCs are combined after.
HASH_PIECE = 64 * 1024 * 1024

Writer = Callable[[Path], Any]
# Whether files written for the save in progress should be checksummed now (see DurableFile).
_CHECKSUM_NOW: ContextVar[bool] = ContextVar("preemptd_checksum_now", default=True)
Verify = Literal["checksum", "size", "none"]


class CheckpointWarning(UserWarning):
    """A checkpoint was skipped on resume because it is incomplete or corrupt."""


class CheckpointError(Exception):
    """A checkpoint cannot be read or verified; the message says which file and why."""


@dataclass(frozen=True)
class FileEntry:
    path: str
    bytes: int
    crc32: int | None = None


@dataclass(frozen=True)
class Checkpoint:
    """A committed checkpoint directory and its manifest."""

    step: int
    path: Path
    time: datetime
    bytes: int
    files: tuple[FileEntry, ...]
    emergency: bool = False
    notice_id: str | None = None
    duration_s: float | None = None
    metadata: Mapping[str, Any] = field(default_factory=dict)

    def file(self, name: str) -> Path:
        return self.path / name

    @classmethod
    def load(cls, directory: Path, manifest: str = MANIFEST) -> Checkpoint:
        """Read the manifest of ``directory``; CheckpointError when it is missing or malformed."""
        try:
            doc = json.loads((directory / manifest).read_text())
        except FileNotFoundError as exc:
            raise CheckpointError(f"{directory}: no {manifest} (incomplete checkpoint)") from exc
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"{directory / manifest}: unreadable: {exc}") from exc
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise CheckpointError(f"{directory / manifest}: not a {FORMAT} manifest")
        try:
            files = tuple(
                FileEntry(str(f["path"]), int(f["bytes"]), f.get("crc32")) for f in doc.get("files", [])
            )
            return cls(
                step=int(doc["step"]),
                path=directory,
                time=datetime.fromisoformat(str(doc["time"]).replace("Z", "+00:00")),
                bytes=int(doc["bytes"]),
                files=files,
                emergency=bool(doc.get("emergency", False)),
                notice_id=doc.get("notice_id"),
                duration_s=doc.get("duration_s"),
                metadata=doc.get("metadata") or {},
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{directory / manifest}: malformed: {exc!r}") from exc

    def verify(self, level: Verify = "checksum", workers: int | None = None) -> None:
        """Check every file's presence and size (and CRC for ``checksum``); CheckpointError when one fails."""
        if level == "none":
            return
        for entry in self.files:
            target = self.path / entry.path
            try:
                size = target.stat().st_size
            except OSError as exc:
                raise CheckpointError(f"{target}: missing ({exc.strerror})") from exc
            if size != entry.bytes:
                raise CheckpointError(f"{target}: {size} bytes, the manifest says {entry.bytes}")
        if level != "checksum":
            return
        with ThreadPoolExecutor(max_workers=workers or _hash_workers()) as pool:
            sums = {
                e.path: _file_crc(pool, self.path / e.path, e.bytes)
                for e in self.files
                if e.crc32 is not None
            }
            for entry in self.files:
                if entry.crc32 is not None and sums[entry.path]() != entry.crc32:
                    raise CheckpointError(f"{self.path / entry.path}: checksum mismatch (corrupt)")


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
        self.hash_workers = hash_workers or _hash_workers()
        self.defer_emergency_checksum = defer_emergency_checksum
        self.last_save: Checkpoint | None = None
        self._checksummers = ChecksumThreads()

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
        checkpoint of the same step is replaced. On failure the temporary directory is removed, a ``failed``
        report is sent and the exception propagates.
        """
        if step < 0:
            raise ValueError(f"step must be non-negative, got {step}")
        started = time.monotonic()
        self._report("started", step, emergency=emergency, notice_id=notice_id)
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f"{_TMP_PREFIX}{_owner_tag()}-{uuid.uuid4().hex[:8]}"
        defer = emergency and self.checksum and self.defer_emergency_checksum
        checksum_now = self.checksum and not defer
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
            )
            final = self.root / f"step-{step:012d}"
            # A deferred checksum of this step still running would write the old manifest into the new one.
            self._checksummers.join_named(f"preemptd-checksum {final.name}")
            self._replace(tmp, final)
            fsync_dir(self.root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            self._report("failed", step, emergency=emergency, notice_id=notice_id)
            raise
        duration = time.monotonic() - started
        checkpoint = replace(sealed, path=final, duration_s=duration)
        self.last_save = checkpoint
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
            self.prune()
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
        """Steps of the committed checkpoint directories, newest first (not verified)."""
        if not self.root.is_dir():
            return []
        found = []
        for entry in self.root.iterdir():
            match = _STEP_DIR.match(entry.name)
            if match and entry.is_dir():
                found.append(int(match.group(1)))
        return sorted(found, reverse=True)

    def path_of(self, step: int) -> Path:
        return self.root / f"step-{step:012d}"

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

    def prune(self) -> list[Path]:
        """Remove checkpoints beyond the newest ``keep``, and temporary directories this host's dead
        processes left behind. Returns what was removed."""
        removed: list[Path] = []
        if self.keep:
            for step in self.steps()[self.keep :]:
                victim = self.path_of(step)
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
    workers = hash_workers or _hash_workers()
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
            crc: Callable[[], int | None] = _file_crc(pool, path, size) if checksum else _known(None)
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
    )


def _hash_workers() -> int:
    return max(1, min(8, os.cpu_count() or 1))


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


def _crc_range(path: Path, offset: int, length: int) -> int:
    crc = 0
    buffer = bytearray(min(_READ_BLOCK, max(length, 1)))
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as handle:
        handle.seek(offset)
        left = length
        while left > 0:
            got = handle.readinto(view[: min(left, len(buffer))])
            if not got:
                raise CheckpointError(f"{path}: shorter than expected while checksumming")
            crc = zlib.crc32(view[:got], crc)
            left -= got
    return crc


def _file_crc(pool: ThreadPoolExecutor, path: Path, size: int) -> Callable[[], int]:
    """Start the CRC32 of ``path`` piecewise on ``pool`` (zlib releases the GIL while it hashes); the
    returned function waits for the pieces and combines them."""
    pieces = [
        (
            pool.submit(_crc_range, path, offset, min(HASH_PIECE, size - offset)),
            min(HASH_PIECE, size - offset),
        )
        for offset in range(0, size, HASH_PIECE)
    ]

    def combined() -> int:
        crc = 0
        for piece, length in pieces:
            crc = crc32_combine(crc, piece.result(), length)
        return crc

    return combined


def _add_checksums(directory: Path, workers: int) -> None:
    """Add the CRCs an emergency save deferred to its manifest (an atomic rewrite). A checkpoint removed or
    replaced meanwhile is left alone."""
    path = directory / MANIFEST
    try:
        doc = json.loads(path.read_text())
        with ThreadPoolExecutor(max_workers=workers) as pool:
            sums = {
                f["path"]: _file_crc(pool, directory / f["path"], int(f["bytes"]))
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
        self._hashers = ThreadPoolExecutor(max_workers=workers or _hash_workers(), thread_name_prefix="crc")
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
            self._pieces.append((self._hashers.submit(_crc_fd_range, self._read_fd, offset, length), length))
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


def _crc_fd_range(fd: int, offset: int, length: int) -> int:
    crc = 0
    buffer = bytearray(min(_READ_BLOCK, max(length, 1)))
    view = memoryview(buffer)
    position, left = offset, length
    while left > 0:
        got = os.preadv(fd, [view[: min(left, len(buffer))]], position)
        if not got:
            raise CheckpointError(f"file shrank while checksumming at offset {position}")
        crc = zlib.crc32(view[:got], crc)
        position += got
        left -= got
    return crc


# CRC-32 combination (zlib's crc32_combine, which Python does not expose): the CRC of A+B from crc(A),
# crc(B) and len(B), by applying len(B) zero bytes to crc(A) through GF(2) matrix squaring.
_CRC_POLY = 0xEDB88320


def _gf2_times(matrix: list[int], vector: int) -> int:
    total = 0
    index = 0
    while vector:
        if vector & 1:
            total ^= matrix[index]
        vector >>= 1
        index += 1
    return total


def _gf2_square(matrix: list[int]) -> list[int]:
    return [_gf2_times(matrix, matrix[n]) for n in range(32)]


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """``zlib.crc32(a + b)`` given ``crc32(a)``, ``crc32(b)`` and ``len(b)``."""
    if len2 <= 0:
        return crc1
    odd = [_CRC_POLY] + [1 << n for n in range(31)]  # the operator for one zero bit
    even = _gf2_square(odd)  # two zero bits
    odd = _gf2_square(even)  # four zero bits
    while True:
        even = _gf2_square(odd)
        if len2 & 1:
            crc1 = _gf2_times(even, crc1)
        len2 >>= 1
        if not len2:
            break
        odd = _gf2_square(even)
        if len2 & 1:
            crc1 = _gf2_times(odd, crc1)
        len2 >>= 1
        if not len2:
            break
    return crc1 ^ crc2
