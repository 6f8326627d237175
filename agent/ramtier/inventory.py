"""What this host's RAM tier holds, and the directory work behind it: the names it accepts, each step's
``tier.json`` read and checked against the files, the tier's root prepared, and the whole directory read back
(CRC-checked) when the agent starts. Everything here blocks on the file system: the component runs it in a
worker thread. The layout and the ``tier.json`` fields are the contract in docs/ram-tier.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import re
import stat
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from agent.checkpoint.manifest import CheckpointError, crc_fd_range
from agent.core.reports import brief
from agent.ramtier import tierfs
from agent.ramtier.copies import kind_of, placement_of
from agent.ramtier.errors import TierError

MANIFEST = "tier.json"
# Written into the root when the agent makes it its own: a directory without it that already holds files is
# someone else's, and the agent never removes anything from it.
MARKER = ".preemptd-ram-tier"
_JOB_ID = re.compile(r"[A-Za-z0-9._-]{1,128}")
_FILE_NAME = re.compile(r"[A-Za-z0-9._-]{1,255}")
_STEP = re.compile(r"[0-9]{1,19}")
_UID = re.compile(r"[0-9]{1,10}")
MAX_STEP = 2**63 - 1
MAX_MANIFEST_BYTES = 16 * 1024 * 1024
RAM_FILESYSTEMS = ("tmpfs", "ramfs")


def check_job(job: Any) -> str:
    if not isinstance(job, str) or not _JOB_ID.fullmatch(job) or job in (".", ".."):
        raise TierError(
            400,
            f"job id {brief(job)} is not valid: use 1 to 128 characters of A-Z, a-z, 0-9, '.', '_' and '-' "
            "(not '.' or '..')",
        )
    return job


def check_step(step: Any, in_url: bool = False) -> int:
    """A step number: an integer in a JSON body, its decimal digits in a URL (``in_url``)."""
    if in_url and isinstance(step, str) and _STEP.fullmatch(step):
        step = int(step)
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_STEP:
        raise TierError(400, f"step {brief(step)} is not valid: use a whole number from 0 to {MAX_STEP}")
    return step


def check_file_name(name: Any) -> str:
    """A file of a step: one plain name in the step's directory, never a path out of it."""
    if not isinstance(name, str) or not _FILE_NAME.fullmatch(name) or name in (".", "..", MANIFEST, MARKER):
        raise TierError(
            400,
            f"file name {brief(name)} is not valid: a step's files are plain names of A-Z, a-z, 0-9, '.', "
            f"'_' and '-' inside the step's directory (not '.', '..' or {MANIFEST})",
        )
    return name


@dataclass(frozen=True)
class FileEntry:
    size: int
    crc32: int
    rank: int

    def to_json(self) -> dict[str, int]:
        return {"size": self.size, "crc32": self.crc32, "rank": self.rank}


@dataclass(frozen=True)
class StepRecord:
    """One committed step of one job on this host: its ``tier.json`` and the bytes its directory holds. A job
    is its uid's: ``(uid, job)`` names it, so two users' jobs of the same id never meet."""

    uid: int
    job: str
    step: int
    run: Any
    world_size: int
    complete: bool
    time: str | None
    files: Mapping[str, FileEntry]
    bytes: int
    kind: str = "step"  # "snapshot" for a peer snapshot (agent/ramtier/copies.py)
    placement: Mapping[str, Mapping[str, str]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "placement": {host: dict(entry) for host, entry in self.placement.items()},
            "step": self.step,
            "run": self.run,
            "world_size": self.world_size,
            "complete": self.complete,
            "time": self.time,
            "bytes": self.bytes,
            "files": {name: entry.to_json() for name, entry in self.files.items()},
        }


def _whole(doc: Mapping[str, Any], key: str, low: int, high: int, where: str) -> int:
    value = doc.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise TierError(
            409, f"{where}: '{key}' must be a whole number from {low} to {high}, got {brief(value)}"
        )
    return value


