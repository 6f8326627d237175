"""What this host's RAM tier holds, and the directory work behind it: the names it accepts, each step's
``tier.json`` read and checked against the files, the tier's root prepared, and the whole directory read back
(CRC-checked) when the agent starts. Everything here blocks on the file system: the component runs it in a
worker thread. The layout and the ``tier.json`` fields are the contract in docs/ram-tier.md.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from agent.client.manifest import crc_range
from agent.core.errors import PreemptdError
from agent.core.reports import brief

MANIFEST = "tier.json"
# Written into the root when the agent makes it its own: a directory without it that already holds files is
# someone else's, and the agent never removes anything from it.
MARKER = ".preemptd-ram-tier"
_JOB_ID = re.compile(r"[A-Za-z0-9._-]{1,128}")
_FILE_NAME = re.compile(r"[A-Za-z0-9._-]{1,255}")
_STEP = re.compile(r"[0-9]{1,19}")
MAX_STEP = 2**63 - 1
MAX_MANIFEST_BYTES = 16 * 1024 * 1024
RAM_FILESYSTEMS = ("tmpfs", "ramfs")


class TierError(PreemptdError):
    """A RAM-tier request that cannot be served; ``status`` is the HTTP status that says why (400 bad input,
    403 not the job's owner, 404 nothing held, 409 a step that does not check out, 503 the tier cannot be
    used, 507 full). ``extra`` goes into the JSON answer beside ``error``."""

    def __init__(self, status: int, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.status = status
        self.extra = extra


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
    """One committed step of one job on this host: its ``tier.json`` and the bytes its directory holds."""

    job: str
    step: int
    run: Any
    world_size: int
    complete: bool
    time: str | None
    files: Mapping[str, FileEntry]
    bytes: int

    def to_json(self) -> dict[str, Any]:
        return {
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


def parse_manifest(doc: Any, job: str, step: int) -> StepRecord:
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
        job=job,
        step=step,
        run=doc.get("run"),
        world_size=world_size,
        complete=complete,
        time=moment if isinstance(moment, str) else None,
        files=entries,
        bytes=0,
    )


def tree_bytes(path: Path) -> int:
    """What the regular files under ``path`` hold (symbolic links are not followed): the RAM it takes."""
    total = 0
    with contextlib.suppress(FileNotFoundError), os.scandir(path) as entries:
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                total += tree_bytes(Path(entry.path))
            elif entry.is_file(follow_symlinks=False):
                with contextlib.suppress(FileNotFoundError):
                    total += entry.stat(follow_symlinks=False).st_size
    return total


def check_file(step_dir: Path, name: str, entry: FileEntry, crc: bool, where: str) -> None:
    """The file is there, a regular file (a link could point anywhere), of the size ``tier.json`` says
    and, with ``crc``, of its CRC32."""
    try:
        st = os.lstat(step_dir / name)
    except FileNotFoundError:
        raise TierError(409, f"{where}: {MANIFEST} lists {name}, which is not in the directory") from None
    if not stat.S_ISREG(st.st_mode):
        raise TierError(409, f"{where}: {name} is not a regular file (a link or a directory)")
    if st.st_size != entry.size:
        raise TierError(
            409, f"{where}: {MANIFEST} says {name} holds {entry.size} bytes, the file holds {st.st_size}"
        )
    if crc:
        try:
            actual = crc_range(step_dir / name, 0, entry.size)
        except (OSError, PreemptdError) as exc:
            raise TierError(409, f"{where}: {name} cannot be read back: {exc}") from None
        if actual != entry.crc32:
            raise TierError(
                409,
                f"{where}: {name} fails its CRC32 (tier.json: {entry.crc32:#010x}, the file: {actual:#010x}): "
                "the copy is damaged",
            )


def read_step(step_dir: Path, job: str, step: int, crc: bool) -> StepRecord:
    """A step's ``tier.json`` read and its files checked (sizes; CRCs too with ``crc``)."""
    where = f"job {job} step {step}"
    manifest = step_dir / MANIFEST
    try:
        st = os.lstat(manifest)
    except FileNotFoundError:
        raise TierError(409, f"{where} has no {MANIFEST}: its writer never finished it") from None
    if not stat.S_ISREG(st.st_mode):
        raise TierError(409, f"{where}: {MANIFEST} is not a regular file")
    if st.st_size > MAX_MANIFEST_BYTES:
        raise TierError(
            409, f"{where}: {MANIFEST} is {st.st_size} bytes, over the {MAX_MANIFEST_BYTES} limit"
        )
    try:
        doc = json.loads(manifest.read_bytes())
    except (ValueError, RecursionError) as exc:
        raise TierError(409, f"{where}: {MANIFEST} is not valid JSON: {str(exc)[:200]}") from None
    record = parse_manifest(doc, job, step)
    for name, entry in record.files.items():
        check_file(step_dir, name, entry, crc, where)
    return StepRecord(**{**record.__dict__, "bytes": tree_bytes(step_dir)})


@dataclass(frozen=True)
class Root:
    """The tier's directory as the agent found it."""

    path: Path
    filesystem: str
    size_bytes: int  # of the file system it is on

    @property
    def in_ram(self) -> bool:
        return self.filesystem in RAM_FILESYSTEMS


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


