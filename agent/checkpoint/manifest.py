"""A committed checkpoint as it lies on disk: its manifest, read and checked field by field; its files'
sizes and CRC32s (large files in pieces on several threads, combined after); the errors and warnings of reading
it. Shared by the client's stores (:mod:`agent.client.store`, :mod:`agent.client.dcp`) and the RAM tier's
drain (:mod:`agent.ramtier.drain`). Standard library only.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path, PurePosixPath
from typing import Any, Literal, TypeVar, cast

from agent.checkpoint.checksum import crc32

MANIFEST = "manifest.json"
FORMAT = "preemptd-checkpoint"
FORMAT_VERSION = 1
_READ_BLOCK = 8 * 1024 * 1024
# Large files are checksummed in pieces of this size on several threads; the CRCs are combined after.
HASH_PIECE = 64 * 1024 * 1024
Verify = Literal["checksum", "size", "none"]
# A manifest's "checksum": "crc32" when every file has its CRC32 in it, "deferred" when an emergency save
# left them to be added after its commit (the manifest rewritten, or the sharded store's sidecars), None when
# the store saved without CRCs (``checksum=False``; and emergency steps saved before "deferred" was written).
# A file without its CRC32 in a step that promised one cannot be told intact: it fails ``verify("checksum")``.
CRC_PROMISED = ("crc32", "deferred")
_T = TypeVar("_T")
# Why a save or a read failed, from the OSError's errno (EDQUOT, a quota, is "no space" to the user too).
_REASONS = {
    errno.ENOSPC: "no_space",
    errno.EDQUOT: "no_space",
    errno.EACCES: "permission",
    errno.EPERM: "permission",
    errno.EIO: "io",
    errno.EROFS: "read_only",
}


class CheckpointWarning(UserWarning):
    """A checkpoint was skipped on resume because it is incomplete, corrupt or malformed, or a save started a
    new run in a root that holds higher steps."""


class CheckpointError(Exception):
    """A checkpoint cannot be saved, read or verified; the message says which file and why.

    ``reason`` names a storage cause in one word when there is one: ``no_space``, ``permission``, ``io``,
    ``read_only``, ``os`` (another errno), ``unreadable`` (the format itself cannot be read), ``mismatch`` (it
    does not fit the state to load into); else None. ``fallback``, after a failed emergency save: the earlier
    committed checkpoint the notice was handled with (recorded for ``preemptd exec`` and reported to the
    agent), or None when there is none.
    """

    def __init__(
        self, message: str, *, reason: str | None = None, fallback: Checkpoint | None = None
    ) -> None:
        super().__init__(message)
        self.reason = reason
        self.fallback = fallback


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
    run: int = 0
    checksum: str | None = None  # the manifest's "checksum": see CRC_PROMISED

    def file(self, name: str) -> Path:
        return self.path / name

    @classmethod
    def load(cls, directory: Path, manifest: str = MANIFEST) -> Checkpoint:
        """Read the manifest of ``directory``; CheckpointError naming the file and the field when it is
        missing, unreadable or malformed (a wrong type, a step that is not a whole number, a file path that
        leaves the directory)."""
        where = directory / manifest
        try:
            doc = json.loads(where.read_bytes())
        except FileNotFoundError as exc:
            raise CheckpointError(f"{directory}: no {manifest} (incomplete checkpoint)") from exc
        except OSError as exc:
            raise CheckpointError(f"{where}: unreadable: {exc.strerror}", reason=reason_of(exc)) from exc
        except (ValueError, RecursionError) as exc:
            raise CheckpointError(f"{where}: unreadable: {exc}", reason="unreadable") from exc
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise CheckpointError(f"{where}: not a {FORMAT} manifest")
        fields = _Fields(doc, where)
        files = doc.get("files", [])
        fields.check(isinstance(files, list), "files", "a list", files)
        return cls(
            step=fields.whole("step"),
            path=directory,
            time=fields.time("time"),
            bytes=fields.whole("bytes"),
            files=tuple(_file_entry(item, where, index) for index, item in enumerate(files)),
            emergency=bool(fields.typed("emergency", bool, False)),
            notice_id=fields.typed("notice_id", str, None),
            duration_s=fields.seconds("duration_s"),
            metadata=fields.typed("metadata", dict, None) or {},
            run=fields.whole("run", 0),
            checksum=fields.typed("checksum", str, None),
        )

    def verify(self, level: Verify = "checksum", workers: int | None = None) -> None:
        """Check every file's presence and size (and CRC for ``checksum``); CheckpointError when one fails."""
        if level == "none":
            return
        for entry in self.files:
            target = self.path / entry.path
            try:
                size = target.stat().st_size
            except FileNotFoundError as exc:
                raise CheckpointError(f"{target}: missing ({exc.strerror})") from exc
            except OSError as exc:
                raise CheckpointError(
                    f"{target}: unreadable ({exc.strerror})", reason=reason_of(exc)
                ) from exc
            if size != entry.bytes:
                raise CheckpointError(f"{target}: {size} bytes, the manifest says {entry.bytes}")
        if level != "checksum":
            return
        unchecked = self.unchecked()
        if unchecked:
            why = (
                "the emergency save deferred its CRCs and they were never written: the process ended first"
                if self.checksum == "deferred"
                else "its manifest entry has none"
            )
            raise CheckpointError(
                f"{self.path / unchecked[0].path}: no CRC32 to check it against ({why}), so damage to it "
                "cannot be detected"
            )
        with ThreadPoolExecutor(max_workers=workers or default_hash_workers()) as pool:
            sums = {
                e.path: file_crc(pool, self.path / e.path, e.bytes) for e in self.files if e.crc32 is not None
            }
            for entry in self.files:
                if entry.crc32 is None:
                    continue
                target = self.path / entry.path
                try:
                    crc = sums[entry.path]()
                except OSError as exc:
                    raise CheckpointError(
                        f"{target}: unreadable ({exc.strerror})", reason=reason_of(exc)
                    ) from exc
                if crc != entry.crc32:
                    raise CheckpointError(f"{target}: checksum mismatch (corrupt)")

    def unchecked(self) -> list[FileEntry]:
        """The files without a CRC32 in a checkpoint whose manifest promised them one (see CRC_PROMISED)."""
        if self.checksum not in CRC_PROMISED:
            return []
        return [entry for entry in self.files if entry.crc32 is None]

    def check_listed(self, ignore: Callable[[str], bool] = lambda name: False) -> None:
        """CheckpointError naming the first file in the directory that its manifest does not list (and
        ``ignore`` does not pass): a file no entry describes is never verified, so the step cannot be
        trusted. Plain files only (symlinks are not part of a checkpoint); the manifest itself and its staged
        rewrite are never listed."""
        listed = {entry.path for entry in self.files}
        try:
            found = sorted(
                p.relative_to(self.path).as_posix()
                for p in self.path.rglob("*")
                if p.is_file() and not p.is_symlink()
            )
        except OSError as exc:
            raise CheckpointError(
                f"{self.path}: cannot be listed ({exc.strerror})", reason=reason_of(exc)
            ) from exc
        own = {MANIFEST, MANIFEST + ".tmp"}
        for name in found:
            if name not in listed and name not in own and not ignore(name):
                raise CheckpointError(f"{self.path / name}: not in the manifest, so it cannot be verified")