def parse_manifest(doc: Any, job: str, step: int, uid: int = 0) -> StepRecord:
    """The ``tier.json`` of ``job``'s ``step`` checked field by field (pure; ``bytes`` is left at 0)."""
    where = f"{MANIFEST} of job {job} step {step}"
    if not isinstance(doc, Mapping):
        raise TierError(409, f"{where} must be a JSON object")
    if doc.get("job") != job or doc.get("step") != step or isinstance(doc.get("step"), bool):
        raise TierError(
            409,
            f"{where} names job {brief(doc.get('job'))} step {brief(doc.get('step'))}: it was written for "
            "another step (or copied), so it cannot describe these files",
        )
    world_size = _whole(doc, "world_size", 1, 2**31 - 1, where)
    complete = doc.get("complete")
    if not isinstance(complete, bool):
        raise TierError(409, f"{where}: 'complete' must be true or false, got {brief(complete)}")
    files = doc.get("files")
    if not isinstance(files, Mapping):
        raise TierError(409, f"{where}: 'files' must be an object of file name -> {{size, crc32, rank}}")
    entries: dict[str, FileEntry] = {}
    for name, entry in files.items():
        try:
            check_file_name(name)
        except TierError as exc:
            raise TierError(409, f"{where}: {exc}") from None
        if not isinstance(entry, Mapping):
            raise TierError(409, f"{where}: file {name}: expected an object with size, crc32 and rank")
        at = f"{where}: file {name}"
        entries[name] = FileEntry(
            size=_whole(entry, "size", 0, 2**63 - 1, at),
            crc32=_whole(entry, "crc32", 0, 2**32 - 1, at),
            rank=_whole(entry, "rank", 0, world_size - 1, at),
        )
    moment = doc.get("time")
    return StepRecord(
        uid=uid,
        job=job,
        step=step,
        run=doc.get("run"),
        world_size=world_size,
        complete=complete,
        time=moment if isinstance(moment, str) else None,
        files=entries,
        bytes=0,
        kind=kind_of(doc),
        placement=placement_of(doc),
    )


@contextlib.contextmanager
def opened_step(root: Root, uid: int, job: str, step: int) -> Iterator[int]:
    """The step's directory as a descriptor, reached from the root one name at a time: the uid directory is
    the agent's, the job's directory and the step's belong to ``uid``, none of them a link."""
    where = f"job {job} step {step}"
    try:
        with (
            tierfs.opened_dir(root.fd, str(uid), f"the directory of uid {uid}", root.uid) as by_uid,
            tierfs.opened_dir(by_uid, job, f"the directory of job {job}", uid) as job_fd,
            tierfs.opened_dir(job_fd, str(step), f"the directory of {where}", uid) as step_fd,
        ):
            yield step_fd
    except FileNotFoundError:
        raise TierError(404, f"the RAM tier holds nothing for {where} of uid {uid}") from None


def check_file(step_fd: int, name: str, entry: FileEntry, uid: int, crc: bool, where: str) -> None:
    """The file is there, a regular file of the job's uid (a link could point anywhere), of the size
    ``tier.json`` says and, with ``crc``, of its CRC32: all read through one descriptor."""
    fd, st = tierfs.open_file(step_fd, name, where, uid)
    try:
        check_open_file(fd, st.st_size, name, entry, crc, where)
    finally:
        os.close(fd)


def check_open_file(fd: int, size: int, name: str, entry: FileEntry, crc: bool, where: str) -> None:
    if size != entry.size:
        raise TierError(
            409, f"{where}: {MANIFEST} says {name} holds {entry.size} bytes, the file holds {size}"
        )
    if crc:
        try:
            actual = crc_fd_range(fd, 0, entry.size)
        except (OSError, CheckpointError) as exc:
            raise TierError(409, f"{where}: {name} cannot be read back: {exc}") from None
        if actual != entry.crc32:
            raise TierError(
                409,
                f"{where}: {name} fails its CRC32 (tier.json: {entry.crc32:#010x}, the file: {actual:#010x}): "
                "the copy is damaged",
            )


