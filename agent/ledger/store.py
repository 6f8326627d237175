"""The ledger's SQLite file (stdlib ``sqlite3``, WAL): the schema, writing facts, retention, reading them
back, and a damaged file moved aside for a fresh one. Blocking: the agent calls the writer on a thread of its
own (:class:`Writer`), the report reads with a read-only connection of its own."""

from __future__ import annotations

import contextlib
import os
import queue
import sqlite3
import threading
from collections.abc import Callable, Iterable
from dataclasses import astuple, fields
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from agent.ledger.facts import Facts, NoticeFact, ReportFact

SCHEMA_VERSION = 1
BUSY_TIMEOUT_S = 30.0
_NOTICE_COLUMNS = tuple(f.name for f in fields(NoticeFact))
_REPORT_COLUMNS = tuple(f.name for f in fields(ReportFact))
SCHEMA = """
CREATE TABLE IF NOT EXISTS notices (
    id TEXT PRIMARY KEY, kind TEXT NOT NULL, source TEXT NOT NULL, severity TEXT NOT NULL,
    drill INTEGER NOT NULL, detected_at REAL NOT NULL, deadline REAL, cleared_at REAL, time REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS reports (
    seq INTEGER PRIMARY KEY, time REAL NOT NULL, job TEXT NOT NULL, pid INTEGER, rank INTEGER,
    gpus INTEGER, kind TEXT NOT NULL, phase TEXT NOT NULL, step INTEGER, duration_s REAL, bytes INTEGER,
    emergency INTEGER NOT NULL, notice_id TEXT, tier TEXT, fallback_step INTEGER,
    world_size INTEGER, previous_world_size INTEGER, seconds REAL, reason TEXT, complete_s REAL
);
CREATE INDEX IF NOT EXISTS reports_time ON reports (time);
CREATE INDEX IF NOT EXISTS notices_time ON notices (time);
"""
# Columns added to ``reports`` since the first schema (membership reports, a snapshot's ``complete_s``), with
# their types: :func:`connect` adds those a file lacks, and :func:`read` of a file not yet opened for writing
# reads them as NULL. The schema version stays 1: an older agent names the columns it writes and reads, so
# it still uses the file.
_ADDED_REPORT_COLUMNS = (
    ("world_size", "INTEGER"),
    ("previous_world_size", "INTEGER"),
    ("seconds", "REAL"),
    ("reason", "TEXT"),
    ("complete_s", "REAL"),
)
# A notice keeps the time it was first seen; later events change its deadline, clearing and severity.
_UPSERT_NOTICE = (
    f"INSERT INTO notices ({', '.join(_NOTICE_COLUMNS)}) VALUES ({', '.join('?' * len(_NOTICE_COLUMNS))}) "
    "ON CONFLICT (id) DO UPDATE SET severity = excluded.severity, deadline = excluded.deadline, "
    "cleared_at = excluded.cleared_at, time = excluded.time"
)
_INSERT_REPORT = (
    f"INSERT INTO reports ({', '.join(_REPORT_COLUMNS)}) VALUES ({', '.join('?' * len(_REPORT_COLUMNS))})"
)
# The bytes every SQLite 3 database file starts with.
_MAGIC = b"SQLite format 3\x00"


class LedgerCorrupt(Exception):
    """The file is not a usable ledger (not SQLite, damaged, or another program's tables)."""


def _check(conn: sqlite3.Connection) -> None:
    row = conn.execute("PRAGMA quick_check").fetchone()
    if row is None or row[0] != "ok":
        raise LedgerCorrupt(f"quick_check: {row[0] if row else 'no answer'}")
    version = conn.execute("PRAGMA user_version").fetchone()[0]
    if version not in (0, SCHEMA_VERSION):
        raise LedgerCorrupt(f"schema version {version}, this agent writes {SCHEMA_VERSION}")


