"""The private channel through which a training process tells ``preemptd exec`` that it stopped for a notice
after its emergency checkpoint was committed, so exec can exit 75 even when a launcher (torchrun) turns the
workers' 75 into 1.

``preemptd exec`` creates a private directory and names it in ``PREEMPTD_EXEC_DIR`` for the command it runs.
Whenever the client commits an emergency checkpoint (``CheckpointStore.save(emergency=True)``, the sharded
store's commit on every rank, the Hugging Face callback's sealed emergency save) it writes one small JSON record
there, atomically. An emergency save that fails (a full disk) while an earlier step is committed records that
step instead, with ``fallback: true``, ``failed_step`` and ``error``: the notice was handled as well as it could
be, and the job resumes from that step. Without the variable nothing is written. Standard library only.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import uuid
import warnings
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ENV = "PREEMPTD_EXEC_DIR"
SIGNALLED = "signalled"  # created by exec when it receives a signal that stops the command
RECORD_PREFIX = "emergency-"
RECORD_SUFFIX = ".json"


def channel() -> Path | None:
    """The directory ``preemptd exec`` gave this process, or None when it does not run under exec."""
    value = os.environ.get(ENV)
    return Path(value) if value else None


def record_emergency(
    step: int,
    *,
    path: str | Path | None = None,
    notice_id: str | None = None,
    sharded: bool = False,
    **extra: Any,
) -> Path | None:
    """Record that this process committed an emergency checkpoint of ``step`` (call it only once the
    checkpoint is durable). Returns the record's path, or None outside ``preemptd exec``.

    A failure to write is a warning, never an exception: it must not cost the job its orderly exit."""
    directory = channel()
    if directory is None:
        return None
    doc = {
        "step": step,
        "path": str(path) if path is not None else None,
        "notice_id": notice_id,
        "sharded": sharded,
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "rank": _int_env("RANK"),
        "world_size": _int_env("WORLD_SIZE"),
        "time": datetime.now(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z"),
        **extra,
    }
    name = f"{RECORD_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}{RECORD_SUFFIX}"
    staged = directory / f".{name}.tmp"
    try:
        staged.write_text(json.dumps(doc))
        os.rename(staged, directory / name)  # exec never reads half a record
    except OSError as exc:
        warnings.warn(
            f"cannot tell preemptd exec about the emergency checkpoint of step {step} "
            f"({ENV}={directory}): {exc}",
            RuntimeWarning,
            stacklevel=2,
        )
        return None
    return directory / name


def stopped_from_outside() -> bool | None:
    """Whether ``preemptd exec`` received a signal that stops its command (SIGTERM, SIGINT, SIGHUP, SIGQUIT):
    the job is being stopped from outside, not by its own launcher. None outside exec (it cannot be told)."""
    directory = channel()
    if directory is None:
        return None
    return (directory / SIGNALLED).exists()


def withdraw() -> list[Path]:
    """Remove this process' records: it did not stop after all (a job that shrank goes on without the node
    that had the notice). The paths removed; nothing outside ``preemptd exec``."""
    directory = channel()
    removed: list[Path] = []
    if directory is None:
        return removed
    prefix = f"{RECORD_PREFIX}{os.getpid()}-"
    try:
        entries = list(directory.iterdir())
    except OSError:
        return removed
    for entry in entries:
        if entry.name.startswith(prefix) and entry.name.endswith(RECORD_SUFFIX):
            with contextlib.suppress(FileNotFoundError):
                entry.unlink()
                removed.append(entry)
    return removed


def withdraw_gone() -> list[Path]:
    """Remove the records of processes of this ``preemptd exec`` that are gone: a process of the job starting
    now means the job went on after them (torchrun restarted its workers: a restart, a host joining an elastic
    job), so their "stopped for a notice" is stale and must not turn a later failure into 75. The paths
    removed; nothing outside exec. Records of live processes (another rank still saving) stay."""
    directory = channel()
    removed: list[Path] = []
    if directory is None:
        return removed
    try:
        entries = list(directory.iterdir())
    except OSError:
        return removed
    for entry in entries:
        name = entry.name
        if not (name.startswith(RECORD_PREFIX) and name.endswith(RECORD_SUFFIX)):
            continue
        pid = name[len(RECORD_PREFIX) :].split("-", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            with contextlib.suppress(FileNotFoundError):
                entry.unlink()
                removed.append(entry)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process: alive
    return True


def read_records(directory: str | Path) -> list[dict[str, Any]]:
    """The records in ``directory``, oldest first; unreadable or malformed ones are left out."""
    found: list[dict[str, Any]] = []
    try:
        entries = sorted(Path(directory).iterdir())
    except OSError:
        return found
    for entry in entries:
        if not (entry.name.startswith(RECORD_PREFIX) and entry.name.endswith(RECORD_SUFFIX)):
            continue
        try:
            doc = json.loads(entry.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(doc, dict) and isinstance(doc.get("step"), int):
            found.append(doc)
    found.sort(key=lambda doc: str(doc.get("time", "")))
    return found


def _int_env(name: str) -> int | None:
    value = os.environ.get(name, "")
    return int(value) if value.isdigit() else None
