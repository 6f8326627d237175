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
ordinary ``CheckpointStore`` step (the same :func:`~agent.client.durable.seal`); the other hosts wait while
the claim is alive and then find the step committed, or take over when the claim is released without a commit
(a damaged copy) or stops moving (a host lost mid-copy).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from agent.client.checksum import crc32
from agent.client.durable import fsync_dir, fsync_file, seal, write_durably
from agent.client.manifest import FORMAT, FORMAT_VERSION, MANIFEST, Checkpoint, CheckpointError, FileEntry
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


def copy_file(
    source: Path, target: Path, size: int, expected_crc: int, pace: Callable[[int], None], host: str
) -> None:
    """``source`` to ``target`` through a temporary name, fsynced, its CRC checked on the way."""
    temporary = target.with_name(f".{target.name}.{host}.tmp")
    crc = 0
    done = 0
    with open(source, "rb", buffering=0) as reader, open(temporary, "wb", buffering=0) as writer:
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
        if target.stat().st_size != size:
            return False
        crc = 0
        with open(target, "rb", buffering=0) as handle:
            while chunk := handle.read(CHUNK):
                crc = crc32(chunk, crc)
        return crc == expected_crc
    except OSError:
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


def take_claim(
    claim: Path,
    host: str,
    stale_s: float,
    done: Callable[[], bool],
    waiting: Callable[[str], None] = lambda holder: None,
) -> bool:
    """Wait until this host holds ``claim`` (True), or the step is committed meanwhile (False). A claim whose
    name, size and time have not changed for ``stale_s`` is moved aside and taken over. ``waiting(holder)``
    is told each new claim this host finds another host holding."""
    seen: tuple[int, int, int] | None = None
    since = time.monotonic()
    while not done():
        try:
            fd = os.open(claim, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            try:
                st = os.stat(claim)
            except FileNotFoundError:  # released just now: try again
                continue
            mark = (st.st_ino, st.st_mtime_ns, st.st_size)
            if seen is None or mark[0] != seen[0]:
                waiting(_holder(claim))
            if mark != seen:
                seen, since = mark, time.monotonic()
            elif time.monotonic() - since >= stale_s:
                aside = claim.with_name(f"{claim.name}.stale-{host}")
                with contextlib.suppress(FileNotFoundError):  # another host may have taken it first
                    os.rename(claim, aside)
                    os.unlink(aside)
                continue
            time.sleep(POLL_S)
            continue
        with os.fdopen(fd, "w") as handle:
            handle.write(json.dumps({"host": host, "pid": os.getpid()}))
        return True
    return False


def _holder(claim: Path) -> str:
    """The host named in a claim ("?" when it cannot be read: being written, or gone)."""
    try:
        doc = json.loads(claim.read_text())
    except (OSError, ValueError):
        return "?"
    return str(doc.get("host", "?")) if isinstance(doc, dict) else "?"


def release_claim(claim: Path, host: str) -> None:
    """Remove ``claim`` if this host still holds it (another may have taken it over)."""
    with contextlib.suppress(OSError, ValueError):
        if json.loads(claim.read_text()).get("host") == host:
            os.unlink(claim)


def drain_full(plan: Mapping[str, Any], say: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """Drain a full-state step that this host holds whole: under the step's claim, its files into this host's
    own staging directory, sealed and renamed to ``step-<N>`` as CheckpointStore.save does. A host that finds
    the step committed (before or after waiting for another host's claim) copies nothing."""
    root, step, host = Path(plan["durable_root"]), int(plan["step"]), str(plan["host"])
    files: Mapping[str, Mapping[str, Any]] = plan["files"]
    whole = plan.get("step_files")
    if not isinstance(whole, Mapping) or not whole:
        raise DrainError(f"tier.json of step {step} lists no step_files: not a full-state step")
    lacking = [n for n, size in sorted(whole.items()) if int(files.get(n, {}).get("size", -1)) != int(size)]
    if lacking:
        raise DrainError(f"this host's copy of step {step} lacks {', '.join(lacking)}: it is not whole")
    final = final_dir(root, step)
    already = {"state": "committed", "path": str(final), "already": True}
    if committed(final):
        return already
    root.mkdir(parents=True, exist_ok=True)
    claim = claim_file(root, step)
    stale_s = float(plan.get("claim_stale_s") or CLAIM_STALE_S)
    if not take_claim(claim, host, stale_s, lambda: committed(final), lambda by: say({"claimed_by": by})):
        return already
    say({"claimed_by": None})
    staging = root / f".drain-step-{step:012d}.{host}"
    stop = threading.Event()
    # The claim is alive while this host holds it, through long fsyncs too: the waiting hosts wait.
    threading.Thread(target=_heartbeat, args=(claim, stop), name="drain-claim", daemon=True).start()
    try:
        if committed(final):  # committed between the last look and the claim
            return already
        shutil.rmtree(staging, ignore_errors=True)  # an earlier try of this host's
        staging.mkdir()
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
            staging, step, emergency=True, notice_id=notice if isinstance(notice, str) else None,
            metadata={**(metadata if isinstance(metadata, dict) else {}), "drained_from": "ram_tier"},
            presealed=entries, run=run if isinstance(run, int) and not isinstance(run, bool) and run >= 0 else 0,
        )  # fmt: skip
        try:
            os.rename(staging, final)
        except OSError as exc:
            if committed(final):  # another host committed it after all (a claim taken over as stale)
                return already
            raise DrainError(
                f"{final} is there and is not a committed step ({exc}): nothing replaced it"
            ) from exc
        fsync_dir(root)
        return {"state": "committed", "path": str(final)}
    finally:
        stop.set()
        shutil.rmtree(staging, ignore_errors=True)
        release_claim(claim, host)


def _heartbeat(claim: Path, stop: threading.Event) -> None:
    while not stop.wait(HEARTBEAT_S):
        with contextlib.suppress(OSError):
            os.utime(claim)


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
