"""The agent's side of the drain (issue 24 item 3): committed steps a client gave a durable root for are
copied there one at a time, each by a child process under the job's own user (:mod:`agent.ramtier.drain`),
at ``drain_rate_mb_s``; their progress for status and metrics."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pwd
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.ramtier.errors import TierError
from agent.ramtier.holdings import Holdings, Key
from agent.ramtier.inventory import Root, opened_step, read_manifest, step_dir

# A drain's states: queued -> copying -> committed (this host made the step durable, or found it so),
# waiting (its part is in, other hosts' parts are not yet: the last host commits), failed.
FINAL = ("committed", "waiting", "failed")
# The child runs the same code as the agent, wherever that was imported from.
_PACKAGE_PARENT = str(Path(__file__).resolve().parents[2])


@dataclass
class Drain:
    uid: int  # the job's, from the kernel when its client reserved or committed (never from a path)
    job: str
    step: int
    durable_root: str
    gid: int
    state: str = "queued"
    copied_bytes: int = 0
    total_bytes: int = 0
    error: str | None = None
    path: str | None = None
    missing: list[str] = field(default_factory=list)
    already: bool = False  # committed by another host (this one copied nothing, or its copy was not used)
    claimed_by: str | None = None  # a full-state step's claim another host holds: this one waits for it
    done: asyncio.Event = field(default_factory=asyncio.Event, repr=False)

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "uid": self.uid,
            "durable_root": self.durable_root,
            "state": self.state,
            "copied_bytes": self.copied_bytes,
            "total_bytes": self.total_bytes,
        }
        for key in ("error", "path", "claimed_by"):
            if getattr(self, key) is not None:
                doc[key] = getattr(self, key)
        if self.missing:
            doc["missing"] = self.missing
        if self.already:
            doc["already"] = True
        return doc


class Drains:
    def __init__(
        self,
        holdings: Holdings,
        root: Callable[[], Root | None],
        host_id: Callable[[], str],
        rate_mb_s: float,
        log: Any,
        superseded: Callable[[int, str, int], Any],
    ) -> None:
        self._holdings = holdings
        self._root = root
        self._host_id = host_id
        self._rate = rate_mb_s
        self._log = log
        self._superseded = superseded
        self.records: dict[Key, Drain] = {}
        self.drained_bytes = 0
        self._queue: asyncio.Queue[Key] = asyncio.Queue()

    def request(self, key: Key, durable_root: str, gid: int | None) -> Drain:
        """Queue the drain of the step ``key`` (uid, job, step) as its uid and ``gid`` (the uid's primary
        group when None: a step read back after a restart)."""
        current = self.records.get(key)
        if current is not None and current.state in ("queued", "copying"):
            return current
        uid, job, step = key
        self.records[key] = drain = Drain(
            uid, job, step, durable_root, _group_of(uid) if gid is None else gid
        )
        self._queue.put_nowait(key)
        return drain

    def forget(self, uid: int, job: str, step: int | None = None) -> None:
        for key in [k for k in self.records if k[:2] == (uid, job) and step in (None, k[2])]:
            if self.records[key].state in FINAL:
                del self.records[key]

    async def run(self) -> None:
        """The worker: one drain at a time (they share the host's memory bandwidth and the durable store)."""
        while True:
            key = await self._queue.get()
            drain = self.records.get(key)
            if drain is None or drain.state != "queued":
                continue
            try:
                await self._run_one(drain)
            except Exception as exc:  # one drain's surprise must not end the others
                drain.state, drain.error = "failed", repr(exc)
                self._log.error("ram_tier_drain_failed", job=drain.job, step=drain.step, error=repr(exc))
            finally:
                drain.done.set()

    async def _run_one(self, drain: Drain) -> None:
        root = self._root()
        record = self._holdings.records.get((drain.uid, drain.job, drain.step))
        if root is None or record is None:
            drain.state, drain.error = "failed", "the step was freed before it was drained"
            return
        source = step_dir(root.path, drain.uid, drain.job, drain.step)
        plan = {
            "source": str(source),
            "durable_root": drain.durable_root,
            "step": drain.step,
            "run": record.run,
            "time": record.time,
            "world_size": record.world_size,
            "files": {name: entry.to_json() for name, entry in record.files.items()},
            "rate_mb_s": self._rate,
            "host": self._host_id(),
            **await asyncio.to_thread(_full_state, root, drain),
        }
        drain.state, drain.total_bytes = "copying", sum(e.size for e in record.files.values())
        self._log.info(
            "ram_tier_drain_started", job=drain.job, step=drain.step, durable_root=drain.durable_root
        )
        try:
            outcome = await self._child({**plan, "uid": drain.uid, "gid": drain.gid}, drain)
        except OSError as exc:
            outcome = {"state": "failed", "error": f"the drain could not start: {exc}"}
        drain.state = str(outcome.get("state", "failed"))
        drain.error = outcome.get("error")
        drain.path = outcome.get("path")
        drain.missing = list(outcome.get("missing") or [])
        drain.already = outcome.get("already") is True
        drain.claimed_by = None
        self.drained_bytes += drain.copied_bytes
        event = "ram_tier_drain_failed" if drain.state == "failed" else f"ram_tier_drain_{drain.state}"
        (self._log.error if drain.state == "failed" else self._log.info)(
            event, job=drain.job, step=drain.step, **drain.to_json()
        )
        if drain.state == "committed":
            await self._superseded(drain.uid, drain.job, drain.step)

    async def _child(self, plan: dict[str, Any], drain: Drain) -> dict[str, Any]:
        """Run the drain program (it becomes the plan's uid); its last state line, or a failure naming its
        output."""
        env = {**os.environ, "PYTHONPATH": _PACKAGE_PARENT}
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "agent.ramtier.drain",
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            cwd="/",
            env=env,
        )
        assert proc.stdin is not None and proc.stdout is not None
        outcome: dict[str, Any] = {}
        other: list[str] = []
        try:
            proc.stdin.write(json.dumps(plan).encode())
            await proc.stdin.drain()
            proc.stdin.close()
            async for raw in proc.stdout:
                try:
                    doc = json.loads(raw)
                except ValueError:
                    other.append(raw.decode(errors="replace").rstrip())
                    continue
                if "state" in doc:
                    outcome = doc
                elif "claimed_by" in doc:
                    by = doc["claimed_by"]
                    drain.claimed_by = None if by is None else str(by)
                else:
                    drain.copied_bytes = int(doc.get("copied_bytes", drain.copied_bytes))
            await proc.wait()
        finally:
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
        if not outcome:
            tail = " | ".join(other[-5:]) or "no output"
            outcome = {"state": "failed", "error": f"the drain exited with status {proc.returncode}: {tail}"}
        return outcome


def _group_of(uid: int) -> int:
    """The primary group of ``uid`` (the uid itself where no account names it)."""
    try:
        return pwd.getpwuid(uid).pw_gid
    except KeyError:
        return uid


def _full_state(root: Root, drain: Drain) -> dict[str, Any]:
    """What the drain of a full-state step (tier.json's ``"layout": "full"``: this host's files are the whole
    step) needs beyond the inventory: the layout, the step's files, its notice and metadata; {} for a sharded
    step (or a tier.json that cannot be read: the drain reads the files it names anyway)."""
    where = f"job {drain.job} step {drain.step}"
    try:  # the job's file, read by the agent: from the tier's root, never through a link
        with opened_step(root, drain.uid, drain.job, drain.step) as step_fd:
            doc = read_manifest(step_fd, drain.uid, where)
    except (OSError, TierError):
        return {}
    if not isinstance(doc, dict) or doc.get("layout") != "full":
        return {}
    return {key: doc.get(key) for key in ("layout", "step_files", "notice_id", "metadata")}