def connect(path: Path) -> sqlite3.Connection:
    """Open (creating) the ledger for writing: WAL, the schema, checked; LedgerCorrupt if it is damaged."""
    with contextlib.suppress(FileNotFoundError):
        with path.open("rb") as handle:
            head = handle.read(len(_MAGIC))
        if head and head != _MAGIC[: len(head)]:
            raise LedgerCorrupt("not an SQLite database")
    # Another program holding the file (a backup, sqlite3 in a shell) delays the writer thread, not the agent.
    conn = sqlite3.connect(path, timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False)
    try:
        conn.execute("PRAGMA journal_mode=WAL")
        # WAL with synchronous=NORMAL: a power cut may lose the last transactions, never the file.
        conn.execute("PRAGMA synchronous=NORMAL")
        _check(conn)
        conn.executescript(SCHEMA)
        _add_columns(conn)
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
    except sqlite3.DatabaseError as exc:
        conn.close()
        raise LedgerCorrupt(str(exc)) from None
    except BaseException:
        conn.close()
        raise
    return conn


def _report_columns(conn: sqlite3.Connection) -> set[str]:
    return {row[1] for row in conn.execute("PRAGMA table_info(reports)")}


def _add_columns(conn: sqlite3.Connection) -> None:
    """Bring a ledger written by an older agent up to date: the ``reports`` columns it lacks, NULL in its
    rows (one transaction: a crash leaves the file as it was or migrated)."""
    have = _report_columns(conn)
    missing = [(name, kind) for name, kind in _ADDED_REPORT_COLUMNS if name not in have]
    if not missing:
        return
    with conn:
        conn.execute("BEGIN")
        for name, kind in missing:
            conn.execute(f"ALTER TABLE reports ADD COLUMN {name} {kind}")


