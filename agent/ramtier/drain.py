"""The drain: copies one host's part of a RAM-tier step into the job's durable root, and commits the step there
as an ordinary ``ShardedStore`` step (``step-<N>`` with its ``manifest.json``) once every host's part is in.

It runs as a child process of the agent under the job's own user (started by a root agent, it takes the
job's uid and gid from the plan before it opens any file), so it can write only where the job itself could: a
client names the durable root, and a root agent must not write there for it. The plan comes as one JSON object on stdin; progress goes out as JSON lines on stdout
(``{"copied_bytes", "total_bytes"}``, then ``{"state": "committed" | "waiting", ...}``). docs/ram-tier.md
describes the protocol between the hosts:

1. every host copies its files into ``<root>/.drain-step-<N>`` (each file through a temporary name and a
   rename, a file another host already put there with the same size and CRC is skipped), checking CRCs;
2. it writes ``.drain-part-<host>.json`` there, listing what it brought;
3. whichever host then finds every rank's data and ``.metadata`` among the parts writes ``manifest.json`` and
   renames the directory to ``step-<N>`` (the commit); hosts that find parts missing leave it ("waiting"): the
   last host to finish commits.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import time
import zlib
from collections.abc import Callable, Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from agent.client.durable import fsync_dir, fsync_file, write_durably
from agent.client.manifest import FORMAT, FORMAT_VERSION, MANIFEST, Checkpoint, CheckpointError

DCP_METADATA = ".metadata"
PART_PREFIX = ".drain-part-"
CHUNK = 4 * 1024 * 1024


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
    source: Path, target: Path, size: int, crc32: int, pace: Callable[[int], None], host: str
) -> None:
    """``source`` to ``target`` through a temporary name, fsynced, its CRC checked on the way."""
    temporary = target.with_name(f".{target.name}.{host}.tmp")
    crc = 0
    done = 0
    with open(source, "rb", buffering=0) as reader, open(temporary, "wb", buffering=0) as writer:
        while chunk := reader.read(CHUNK):
            crc = zlib.crc32(chunk, crc)
            writer.write(chunk)
            done += len(chunk)
            pace(len(chunk))
        os.fsync(writer.fileno())
    if done != size or crc != crc32:
        os.unlink(temporary)
        raise DrainError(
            f"{source}: {done} bytes with CRC32 {crc:#010x}, tier.json says {size} bytes {crc32:#010x}: the RAM "
            "copy is damaged, nothing of it was drained"
        )
    os.rename(temporary, target)


def already_there(target: Path, size: int, crc32: int) -> bool:
    try:
        if target.stat().st_size != size:
            return False
        crc = 0
        with open(target, "rb", buffering=0) as handle:
            while chunk := handle.read(CHUNK):
                crc = zlib.crc32(chunk, crc)
        return crc == crc32
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


def become(uid: int, gid: int) -> None:
    """Drop to the job's user (after the imports: the interpreter may be readable by root alone)."""
    if os.geteuid() == 0 and uid != 0:
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)


def main() -> int:
    def say(doc: dict[str, Any]) -> None:
        sys.stdout.write(json.dumps(doc) + "\n")
        sys.stdout.flush()

    try:
        plan = json.loads(sys.stdin.read())
        become(int(plan["uid"]), int(plan["gid"]))
        outcome = drain(plan, say)
    except (OSError, DrainError, CheckpointError, ValueError, KeyError, TypeError) as exc:
        outcome = {"state": "failed", "error": f"{type(exc).__name__}: {exc}"}
    say(outcome)
    return 0 if outcome["state"] != "failed" else 1


if __name__ == "__main__":
    sys.exit(main())
