"""The drain: copies one host's part of a RAM-tier step into the job's durable root, and commits the step there
as an ordinary ``ShardedStore`` step (``step-<N>`` with its ``manifest.json``) once every host's part is in.

It runs as a child process of the agent under the job's own user: before it opens any file it takes the job's
uid and gid from the plan (the agent is root, or holds CAP_SETUID and CAP_SETGID under the packaged unit) and
drops every capability (:mod:`agent.ramtier.identity`), so it can write only where the job itself could: a
client names the durable root, and the agent must not write there for it. The plan comes as one JSON object
on stdin; progress goes out as JSON lines on stdout
(``{"copied_bytes", "total_bytes"}``, then ``{"state": "committed" | "waiting", ...}``). docs/ram-tier.md
describes the protocol between the hosts:

1. every host copies its files into ``<root>/.drain-step-<N>`` (each file through a temporary name and a
   rename, a file another host already put there with the same size and CRC is skipped), checking CRCs;
2. it writes ``.drain-part-<host>.json`` there, listing what it brought;
3. whichever host then finds every rank's data and ``.metadata`` among the parts writes ``manifest.json`` and
   renames the directory to ``step-<N>`` (the commit); hosts that find parts missing leave it ("waiting"): the
   last host to finish commits.

A full-state step (``"layout": "full"`` in ``tier.json``: one host's files are the whole step, every surviving
host holds a copy) is drained by one host alone (:func:`drain_full`): it claims the step with
``.drain-step-<N>.claim``, copies its files into its own ``.drain-step-<N>.<host>`` and commits them as an
ordinary ``CheckpointStore`` step (the same :func:`~agent.checkpoint.durable.seal`); the other hosts wait while
the claim is alive and then find the step committed, or take over when the claim is released without a commit
(a damaged copy) or stops moving (a host lost mid-copy). Only a claim the job's own user owns is waited for: a
name another user holds (planted in a shared root) is skipped for the next (:func:`take_claim`).

Every file is opened without following a link (``O_NOFOLLOW``) and checked on its descriptor (``fstat``).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import socket
import stat
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from agent.checkpoint.checksum import crc32
from agent.checkpoint.durable import fsync_dir, fsync_file, seal, write_durably
from agent.checkpoint.manifest import FORMAT, FORMAT_VERSION, MANIFEST, Checkpoint, CheckpointError, FileEntry
from agent.ramtier import identity

DCP_METADATA = ".metadata"
PART_PREFIX = ".drain-part-"
CHUNK = 4 * 1024 * 1024
FULL = "full"  # tier.json's layout of a full-state step
# A full-state drain's claim: touched every HEARTBEAT_S while its holder copies; one that has not changed for
# CLAIM_STALE_S (by the waiting host's own clock: hosts' clocks may differ) is taken over.
HEARTBEAT_S = 1.0
CLAIM_STALE_S = 30.0
POLL_S = 0.2
# The claim names every host of a job walks in the same order (.claim, .claim.1, ...): a name another user
# holds is skipped for the next, so a planted file never blocks the drain and the hosts still meet on one name.
CLAIM_NAMES = 8
_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC


class DrainError(Exception):
    """The drain cannot go on; the message says which file and why."""


def staging_dir(root: Path, step: int) -> Path:
    return root / f".drain-step-{step:012d}"


def final_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:012d}"  # the name ShardedStore gives a committed step


def missing_ranks(files: Mapping[str, Mapping[str, Any]], world_size: int) -> list[str]:
    """What the parts gathered so far lack for a whole DCP step (pure): a data file of every rank and the
    ``.metadata``."""
    have = {int(entry["rank"]) for name, entry in files.items() if name != DCP_METADATA}
    missing = [f"rank {rank}" for rank in range(world_size) if rank not in have]
    return missing + ([] if DCP_METADATA in files else [DCP_METADATA])


def open_regular(path: Path) -> int:
    """A descriptor of the regular file ``path`` (read-only), never through a link; DrainError otherwise."""
    try:  # O_NONBLOCK: a FIFO in its place must not block the open
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | _NOFOLLOW)
    except OSError as exc:
        if not stat.S_ISLNK(_lmode(path)):
            raise
        raise DrainError(
            f"{path} is a link: a step's files are read as regular files only, never through a link; nothing "
            "of it was drained"
        ) from exc
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise DrainError(f"{path} is not a regular file: nothing of it was drained")
    return fd


def _lmode(path: Path) -> int:
    try:
        return os.lstat(path).st_mode
    except OSError:
        return 0


def copy_file(
    source: Path, target: Path, size: int, expected_crc: int, pace: Callable[[int], None], host: str
) -> None:
    """``source`` to ``target`` through a temporary name, fsynced, its CRC checked on the way."""
    temporary = target.with_name(f".{target.name}.{host}.tmp")
    crc = 0
    done = 0
    with (
        open(open_regular(source), "rb", buffering=0) as reader,
        open(temporary, "wb", buffering=0) as writer,
    ):
        while chunk := reader.read(CHUNK):
            crc = crc32(chunk, crc)
            writer.write(chunk)
            done += len(chunk)
            pace(len(chunk))
        os.fsync(writer.fileno())
    if done != size or crc != expected_crc:
        os.unlink(temporary)
        raise DrainError(
            f"{source}: {done} bytes with CRC32 {crc:#010x}, tier.json says {size} bytes {expected_crc:#010x}: "
            "the RAM copy is damaged, nothing of it was drained"
        )
    os.rename(temporary, target)


def already_there(target: Path, size: int, expected_crc: int) -> bool:
    try:
        with open(open_regular(target), "rb", buffering=0) as handle:
            if os.fstat(handle.fileno()).st_size != size:
                return False
            crc = 0
            while chunk := handle.read(CHUNK):
                crc = crc32(chunk, crc)
        return crc == expected_crc
    except (OSError, DrainError):
        return False


class Pace:
    """Holds the copy to ``rate_mb_s`` (0: no limit) on average since it started, and reports progress."""

    def __init__(self, rate_mb_s: float, total: int, say: Callable[[dict[str, Any]], None]) -> None:
        self.rate = rate_mb_s * 1e6
        self.total = total
        self.copied = 0
        self._say = say
        self._start = time.monotonic()
        self._reported = 0

    def __call__(self, nbytes: int) -> None:
        self.copied += nbytes
        if self.rate > 0:
            ahead = self.copied / self.rate - (time.monotonic() - self._start)
            if ahead > 0:
                time.sleep(ahead)
        if self.copied - self._reported >= 16 * CHUNK or self.copied == self.total:
            self.report()

    def report(self) -> None:
        self._reported = self.copied
        self._say({"copied_bytes": self.copied, "total_bytes": self.total})


def manifest_doc(plan: Mapping[str, Any], files: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """The ``manifest.json`` ShardedStore writes for a committed step, from the parts' file lists."""
    world_size = int(plan["world_size"])
    run = plan.get("run")
    entries = [
        {"path": name, "bytes": int(e["size"]), "rank": int(e["rank"]), "crc32": int(e["crc32"])}
        for name, e in sorted(files.items())
    ]
    return {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "step": int(plan["step"]),
        "run": run if isinstance(run, int) and not isinstance(run, bool) and run >= 0 else 0,
        "time": plan.get("time") or datetime.now(timezone.utc).isoformat(timespec="milliseconds"),
        "bytes": sum(e["bytes"] for e in entries),
        "emergency": True,
        "notice_id": None,
        "files": entries,
        "checksum": "crc32",
        "host": socket.gethostname(),
        "metadata": {"world_size": world_size, "drained_from": "ram_tier"},
        "sharded": {"writer": "torch.distributed.checkpoint", "world_size": world_size, "layout": {}},
    }