def read_manifest(step_fd: int, uid: int, where: str) -> Any:
    """The step's ``tier.json``, opened once (a regular file of the job's uid, never a link or a FIFO) and read
    through that descriptor up to the size limit."""
    try:
        fd, st = tierfs.open_file(step_fd, MANIFEST, where, uid)
    except TierError as exc:
        if f"{MANIFEST} is not in the directory" in str(exc):
            raise TierError(409, f"{where} has no {MANIFEST}: its writer never finished it") from None
        raise
    try:
        if st.st_size > MAX_MANIFEST_BYTES:
            raise TierError(
                409, f"{where}: {MANIFEST} is {st.st_size} bytes, over the {MAX_MANIFEST_BYTES} limit"
            )
        raw = tierfs.read_all(fd, MAX_MANIFEST_BYTES)
    finally:
        os.close(fd)
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise TierError(409, f"{where}: {MANIFEST} is not valid JSON: {str(exc)[:200]}") from None


def read_step(root: Root, uid: int, job: str, step: int, crc: bool) -> StepRecord:
    """A step's ``tier.json`` read and its files checked (sizes; CRCs too with ``crc``)."""
    where = f"job {job} step {step}"
    with opened_step(root, uid, job, step) as step_fd:
        record = parse_manifest(read_manifest(step_fd, uid, where), job, step, uid)
        for name, entry in record.files.items():
            check_file(step_fd, name, entry, uid, crc, where)
        held = tierfs.tree_bytes(step_fd)
    return dataclasses.replace(record, bytes=held)


def open_checked(root: Root, record: StepRecord, name: str) -> tuple[int, int]:
    """One file of a committed step opened, its size and CRC32 checked through the descriptor that is then
    served: ``(fd, size)``; the caller closes it."""
    where = f"job {record.job} step {record.step}"
    with opened_step(root, record.uid, record.job, record.step) as step_fd:
        fd, st = tierfs.open_file(step_fd, name, where, record.uid)
    try:
        check_open_file(fd, st.st_size, name, record.files[name], True, where)
    except BaseException:
        os.close(fd)
        raise
    return fd, st.st_size


def step_bytes(root: Root, uid: int, job: str, step: int) -> int:
    """What a step's directory holds now (0 when it is gone or is not the job's)."""
    try:
        with opened_step(root, uid, job, step) as step_fd:
            return tierfs.tree_bytes(step_fd)
    except (OSError, TierError):
        return 0


@dataclass(frozen=True)
class Root:
    """The tier's directory as the agent found it, held open: every name under it is reached from ``fd``."""

    path: Path
    fd: int
    uid: int  # the agent's: it owns the root and the uid directories
    filesystem: str
    size_bytes: int  # of the file system it is on

    @property
    def in_ram(self) -> bool:
        return self.filesystem in RAM_FILESYSTEMS

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)


def filesystem_of(path: Path) -> str:
    """The type of the file system ``path`` is on (the mount point with the longest matching prefix)."""
    resolved = str(path.resolve())
    best, kind = "", "unknown"
    for part in psutil.disk_partitions(all=True):
        point = part.mountpoint.rstrip("/") or "/"
        inside = resolved == point or resolved.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, kind = point, part.fstype
    return kind


def _root_problem(st: os.stat_result, me: int) -> str | None:
    """Why a directory cannot be the tier's root: it must be the agent's, and no one else may write in it."""
    mode = f"mode {stat.S_IMODE(st.st_mode):04o}, owner uid {st.st_uid}"
    if st.st_uid != me:
        return (
            f"belongs to uid {st.st_uid}, not to the agent's uid {me} ({mode}): its owner could move, swap or "
            "plant jobs' files in it. Remove it (the agent makes its own) or give it to the agent's user "
            f"(chown {me} PATH && chmod 0711 PATH)"
        )
    if st.st_mode & 0o022:
        return f"is writable by other users ({mode}): chmod 0711 it (or remove it: the agent makes its own)"
    return None