def move_aside(path: Path, now: datetime) -> Path:
    """Rename a damaged ledger (and its WAL and shared-memory files) to ``<name>.corrupt-<time>``."""
    stamp = now.astimezone(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    target = path.with_name(f"{path.name}.corrupt-{stamp}")
    for suffix in ("", "-wal", "-shm"):
        with contextlib.suppress(FileNotFoundError):
            os.replace(f"{path}{suffix}", f"{target}{suffix}")
    return target


def write(conn: sqlite3.Connection, notices: Iterable[NoticeFact], reports: Iterable[ReportFact]) -> None:
    """One transaction: many facts per fsync."""
    with conn:
        conn.execute("BEGIN")
        conn.executemany(_UPSERT_NOTICE, [astuple(n) for n in notices])
        conn.executemany(_INSERT_REPORT, [astuple(r) for r in reports])


def prune(conn: sqlite3.Connection, before: float) -> int:
    """Delete facts older than ``before`` (Unix seconds); how many were deleted."""
    with conn:
        conn.execute("BEGIN")
        gone = conn.execute("DELETE FROM reports WHERE time < ?", (before,)).rowcount
        gone += conn.execute("DELETE FROM notices WHERE time < ?", (before,)).rowcount
    return gone


def read(path: Path, since: float | None = None, job: str | None = None) -> Facts:
    """The facts from ``since`` on (every job, or one), read-only: the agent may be writing meanwhile (WAL).
    FileNotFoundError when there is no ledger; LedgerCorrupt when it cannot be read."""
    if not path.exists():
        raise FileNotFoundError(f"{path}: no ledger here")
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    except sqlite3.Error as exc:
        raise LedgerCorrupt(f"{path}: {exc}") from None
    try:
        start = since if since is not None else float("-inf")
        notices = conn.execute(
            f"SELECT {', '.join(_NOTICE_COLUMNS)} FROM notices WHERE time >= ? ORDER BY detected_at", (start,)
        ).fetchall()
        # A file an older agent wrote and no agent has opened since lacks the added columns: NULL for them.
        have = _report_columns(conn)
        added = {name for name, _ in _ADDED_REPORT_COLUMNS}
        columns = [c for c in _REPORT_COLUMNS if c in have or c not in added]
        query = f"SELECT {', '.join(columns)} FROM reports WHERE time >= ?"
        args: tuple[Any, ...] = (start,)
        if job is not None:
            query += " AND job = ?"
            args += (job,)
        reports = conn.execute(query + " ORDER BY time, seq", args).fetchall()
    except sqlite3.DatabaseError as exc:
        raise LedgerCorrupt(f"{path}: {exc}") from None
    finally:
        conn.close()
    return Facts(
        notices=tuple(_notice(dict(zip(_NOTICE_COLUMNS, row, strict=True))) for row in notices),
        reports=tuple(_report(dict(zip(columns, row, strict=True))) for row in reports),
    )


def _notice(row: dict[str, Any]) -> NoticeFact:
    row["drill"] = bool(row["drill"])
    return NoticeFact(**row)


def _report(row: dict[str, Any]) -> ReportFact:
    row["emergency"] = bool(row["emergency"])
    return ReportFact(**row)


class Writer:
    """The one thread that writes the ledger: the agent's loop only queues facts (never blocks on the
    disk). :meth:`open` runs on a worker thread too, so a damaged file is moved aside without holding the loop.

    ``on_open(moved_to, error)`` is called once the file is open (``moved_to``: where a damaged file went, or
    None); ``on_error(error)`` when opening or a write fails (the facts of that batch are lost, the ledger
    keeps going)."""

    def __init__(
        self,
        path: Path,
        retention_s: float,
        now: Callable[[], datetime],
        on_open: Callable[[Path | None, str | None], None],
        on_error: Callable[[str], None],
    ) -> None:
        self.path = path
        self.retention_s = retention_s
        self._now = now
        self._on_open = on_open
        self._on_error = on_error
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="preemptd-ledger", daemon=True)
        self._conn: sqlite3.Connection | None = None
        self.written = 0
        self.failures = 0

    def open(self) -> None:
        """Open the file (moving a damaged one aside) and prune it. Blocking: the agent calls it on a worker
        thread while it starts, so what it logs comes before the agent serves. A failure is reported to
        ``on_error`` and leaves the writer without a database (facts are dropped, barriers answered)."""
        try:
            self._conn = self._open()
        except (OSError, sqlite3.Error, LedgerCorrupt) as exc:
            self._on_error(f"cannot open {self.path}: {exc}")
            return
        self._prune(self._conn)

    def start(self) -> None:
        """Write on the writer thread from now on (after :meth:`open`)."""
        self._thread.start()

    def put(self, fact: NoticeFact | ReportFact) -> None:
        self._queue.put(fact)

    def barrier(self, done: Callable[[], None]) -> None:
        """Call ``done`` (on the writer thread) once everything queued before it is written."""
        self._queue.put(done)

    def prune_now(self) -> None:
        self._queue.put(_PRUNE)

    def close(self, timeout: float) -> bool:
        """Write what is queued and stop, waiting up to ``timeout``; False if the thread is still busy."""
        if self._thread.ident is None:  # never started (the agent stopped during its start): nothing queued
            if self._conn is not None:
                self._conn.close()
                self._conn = None
            return True
        self._queue.put(None)
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _open(self) -> sqlite3.Connection:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            conn = connect(self.path)
        except LedgerCorrupt as exc:
            moved = move_aside(self.path, self._now())
            conn = connect(self.path)
            self._on_open(moved, str(exc))
        else:
            self._on_open(None, None)
        return conn

    def _run(self) -> None:
        conn = self._conn
        if conn is None:
            self._drain_without_db()
            return
        try:
            stop = False
            while not stop:
                batch = [self._queue.get()]
                with contextlib.suppress(queue.Empty):
                    while len(batch) < 1000:
                        batch.append(self._queue.get_nowait())
                notices = [f for f in batch if isinstance(f, NoticeFact)]
                reports = [f for f in batch if isinstance(f, ReportFact)]
                try:
                    write(conn, notices, reports)
                    self.written += len(notices) + len(reports)
                except sqlite3.Error as exc:
                    self.failures += 1
                    self._on_error(f"write to {self.path} failed: {exc}")
                for item in batch:
                    if item is None:
                        stop = True
                    elif item is _PRUNE:
                        self._prune(conn)
                    elif callable(item):
                        item()
        finally:
            conn.close()

    def _prune(self, conn: sqlite3.Connection) -> None:
        try:
            prune(conn, self._now().timestamp() - self.retention_s)
        except sqlite3.Error as exc:
            self._on_error(f"pruning {self.path} failed: {exc}")

    def _drain_without_db(self) -> None:
        """No database: answer the barriers (nobody waits for ever) until told to stop."""
        while True:
            item = self._queue.get()
            if item is None:
                return
            if callable(item) and item is not _PRUNE:
                item()


def _prune_marker() -> None:  # a distinct callable the writer recognises
    pass


_PRUNE = _prune_marker
