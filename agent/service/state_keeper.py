"""The state keeper: what the agent persists, and when. It loads the state file at start, collects history
records, leases event sequence numbers ahead of use, and writes the state file and the pending history from
a worker thread — in the background when something changed, and on demand (``flush``) where a change must be
durable before it is answered. The file formats and the blocking writes are in :mod:`agent.service.state_files`.

Sequence numbers are leased ahead of use: the state file holds a mark above every number handed out, and a
new lease is written, off the event path, when half of the current one is used. After a crash the agent
starts numbering at the mark, so no number is used twice (a clean stop saves the exact last number).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

from agent.core.errors import StateError
from agent.core.notice import Event, Notice, format_time
from agent.service.state_files import (
    History,
    LoadedState,
    load_state,
    prepare_dir,
    save_state,
    state_document,
)

SEQ_LEASE = 1 << 16


class StateKeeper:
    def __init__(
        self,
        state_dir: Path,
        history_max_bytes: int,
        boot_id: str,
        now: Callable[[], datetime],
        log: Any,
    ) -> None:
        self.state_dir = state_dir
        self.history = History(state_dir, history_max_bytes)
        self.boot_id = boot_id
        self.now = now
        self.log = log
        self.ok = True
        self.error: str | None = None
        self.loaded = False
        self._pending: list[str] = []
        self._wanted = asyncio.Event()
        # Counts what the next write is to carry (a record, a change, a new lease); ``_saved`` is the count
        # the last write took its snapshot at, so a change that a write already holds is not written twice.
        self._version = 0
        self._saved = -1
        self._inflight: asyncio.Task[None] | None = None
        self._lease = 0  # every number up to it may have been handed out
        self._durable = 0  # the lease the state file holds
        self._overrun = False
        # What the state document holds besides the keeper's own fields; set by the composition root.
        self._snapshot: Callable[[], tuple[int, tuple[Notice, ...], Mapping[str, Any]]] = lambda: (0, (), {})

    def bind(self, snapshot: Callable[[], tuple[int, tuple[Notice, ...], Mapping[str, Any]]]) -> None:
        """``snapshot()`` returns (the last sequence number handed out, the active notices, the extras)."""
        self._snapshot = snapshot

    def load(self) -> LoadedState:
        """Read the state file. An unusable state directory leaves the agent running without persistence
        (logged, and shown in status); a corrupt file was moved aside by :func:`agent.service.state_files.load_state`."""
        self.loaded = True
        try:
            prepare_dir(self.state_dir)
            loaded = load_state(self.state_dir, self.now())
        except StateError as exc:
            self.ok = False
            self.error = str(exc)
            self.log.error(
                "state_dir_unusable",
                error=str(exc),
                state_dir=str(self.state_dir),
                effect="running without persistence",
            )
            return LoadedState()
        if loaded.moved_aside is not None:
            self.log.error(
                "state_file_corrupt",
                problem=loaded.problem,
                moved_to=str(loaded.moved_aside),
                effect="starting with no notices",
            )
        # Leased before the first write, which lands before the socket serves anyone.
        self._lease = loaded.seq + SEQ_LEASE
        return loaded

    def started(self, loaded: LoadedState, version: str) -> None:
        """Log what was restored and record this start (``agent_start``) in the history."""
        if loaded.notices:
            self.log.warning(
                "notices_restored",
                count=len(loaded.notices),
                notices=[
                    {
                        "id": n.id,
                        "kind": n.kind.value,
                        "deadline": format_time(n.deadline) if n.deadline else None,
                    }
                    for n in loaded.notices
                ],
            )
        self.record(
            {
                "type": "agent_start",
                "boot_id": self.boot_id,
                "version": version,
                "previous_clean": loaded.previous_clean,
                "previous_boot_id": loaded.previous_boot_id,
            }
        )

    def record(self, record: Mapping[str, Any]) -> None:
        """Queue a history record (``time`` is added); written by the background writer. Never blocks."""
        stamped = {"time": self.now().isoformat(timespec="milliseconds").replace("+00:00", "Z"), **record}
        self._pending.append(json.dumps(stamped, separators=(",", ":"), default=str))
        self._want()

    def changed(self) -> None:
        """The state document changed: the background writer saves it soon."""
        self._want()

    def _want(self) -> None:
        self._version += 1
        self._wanted.set()

    def lease_sequence(self, event: Event) -> None:
        """The first listener of every event: keep the leased sequence numbers ahead of the hub's."""
        if event.seq > self._lease - SEQ_LEASE // 2:
            self._lease = event.seq + SEQ_LEASE
            self._want()
        if event.seq > self._durable and self.ok and not self._overrun:
            # Only a burst of tens of thousands of events within one state write gets here.
            self._overrun = True
            self.log.error("sequence_lease_overrun", seq=event.seq, durable=self._durable)

    async def flush(self, clean: bool = False) -> None:
        """Write pending history records and the state file. A write already handed to a worker thread
        always completes, even when the task awaiting it is cancelled (shutdown), and writes never overlap:
        each flush first waits for the one before it. ``clean``: the final save of a clean stop."""
        if self._inflight is not None:
            await asyncio.shield(self._inflight)
        if not self.ok:
            self._pending.clear()
            return
        lines, self._pending = self._pending, []
        self._saved = self._version
        seq, notices, extra = self._snapshot()
        document = state_document(
            seq if clean else max(self._lease, seq), notices, self.boot_id, clean, self.now(), extra
        )
        self._inflight = asyncio.get_running_loop().create_task(
            self._write(document, lines), name="state-write"
        )
        await asyncio.shield(self._inflight)

    async def _write(self, document: dict[str, Any], lines: list[str]) -> None:
        try:
            await asyncio.to_thread(self._write_sync, document, lines)
            self._durable = max(self._durable, document["seq"])
        except OSError as exc:
            self.ok = False
            self.error = f"cannot write state in {self.state_dir}: {exc.strerror or exc}"
            self.log.error("state_write_failed", error=self.error)

    def _write_sync(self, document: dict[str, Any], lines: list[str]) -> None:
        if lines:
            self.history.write(lines)
        save_state(self.state_dir, document)

    async def writer(self) -> None:
        """The background writer: saves whenever something changed, until cancelled. A change that a write
        on demand already took (a drill's, answered once on disk) is not saved again."""
        while True:
            await self._wanted.wait()
            self._wanted.clear()
            if self._inflight is not None:
                await asyncio.shield(self._inflight)
            if self._version != self._saved:
                await self.flush()