def prepare_root(path: Path) -> Root:
    """Make ``path`` the tier's own directory (0711: the jobs reach their own directories, nobody lists
    them), or say why it cannot be: it is not a directory, it holds someone else's files, it is not
    writable."""
    try:
        if not path.exists():
            path.mkdir(parents=True, mode=0o711)
            path.chmod(0o711)  # the umask may have taken the search bit the job users need
        elif not path.is_dir():
            raise TierError(
                503, f"ram_tier.path {path} exists and is not a directory: point it at a directory"
            )
        marker = path / MARKER
        if not marker.exists() and any(path.iterdir()):
            raise TierError(
                503,
                f"ram_tier.path {path} holds files that preemptd did not put there (no {MARKER}): point "
                "ram_tier.path at a directory of its own (the agent removes incomplete steps it finds there)",
            )
        # Writing the marker each start is also the check that the agent can write there.
        marker.write_text("the preemptd agent's RAM tier: see docs/ram-tier.md\n")
        usage = os.statvfs(path)
    except OSError as exc:
        raise TierError(
            503,
            f"ram_tier.path {path} cannot be used: {exc.strerror or exc}: give the agent a writable "
            "directory on tmpfs (such as /dev/shm/preemptd)",
        ) from None
    return Root(path, filesystem_of(path), usage.f_blocks * usage.f_frsize)


@dataclass
class Scan:
    """The directory read back: the steps that check out, by job and step; each job directory's owner; what
    was removed (incomplete or damaged steps) and what was left alone (names the tier does not use)."""

    records: dict[tuple[str, int], StepRecord] = field(default_factory=dict)
    owners: dict[str, int] = field(default_factory=dict)
    removed: list[tuple[str, int, str]] = field(default_factory=list)
    ignored: list[tuple[str, str]] = field(default_factory=list)


def scan(root: Path) -> Scan:
    """Every step under ``root`` read back with its CRCs; a step without a valid ``tier.json`` or with a
    file that does not match it is removed (a writer died, or the bytes were damaged)."""
    found = Scan()
    for job_entry in sorted(os.scandir(root), key=lambda e: e.name):
        name = job_entry.name
        if name == MARKER:
            continue
        if not job_entry.is_dir(follow_symlinks=False) or not _JOB_ID.fullmatch(name) or name in (".", ".."):
            found.ignored.append((name, "not a job directory (a job id and a directory)"))
            continue
        found.owners[name] = job_entry.stat(follow_symlinks=False).st_uid
        for step_entry in sorted(os.scandir(job_entry.path), key=lambda e: e.name):
            relative = f"{name}/{step_entry.name}"
            if not step_entry.is_dir(follow_symlinks=False) or not _STEP.fullmatch(step_entry.name):
                found.ignored.append((relative, "not a step directory (a step number and a directory)"))
                continue
            step = int(step_entry.name)
            try:
                found.records[(name, step)] = read_step(Path(step_entry.path), name, step, crc=True)
            except TierError as exc:
                remove_tree(Path(step_entry.path))
                found.removed.append((name, step, str(exc)))
    return found


def remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def step_dir(root: Path, job: str, step: int) -> Path:
    return root / job / str(step)


def make_step_dir(root: Path, job: str, step: int, uid: int, gid: int, privileged: bool) -> Path:
    """``<root>/<job>/<step>``, the job's directory given to the reserving client's user (``uid``, ``gid``)
    when it is new. A job whose directory belongs to another user is refused unless ``privileged``."""
    job_dir = root / job
    with contextlib.suppress(FileExistsError):
        os.mkdir(job_dir, 0o700)
        _give(job_dir, uid, gid)
    owner = job_owner(root, job)
    if owner is not None and owner != uid and not privileged:
        raise TierError(
            403,
            f"job {job} belongs to uid {owner} on this host; uid {uid} may not write into it: use a job id "
            "of your own (PREEMPTD_JOB_ID)",
        )
    target = job_dir / str(step)
    with contextlib.suppress(FileExistsError):
        os.mkdir(target, 0o700)
        _give(target, owner if owner is not None else uid, gid)
    if not stat.S_ISDIR(os.lstat(target).st_mode):
        raise TierError(409, f"{target} is not a directory")
    return target


def job_owner(root: Path, job: str) -> int | None:
    """The user the job's directory belongs to, or None if there is none (a link is not a job directory)."""
    try:
        st = os.lstat(root / job)
    except FileNotFoundError:
        return None
    if not stat.S_ISDIR(st.st_mode):
        raise TierError(409, f"{root / job} is not a directory: remove it")
    return st.st_uid


def _give(path: Path, uid: int, gid: int) -> None:
    if os.lstat(path).st_uid == uid:
        return
    try:
        os.chown(path, uid, gid)
    except PermissionError:
        remove_tree(path)
        raise TierError(
            403,
            f"the agent runs as uid {os.geteuid()} and cannot give {path} to uid {uid}: it needs CAP_CHOWN, and "
            "a system call filter that lets @chown through (the packaged systemd unit grants both; "
            'docs/ram-tier.md, "Under the packaged systemd unit"), or to run as root; or run the job as the '
            "agent's user",
        ) from None
