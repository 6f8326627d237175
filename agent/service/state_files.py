"""Persisted state: active notices and the event sequence (``state.json``, written atomically) and the
history log of notices, reports and agent runs (``history.jsonl``, appended, rotated by size).

The functions here block (they fsync); the agent calls them from a worker thread. A state file that cannot
be read is moved aside and the agent starts clean; a state directory that cannot be used leaves the agent
running without persistence, and says so in status.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from agent.core.errors import NoticeError, StateError
from agent.core.notice import Notice, format_time

STATE_SCHEMA = 1
STATE_FILE = "state.json"
HISTORY_FILE = "history.jsonl"


@dataclass(frozen=True)
class LoadedState:
    seq: int = 0
    notices: tuple[Notice, ...] = ()
    previous_clean: bool | None = None  # None: no earlier run recorded
    previous_boot_id: str | None = None
    moved_aside: Path | None = None  # where a corrupt state file was moved
    problem: str | None = None  # why it was moved aside
    extra: Mapping[str, Any] = field(default_factory=dict)


def prepare_dir(state_dir: Path) -> None:
    """Create the state directory if needed and check it is writable; raise StateError if not."""
    try:
        state_dir.mkdir(mode=0o750, parents=True, exist_ok=True)
    except OSError as exc:
        raise StateError(f"cannot create state directory {state_dir}: {exc.strerror or exc}") from exc
    if not state_dir.is_dir():
        raise StateError(f"state directory {state_dir} is not a directory")
    try:
        with tempfile.NamedTemporaryFile(dir=state_dir, prefix=".probe-", delete=True):
            pass
    except OSError as exc:
        raise StateError(f"state directory {state_dir} is not writable: {exc.strerror or exc}") from exc


def load_state(state_dir: Path, now: datetime) -> LoadedState:
    """Read ``state.json``; a corrupt or truncated file is moved aside (``state.json.corrupt-<time>``)."""
    path = state_dir / STATE_FILE
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return LoadedState()
    except OSError as exc:
        raise StateError(f"cannot read {path}: {exc.strerror or exc}") from exc
    try:
        doc = json.loads(raw)
        if not isinstance(doc, dict):
            raise ValueError(f"expected a JSON object, found {type(doc).__name__}")
        if doc.get("schema") != STATE_SCHEMA:
            raise ValueError(f"unknown schema {doc.get('schema')!r}")
        seq = doc.get("seq", 0)
        if not isinstance(seq, int) or isinstance(seq, bool) or seq < 0:
            raise ValueError(f"bad sequence number {seq!r}")
        notices = tuple(Notice.from_json(n) for n in doc.get("notices", []))
        clean = doc.get("clean_shutdown")
        return LoadedState(
            seq=seq,
            notices=notices,
            previous_clean=bool(clean) if clean is not None else False,
            previous_boot_id=doc.get("boot_id") if isinstance(doc.get("boot_id"), str) else None,
            extra=extra if isinstance(extra := doc.get("extra"), dict) else {},
        )
    except (ValueError, NoticeError, TypeError) as exc:
        aside = path.with_name(f"{STATE_FILE}.corrupt-{now.strftime('%Y%m%dT%H%M%S')}")
        try:
            os.replace(path, aside)
        except OSError as move_exc:
            raise StateError(f"{path} is corrupt ({exc}) and cannot be moved aside: {move_exc}") from exc
        return LoadedState(moved_aside=aside, problem=str(exc), previous_clean=False)


def state_document(
    seq: int, notices: tuple[Notice, ...], boot_id: str, clean: bool, now: datetime, extra: Mapping[str, Any]
) -> dict[str, Any]:
    return {
        "schema": STATE_SCHEMA,
        "seq": seq,
        "boot_id": boot_id,
        "clean_shutdown": clean,
        "saved_at": format_time(now),
        "notices": [n.to_json(now) for n in notices],
        "extra": dict(extra),
    }


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so a reader sees the old or the new file, never a torn one."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def save_state(state_dir: Path, document: Mapping[str, Any]) -> None:
    write_atomic(state_dir / STATE_FILE, json.dumps(document, separators=(",", ":")).encode())


class History:
    """Append-only JSON-lines log; rotated to ``history.jsonl.1`` when it grows past ``max_bytes``."""

    def __init__(self, state_dir: Path, max_bytes: int) -> None:
        self.path = state_dir / HISTORY_FILE
        self.max_bytes = max_bytes

    def write(self, lines: list[str]) -> None:
        """Append encoded records and fsync (called from a worker thread)."""
        if not lines:
            return
        data = "".join(line + "\n" for line in lines).encode()
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            size = 0
        if size and size + len(data) > self.max_bytes:
            os.replace(self.path, self.path.with_name(HISTORY_FILE + ".1"))
        with self.path.open("ab") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())

    def records(self) -> Iterator[dict[str, Any]]:
        """Every readable record, oldest first (the rotated file, then the current one). A torn last line
        from a crash is skipped."""
        for path in (self.path.with_name(HISTORY_FILE + ".1"), self.path):
            try:
                handle = path.open("rb")
            except FileNotFoundError:
                continue
            with handle:
                for raw in handle:
                    try:
                        record = json.loads(raw)
                    except ValueError:
                        continue
                    if isinstance(record, dict):
                        yield record