def gathered(staging: Path, world_size: int) -> dict[str, Mapping[str, Any]]:
    """Every part's files; parts that disagree on a file or the world size stop the drain."""
    files: dict[str, Mapping[str, Any]] = {}
    for part in sorted(staging.glob(PART_PREFIX + "*.json")):
        doc = json.loads(part.read_bytes())
        if doc.get("world_size") != world_size:
            raise DrainError(
                f"{part}: world size {doc.get('world_size')}, this host's part says {world_size}"
            )
        for name, entry in doc["files"].items():
            if name in files and dict(files[name]) != dict(entry):
                raise DrainError(f"{part}: {name} differs from another host's copy of it")
            files[name] = entry
    return files


def drain(plan: Mapping[str, Any], say: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """Run one host's drain of one step; the final state."""
    if plan.get("layout") == FULL:
        return drain_full(plan, say)
    root = Path(plan["durable_root"])
    step = int(plan["step"])
    world_size = int(plan["world_size"])
    source = Path(plan["source"])
    host = str(plan["host"])
    files: Mapping[str, Mapping[str, Any]] = plan["files"]
    final = final_dir(root, step)
    with contextlib.suppress(CheckpointError):
        Checkpoint.load(final)
        return {"state": "committed", "path": str(final), "already": True}
    staging = staging_dir(root, step)
    staging.mkdir(parents=True, exist_ok=True)
    pace = Pace(float(plan.get("rate_mb_s") or 0), sum(int(e["size"]) for e in files.values()), say)
    for name, entry in sorted(files.items()):
        target = staging / name
        if already_there(target, int(entry["size"]), int(entry["crc32"])):
            pace(int(entry["size"]))
            continue
        copy_file(source / name, target, int(entry["size"]), int(entry["crc32"]), pace, host)
    pace.report()
    part = staging / f"{PART_PREFIX}{host}.json"
    write_durably(part.with_suffix(".tmp"), json.dumps({"world_size": world_size, "files": files}).encode())
    os.rename(part.with_suffix(".tmp"), part)
    fsync_dir(staging)
    everything = gathered(staging, world_size)
    missing = missing_ranks(everything, world_size)
    if missing:
        return {"state": "waiting", "missing": missing}
    for name in everything:
        fsync_file(staging / name)
    write_durably(staging / MANIFEST, json.dumps(manifest_doc(plan, everything), indent=1).encode())
    fsync_dir(staging)
    try:
        os.rename(staging, final)
    except OSError:
        # Another host committed first (the directory is gone, or step-<N> is there): that commit stands.
        Checkpoint.load(final)
        return {"state": "committed", "path": str(final), "already": True}
    fsync_dir(root)
    return {"state": "committed", "path": str(final)}


def committed(final: Path) -> bool:
    try:
        Checkpoint.load(final)
    except CheckpointError:
        return False
    return True


def claim_file(root: Path, step: int) -> Path:
    return root / f".drain-step-{step:012d}.claim"


def claim_names(root: Path, step: int) -> list[Path]:
    """The names a full-state step may be claimed under, in the order every host of the job tries them."""
    first = claim_file(root, step)
    return [first] + [first.with_name(f"{first.name}.{n}") for n in range(1, CLAIM_NAMES)]


@dataclass(frozen=True)
class Found:
    """What is at a claim name, judged on its own inode (never through a link)."""

    path: Path
    owner: int
    mark: tuple[int, int, int]  # inode, mtime, size: unchanged for the stale time, a trusted claim is stale
    untrusted: str | None  # why it is not waited for; None: a claim of the job's own user
    holder: str  # the host a trusted claim names ("?" when it cannot be read: being written)

    def to_json(self) -> dict[str, Any]:
        return {"path": str(self.path), "owner": self.owner, "why": self.untrusted}


def look(claim: Path) -> Found | None:
    """What holds the name ``claim`` (None: nothing). It is the job's own claim only when it is a regular file
    its user owns (the drain runs as the job's user): a link is never followed, another user's file never
    trusted, whatever it says."""
    me = os.geteuid()
    try:
        fd = os.open(claim, os.O_RDONLY | os.O_NONBLOCK | _NOFOLLOW)
    except FileNotFoundError:
        return None
    except OSError:  # a link (ELOOP), or a file this user may not read: judged by its entry
        try:
            st, data = os.lstat(claim), b""
        except FileNotFoundError:
            return None
    else:
        try:
            st = os.fstat(fd)
            data = os.read(fd, 4096) if stat.S_ISREG(st.st_mode) else b""
        finally:
            os.close(fd)
    if stat.S_ISLNK(st.st_mode):
        why: str | None = f"a link owned by uid {st.st_uid}, not a claim (never followed)"
    elif not stat.S_ISREG(st.st_mode):
        why = f"not a regular file, owned by uid {st.st_uid}"
    elif st.st_uid != me:
        why = f"owned by uid {st.st_uid}, not by the job's uid {me}"
    else:
        why = None
    holder = "?"
    with contextlib.suppress(ValueError):
        doc = json.loads(data)
        if isinstance(doc, dict) and "host" in doc:
            holder = str(doc["host"])
    return Found(claim, st.st_uid, (st.st_ino, st.st_mtime_ns, st.st_size), why, holder)


class _Claimant:
    """One host's way to a claim of one step (:func:`take_claim`)."""

    def __init__(
        self,
        names: list[Path],
        host: str,
        stale_s: float,
        waiting: Callable[[str], None],
        skipped: Callable[[dict[str, Any]], None],
    ) -> None:
        self.names, self.host, self.stale_s = names, host, stale_s
        self.waiting, self.skipped = waiting, skipped
        self.seen: tuple[str, int, int, int] | None = None  # the trusted claim waited for: name and mark
        self.since = time.monotonic()
        self.told: set[tuple[str, int]] = set()  # untrusted names told already (name, inode)

    def attempt(self) -> tuple[Path, int] | bool:
        """Walk the names once: the claim taken (its path and descriptor), True to walk again at once (a
        claim went just now), False to wait (another host of the job holds the first name that is not
        another user's). DrainError when every name is another user's."""
        untrusted: list[Found] = []
        for claim in self.names:
            try:
                fd = os.open(claim, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o644)
            except FileExistsError:
                found = look(claim)
                if found is None:  # released just now
                    return True
                if found.untrusted is not None:
                    untrusted.append(found)
                    if (claim.name, found.mark[0]) not in self.told:
                        self.told.add((claim.name, found.mark[0]))
                        self.skipped(found.to_json())
                    continue
                return self._wait_for(found)
            doc = {"host": self.host, "pid": os.getpid(), "uid": os.geteuid()}
            os.write(fd, json.dumps(doc).encode())
            return claim, fd
        raise DrainError(
            f"every claim name of this step in {self.names[0].parent} is held by another user or is not a "
            f"file: {'; '.join(f'{f.path.name}: {f.untrusted}' for f in untrusted)}. A claim the job's user "
            "does not own is never waited for, and another user's file cannot be removed from a shared (sticky) "
            "directory: have them removed (by root or their owner), or give the job a durable root only its "
            "user may write; nothing was drained, the step stays in RAM"
        )

    def _wait_for(self, found: Found) -> bool:
        """Another host of the job holds ``found``: wait while it moves, take it over once it has not for the
        stale time (by this host's clock: hosts' clocks may differ)."""
        mark = (found.path.name, *found.mark)
        if self.seen is None or mark[:2] != self.seen[:2]:
            self.waiting(found.holder)
        if mark != self.seen:
            self.seen, self.since = mark, time.monotonic()
            return False
        if time.monotonic() - self.since < self.stale_s:
            return False
        # Moved aside under a name nobody can foresee (a file planted there would stop the rename), then gone.
        aside = found.path.with_name(f"{found.path.name}.stale-{self.host}-{secrets.token_hex(4)}")
        with contextlib.suppress(OSError):  # another host may have taken it first
            os.rename(found.path, aside)
            os.unlink(aside)
        self.seen = None
        return True


def take_claim(
    root: Path,
    step: int,
    host: str,
    stale_s: float,
    done: Callable[[], bool],
    waiting: Callable[[str], None] = lambda holder: None,
    skipped: Callable[[dict[str, Any]], None] = lambda found: None,
) -> tuple[Path, int] | None:
    """Wait until this host holds a claim of ``step`` (its path and an open descriptor), or the step is
    committed meanwhile (None).

    Every host of the job walks :func:`claim_names` in order and competes for the first name that is free or
    holds a claim of the job's own user (:func:`look`): a name another user holds, or a link, is skipped for
    the next (``skipped`` is told each once) and never waited for, since in a shared sticky root it can be
    neither trusted nor removed. A trusted claim whose inode, size and time have not changed for ``stale_s``
    is moved aside and taken over; ``waiting(holder)`` is told each new one this host waits for. DrainError
    when every name is another user's."""
    claimant = _Claimant(claim_names(root, step), host, stale_s, waiting, skipped)
    while not done():
        taken = claimant.attempt()
        if isinstance(taken, tuple):
            return taken
        if not taken:
            time.sleep(POLL_S)
    return None


def release_claim(claim: Path, fd: int) -> None:
    """Remove ``claim`` if it is still this host's (``fd``: another host may have taken it over as stale),
    and close ``fd``."""
    try:
        mine, there = os.fstat(fd), os.lstat(claim)
        if (mine.st_dev, mine.st_ino) == (there.st_dev, there.st_ino):
            os.unlink(claim)
    except OSError:
        pass
    finally:
        os.close(fd)


def drain_full(plan: Mapping[str, Any], say: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """Drain a full-state step that this host holds whole: under the step's claim, its files into this host's
    own staging directory, sealed and renamed to ``step-<N>`` as CheckpointStore.save does. A host that finds
    the step committed (before or after waiting for another host's claim) copies nothing."""
    root, step, host = Path(plan["durable_root"]), int(plan["step"]), str(plan["host"])
    whole = _whole(plan, step)
    final = final_dir(root, step)
    already = {"state": "committed", "path": str(final), "already": True}
    if committed(final):
        return already
    root.mkdir(parents=True, exist_ok=True)
    stale_s = float(plan.get("claim_stale_s") or CLAIM_STALE_S)
    held = take_claim(
        root,
        step,
        host,
        stale_s,
        lambda: committed(final),
        lambda by: say({"claimed_by": by}),
        lambda found: say({"skipped_claim": found}),
    )
    if held is None:
        return already
    claim, claim_fd = held
    say({"claimed_by": None})
    staging = root / f".drain-step-{step:012d}.{host}"
    stop = threading.Event()
    # The claim is alive while this host holds it, through long fsyncs too: the waiting hosts wait.
    heartbeat = threading.Thread(target=_heartbeat, args=(claim_fd, stop), name="drain-claim", daemon=True)
    heartbeat.start()
    try:
        if committed(final):  # committed between the last look and the claim
            return already
        shutil.rmtree(staging, ignore_errors=True)  # an earlier try of this host's
        staging.mkdir()
        _stage_full(plan, whole, staging, say)
        if not _rename_full(staging, final):
            return already
        fsync_dir(root)
        return {"state": "committed", "path": str(final)}
    finally:
        stop.set()
        heartbeat.join()
        shutil.rmtree(staging, ignore_errors=True)
        release_claim(claim, claim_fd)


def _whole(plan: Mapping[str, Any], step: int) -> Mapping[str, Any]:
    """The full-state step's files and their sizes (``step_files``), each held whole by this host; DrainError
    when the plan lists none or this host's copy of one is not whole."""
    files: Mapping[str, Mapping[str, Any]] = plan["files"]
    whole = plan.get("step_files")
    if not isinstance(whole, Mapping) or not whole:
        raise DrainError(f"tier.json of step {step} lists no step_files: not a full-state step")
    lacking = [n for n, size in sorted(whole.items()) if int(files.get(n, {}).get("size", -1)) != int(size)]
    if lacking:
        raise DrainError(f"this host's copy of step {step} lacks {', '.join(lacking)}: it is not whole")
    return whole


def _stage_full(
    plan: Mapping[str, Any], whole: Mapping[str, Any], staging: Path, say: Callable[[dict[str, Any]], None]
) -> None:
    """The step's files copied (paced, their CRCs checked) into ``staging`` and sealed there."""
    files: Mapping[str, Mapping[str, Any]] = plan["files"]
    host = str(plan["host"])
    pace = Pace(float(plan.get("rate_mb_s") or 0), sum(int(size) for size in whole.values()), say)
    entries = {}
    for name in sorted(whole):
        size, crc = int(files[name]["size"]), int(files[name]["crc32"])
        copy_file(Path(plan["source"]) / name, staging / name, size, crc, pace, host)
        entries[name] = FileEntry(name, size, crc)
    pace.report()
    metadata = plan.get("metadata")
    notice = plan.get("notice_id")
    run = plan.get("run")
    seal(  # the manifest CheckpointStore.save writes; the files are fsynced and their CRCs checked already
        staging,
        int(plan["step"]),
        emergency=True,
        notice_id=notice if isinstance(notice, str) else None,
        metadata={**(metadata if isinstance(metadata, dict) else {}), "drained_from": "ram_tier"},
        presealed=entries,
        run=run if isinstance(run, int) and not isinstance(run, bool) and run >= 0 else 0,
    )


def _rename_full(staging: Path, final: Path) -> bool:
    """Whether ``staging`` was renamed to ``final``: False when another host committed the step after all (a
    claim taken over as stale); DrainError when something else is there."""
    try:
        os.rename(staging, final)
    except OSError as exc:
        if committed(final):
            return False
        raise DrainError(
            f"{final} is there and is not a committed step ({exc}): nothing replaced it"
        ) from exc
    return True


def _heartbeat(claim_fd: int, stop: threading.Event) -> None:
    """Touch the claim this host holds, by its descriptor: the file it created, whatever its name holds now."""
    while not stop.wait(HEARTBEAT_S):
        with contextlib.suppress(OSError):
            os.utime(claim_fd)


def become(uid: int, gid: int) -> None:
    """Take the job's user and drop every capability (after the imports: the interpreter may be readable by
    the agent's user alone); :mod:`agent.ramtier.identity` says how, and what fails when it may not."""
    identity.become(uid, gid)


def main() -> int:
    def say(doc: dict[str, Any]) -> None:
        sys.stdout.write(json.dumps(doc) + "\n")
        sys.stdout.flush()

    try:
        plan = json.loads(sys.stdin.read())
        become(int(plan["uid"]), int(plan["gid"]))
        identity.check_writable(Path(plan["durable_root"]))
        outcome = drain(plan, say)
    except (OSError, DrainError, CheckpointError, ValueError, KeyError, TypeError) as exc:
        outcome = {"state": "failed", "error": f"{type(exc).__name__}: {exc}"}
    say(outcome)
    return 0 if outcome["state"] != "failed" else 1


if __name__ == "__main__":
    sys.exit(main())