def _open_root(path: Path) -> int:
    if not os.path.lexists(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):  # made meanwhile: checked below like any other
            os.mkdir(path, 0o711)
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            kind = tierfs.kind_of(os.lstat(path).st_mode)
            raise TierError(
                503,
                f"ram_tier.path {path} exists and is {kind}, not a directory: point it at a directory of the "
                "agent's own (the agent makes it when it is missing)",
            ) from None
        raise


def prepare_root(path: Path) -> Root:
    """Make ``path`` the tier's own directory (the agent's, 0711: the jobs reach their own directories, nobody
    lists them), or say why it cannot be: it is a link or not a directory, it belongs to someone else or
    others may write in it, it holds someone else's files, it is not writable."""
    me = os.geteuid()
    try:
        fd = _open_root(path)
        try:
            problem = _root_problem(os.fstat(fd), me)
            if problem is not None:
                raise TierError(503, f"ram_tier.path {path} {problem.replace('PATH', str(path))}")
            os.fchmod(fd, 0o711)  # nobody lists it; the umask may have taken the search bit the jobs need
            names = [name for name, _ in tierfs.entries(fd)]
            if names and MARKER not in names:
                raise TierError(
                    503,
                    f"ram_tier.path {path} holds files that preemptd did not put there (no {MARKER}): point "
                    "ram_tier.path at a directory of its own (the agent removes incomplete steps it finds "
                    "there)",
                )
            # Writing the marker each start is also the check that the agent can write there.
            marker = os.open(MARKER, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644, dir_fd=fd)
            with os.fdopen(marker, "w") as handle:
                handle.write("the preemptd agent's RAM tier: see docs/ram-tier.md\n")
            usage = os.fstatvfs(fd)
        except BaseException:
            os.close(fd)
            raise
    except OSError as exc:
        raise TierError(
            503,
            f"ram_tier.path {path} cannot be used: {exc.strerror or exc}: give the agent a writable "
            "directory on tmpfs (such as /dev/shm/preemptd)",
        ) from None
    return Root(path, fd, me, filesystem_of(path), usage.f_blocks * usage.f_frsize)


@dataclass
class Scan:
    """The directory read back: the steps that check out, by uid, job and step; what was removed (incomplete
    or damaged steps) and what was left alone (names the tier does not use)."""

    records: dict[tuple[int, str, int], StepRecord] = field(default_factory=dict)
    removed: list[tuple[int, str, int, str]] = field(default_factory=list)
    ignored: list[tuple[str, str]] = field(default_factory=list)


def scan(root: Root) -> Scan:
    """Every step under ``root`` read back with its CRCs; a step without a valid ``tier.json`` or with a
    file that does not match it is removed (a writer died, or the bytes were damaged)."""
    found = Scan()
    for name, is_dir in tierfs.entries(root.fd):
        if name == MARKER:
            continue
        if not is_dir or not _UID.fullmatch(name):
            found.ignored.append((name, "not a uid directory (a user id and a directory)"))
            continue
        try:
            with tierfs.opened_dir(root.fd, name, name, root.uid) as by_uid:
                _scan_uid(root, int(name), by_uid, found)
        except TierError as exc:
            found.ignored.append((name, f"not the agent's: {exc}"))
    return found


def _scan_uid(root: Root, uid: int, by_uid: int, found: Scan) -> None:
    for job, is_dir in tierfs.entries(by_uid):
        where = f"{uid}/{job}"
        if not is_dir or not _JOB_ID.fullmatch(job) or job in (".", ".."):
            found.ignored.append((where, "not a job directory (a job id and a directory)"))
            continue
        try:
            with tierfs.opened_dir(by_uid, job, where, uid) as job_fd:
                steps = tierfs.entries(job_fd)
        except TierError as exc:
            found.ignored.append((where, str(exc)))
            continue
        for name, step_is_dir in steps:
            if not step_is_dir or not _STEP.fullmatch(name):
                found.ignored.append(
                    (f"{where}/{name}", "not a step directory (a step number and a directory)")
                )
                continue
            step = int(name)
            try:
                found.records[(uid, job, step)] = read_step(root, uid, job, step, crc=True)
            except (TierError, OSError) as exc:
                tierfs.remove(step_dir(root.path, uid, job, step))
                found.removed.append((uid, job, step, str(exc)))