def reason_of(exc: OSError) -> str:
    """The one-word cause of a storage failure (see CheckpointError.reason)."""
    return _REASONS.get(exc.errno or 0, "os")


_MAX_WHOLE = 2**63 - 1


class _Fields:
    """The fields of one manifest, each checked for its type; CheckpointError naming the file and field."""

    def __init__(self, doc: Mapping[str, Any], where: Path, prefix: str = "") -> None:
        self.doc = doc
        self.where = where
        self.prefix = prefix

    def check(self, ok: bool, name: str, expected: str, value: Any) -> None:
        if not ok:
            raise CheckpointError(
                f"{self.where}: malformed: {self.prefix + name!r} must be {expected}, got {_brief(value)}"
            )

    def whole(self, name: str, default: int | None = None) -> int:
        value = self.doc.get(name, default)
        self.check(_is_whole(value), name, "a whole number from 0 to 2**63-1", value)
        return int(value)

    def typed(self, name: str, kind: type[_T], default: _T | None) -> _T | None:
        value = self.doc.get(name, default)
        self.check(value is None or isinstance(value, kind), name, f"{kind.__name__} or null", value)
        return cast("_T | None", value)

    def seconds(self, name: str) -> float | None:
        value = self.doc.get(name)
        ok = value is None or (
            isinstance(value, (int, float))
            and not isinstance(value, bool)
            and math.isfinite(value)
            and value >= 0
        )
        self.check(ok, name, "a finite number of seconds or null", value)
        return None if value is None else float(value)

    def time(self, name: str) -> datetime:
        value = self.doc.get(name)
        try:
            parsed = datetime.fromisoformat(str(value).replace("Z", "+00:00"))
        except ValueError:
            parsed = None
        self.check(isinstance(value, str) and parsed is not None, name, "an ISO 8601 time", value)
        assert parsed is not None
        return parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=timezone.utc)