def remove_tree(path: Path) -> None:
    tierfs.remove(path)


def job_dir(root: Path, uid: int, job: str) -> Path:
    return root / str(uid) / job


def step_dir(root: Path, uid: int, job: str, step: int) -> Path:
    return root / str(uid) / job / str(step)


def make_step_dir(root: Root, uid: int, gid: int, job: str, step: int) -> Path:
    """``<root>/<uid>/<job>/<step>``: the uid directory the agent's (0711), the job's and the step's given to
    the reserving client's user (``uid``, ``gid``, 0700) when they are new; existing ones must be that user's
    directories (never links)."""
    at = root.path / str(uid)
    try:
        tierfs.make_dir(root.fd, str(uid), tierfs.UID_DIR_MODE, root.uid, os.getegid())
        with tierfs.opened_dir(root.fd, str(uid), f"the directory of uid {uid}", root.uid) as by_uid:
            at = at / job
            tierfs.make_dir(by_uid, job, tierfs.JOB_DIR_MODE, uid, gid)
            with tierfs.opened_dir(by_uid, job, f"the directory of job {job}", uid) as job_fd:
                at = at / str(step)
                tierfs.make_dir(job_fd, str(step), tierfs.JOB_DIR_MODE, uid, gid)
                with tierfs.opened_dir(job_fd, str(step), f"the directory of job {job} step {step}", uid):
                    pass  # a step directory of the job's (made now, or by the job: never a link)
    except PermissionError as exc:
        if exc.filename is None:  # fchown: the directory was made and could not be given (it is removed)
            raise _cannot_give(at, uid) from None
        raise PermissionError(exc.errno, exc.strerror, str(at)) from None
    return step_dir(root.path, uid, job, step)


def _cannot_give(path: Path, uid: int) -> TierError:
    return TierError(
        403,
        f"the agent runs as uid {os.geteuid()} and cannot give {path} to uid {uid}: it needs CAP_CHOWN, and "
        "a system call filter that lets @chown through (the packaged systemd unit grants both; "
        'docs/ram-tier.md, "Under the packaged systemd unit"), or to run as root; or run the job as the '
        "agent's user",
    )


def measure(root: Root) -> dict[tuple[int, str], dict[str, int]]:
    """What every job's directory holds now, by entry (a step's number, or any other name found there):
    walked through descriptors, never through a link. Directories that are not the agent's or the job's are
    skipped (the read-back says so once)."""
    found: dict[tuple[int, str], dict[str, int]] = {}
    for name, is_dir in tierfs.entries(root.fd):
        if not is_dir or not _UID.fullmatch(name):
            continue
        uid = int(name)
        with (
            contextlib.suppress(OSError, TierError),
            tierfs.opened_dir(root.fd, name, name, root.uid) as by_uid,
        ):
            for job, job_is_dir in tierfs.entries(by_uid):
                if not job_is_dir or not _JOB_ID.fullmatch(job):
                    continue
                with (
                    contextlib.suppress(OSError, TierError),
                    tierfs.opened_dir(by_uid, job, job, uid) as job_fd,
                ):
                    found[(uid, job)] = _entry_bytes(job_fd)
    return found


def _entry_bytes(directory: int) -> dict[str, int]:
    sizes: dict[str, int] = {}
    for name, is_dir in tierfs.entries(directory):
        with contextlib.suppress(OSError, TierError):
            if is_dir:
                with tierfs.opened_dir(directory, name, name) as inner:
                    sizes[name] = tierfs.tree_bytes(inner)
            else:
                sizes[name] = os.stat(name, dir_fd=directory, follow_symlinks=False).st_size
    return sizes