def _file_entry(item: Any, where: Path, index: int) -> FileEntry:
    """One entry of a manifest's ``files``: a relative path inside the checkpoint, its size and CRC."""
    fields = _Fields(item if isinstance(item, dict) else {}, where, f"files[{index}].")
    fields.check(isinstance(item, dict), "", "an object", item)
    path = fields.doc.get("path")
    inside = isinstance(path, str) and path != "" and not path.startswith("/")
    inside = inside and ".." not in PurePosixPath(str(path)).parts
    fields.check(inside, "path", "a relative path inside the checkpoint", path)
    crc = fields.doc.get("crc32")
    fields.check(crc is None or (_is_whole(crc) and crc <= 0xFFFFFFFF), "crc32", "a CRC32 or null", crc)
    return FileEntry(str(path), fields.whole("bytes"), crc)


def _is_whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= _MAX_WHOLE


def _brief(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def run_of(directory: Path) -> int | None:
    """The run of a step directory, from its manifest (0 for manifests from before runs); None when the
    manifest cannot be read."""
    try:
        doc = json.loads((directory / MANIFEST).read_bytes())
    except (OSError, ValueError, RecursionError):
        return None
    run = doc.get("run", 0) if isinstance(doc, dict) else None
    return run if _is_whole(run) else None


def default_hash_workers() -> int:
    return max(1, min(8, os.cpu_count() or 1))


class InlineExecutor(Executor):
    """Runs each task at once on the calling thread: the pool of :func:`hash_pool` once the interpreter shuts
    down (a background save that a store never closed commits from the exit handler, when
    ``concurrent.futures`` takes no new work)."""

    def submit(self, fn: Callable[..., _T], /, *args: Any, **kwargs: Any) -> Future[_T]:
        done: Future[_T] = Future()
        try:
            done.set_result(fn(*args, **kwargs))
        except BaseException as exc:  # the caller's result() raises it, as a pool's would
            done.set_exception(exc)
        return done


@contextlib.contextmanager
def hash_pool(workers: int) -> Iterator[Executor]:
    """A thread pool of ``workers`` for CRCs and fsyncs; at interpreter shutdown, an :class:`InlineExecutor`."""
    with ThreadPoolExecutor(max_workers=workers) as pool:
        try:
            pool.submit(int).result()
        except RuntimeError:  # "cannot schedule new futures after interpreter shutdown"
            yield InlineExecutor()
            return
        yield pool


def file_crcs(directory: Path, files: Mapping[str, int], workers: int) -> dict[str, int]:
    """The CRC32 of each file (relative path -> size) under ``directory``, on a :func:`hash_pool`; on this
    thread when the interpreter begins to exit meanwhile (its pools then refuse new work): the deferred CRCs
    of an emergency save are still written when the process exits right after it."""
    try:
        with hash_pool(workers) as pool:
            started = {name: file_crc(pool, directory / name, size) for name, size in files.items()}
            return {name: crc() for name, crc in started.items()}
    except RuntimeError:  # "cannot schedule new futures after shutdown"
        inline = InlineExecutor()
        return {name: file_crc(inline, directory / name, size)() for name, size in files.items()}


def crc_range(path: Path, offset: int, length: int) -> int:
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
            crc = crc32(view[:got], crc)
            left -= got
    return crc


def file_crc(pool: Executor, path: Path, size: int) -> Callable[[], int]:
    """Start the CRC32 of ``path`` piecewise on ``pool`` (zlib releases the GIL while it hashes); the
    returned function waits for the pieces and combines them."""
    pieces = [
        (
            pool.submit(crc_range, path, offset, min(HASH_PIECE, size - offset)),
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


def crc_fd_range(fd: int, offset: int, length: int) -> int:
    crc = 0
    buffer = bytearray(min(_READ_BLOCK, max(length, 1)))
    view = memoryview(buffer)
    position, left = offset, length
    while left > 0:
        got = os.preadv(fd, [view[: min(left, len(buffer))]], position)
        if not got:
            raise CheckpointError(f"file shrank while checksumming at offset {position}")
        crc = crc32(view[:got], crc)
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
