"""The agent's side of the drain (issue 24 item 3): committed steps a client gave a durable root for are
copied there, each by a child process under the job's own user (:mod:`agent.ramtier.drain`) at
``drain_rate_mb_s`` and within a deadline; drains of different jobs run at once (up to ``drain_concurrency``),
one job's one at a time and in order; their progress for status and metrics."""

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

from agent.ramtier.drain import CLAIM_STALE_S
from agent.ramtier.errors import TierError
from agent.ramtier.holdings import Holdings, Key
from agent.ramtier.inventory import Root, opened_step, read_manifest, step_dir

# A drain's states: queued -> copying -> committed (this host made the step durable, or found it so),
# waiting (its part is in, other hosts' parts are not yet: the last host commits), failed.
FINAL = ("committed", "waiting", "failed")
# The default deadline (drain_timeout_s = 0): this allowance for the child's start, its fsyncs and the commit,
# plus the claim's stale time, plus twice the step's bytes at no more than this rate (a full-state drain may
# wait for another host's copy of the same bytes before it copies them itself; a sharded one may read back
# what another host already put there). docs/ram-tier.md, "Drain to durable storage".
DEADLINE_BASE_S = 60.0
DEADLINE_MB_S = 50.0
# A killed child is waited for this long: one blocked in the kernel (a hung durable store) dies only when its
# system call returns, and must not hold its job's turn meanwhile.
KILL_WAIT_S = 10.0
STOPPED = (
    "the agent stopped before the drain finished (its child, if it ran, was killed); the step stays in RAM, and "
    "its drain starts again when the client commits it again"
)
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
    skipped_claims: list[str] = field(default_factory=list)  # other users' claims: skipped, never waited for
    deadline_s: float | None = None  # how long its child may run, once it starts
    pid: int | None = None  # its child, while it runs
    done: asyncio.Event = field(default_factory=asyncio.Event, repr=False)

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "uid": self.uid,
            "durable_root": self.durable_root,
            "state": self.state,
            "copied_bytes": self.copied_bytes,
            "total_bytes": self.total_bytes,
        }
        for key in ("error", "path", "claimed_by", "deadline_s", "pid"):
            if getattr(self, key) is not None:
                doc[key] = getattr(self, key)
        if self.missing:
            doc["missing"] = self.missing
        if self.skipped_claims:
            doc["skipped_claims"] = self.skipped_claims
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
        *,
        timeout_s: float = 0.0,
        concurrency: int = 2,
    ) -> None:
        self._holdings = holdings
        self._root = root
        self._host_id = host_id
        self._rate = rate_mb_s
        self._log = log
        self._superseded = superseded
        self._timeout_s = timeout_s
        self._concurrency = max(1, concurrency)
        self.records: dict[Key, Drain] = {}
        self.drained_bytes = 0
        self._queued: list[Key] = []  # in the order they were asked for
        self._busy: set[tuple[int, str]] = set()  # the jobs (uid, job) whose drain runs now
        self._changed = asyncio.Event()  # a drain was queued or finished: a worker may have one to take
        self._lingering: list[asyncio.subprocess.Process] = []  # killed children not gone yet

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
        self._queued.append(key)
        self._changed.set()
        return drain

    def forget(self, uid: int, job: str, step: int | None = None) -> None:
        for key in [k for k in self.records if k[:2] == (uid, job) and step in (None, k[2])]:
            if self.records[key].state in FINAL:
                del self.records[key]

    async def run(self) -> None:
        """The workers: up to ``concurrency`` drains at once, of different jobs (they share the host's memory
        bandwidth and the durable store); they end, each killing its child, when this is cancelled."""
        workers = [
            asyncio.create_task(self._worker(), name=f"ram-tier-drain-{n}") for n in range(self._concurrency)
        ]
        try:
            done, _ = await asyncio.wait(workers, return_when=asyncio.FIRST_COMPLETED)
            for worker in done:
                worker.result()  # a worker ends only on a bug: say so (the agent's task set logs it)
        finally:
            for worker in workers:
                worker.cancel()  # once: a second cancel would cut short the wait for its killed child
            await asyncio.gather(*workers, return_exceptions=True)

    def _take(self) -> Drain | None:
        """The next drain to run, marked busy: the oldest queued one of a job that has none running (a job's
        drains run one at a time, in order), of a uid that has none running first (a user whose drains are
        stuck does not take the next free turn from the others)."""
        self._queued = [
            k for k in self._queued if (d := self.records.get(k)) is not None and d.state == "queued"
        ]
        running = {uid for uid, _ in self._busy}
        free = [key for key in self._queued if key[:2] not in self._busy]
        pick = next((key for key in free if key[0] not in running), None) or next(iter(free), None)
        if pick is None:
            return None
        self._queued.remove(pick)
        self._busy.add(pick[:2])
        return self.records[pick]

    async def _worker(self) -> None:
        while True:
            drain = self._take()
            if drain is None:
                # No await between the look and the clear: a drain queued or finished after it sets it again.
                self._changed.clear()
                await self._changed.wait()
                continue
            try:
                await self._run_one(drain)
            except asyncio.CancelledError:
                if drain.state not in FINAL:
                    drain.state, drain.error = "failed", STOPPED
                raise
            except Exception as exc:  # one drain's surprise must not end the others
                drain.state, drain.error = "failed", repr(exc)
                self._log.error("ram_tier_drain_failed", job=drain.job, step=drain.step, error=repr(exc))
            finally:
                drain.pid = None
                self._busy.discard((drain.uid, drain.job))
                self._changed.set()
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
        drain.pid = None
        self.drained_bytes += drain.copied_bytes
        event = "ram_tier_drain_failed" if drain.state == "failed" else f"ram_tier_drain_{drain.state}"
        (self._log.error if drain.state == "failed" else self._log.info)(
            event, job=drain.job, step=drain.step, **drain.to_json()
        )
        if drain.state == "committed":
            await self._superseded(drain.uid, drain.job, drain.step)

    async def _child(self, plan: dict[str, Any], drain: Drain) -> dict[str, Any]:
        """Run the drain program (it becomes the plan's uid) within the drain's deadline; its last state line,
        or a failure naming its output. Past the deadline the child is killed (SIGKILL ends a stopped process
        too) and waited for: it runs as the job's user, who may stop it, and must not hold the job's turn."""
        limit, why = deadline(drain.total_bytes, self._timeout_s, self._rate)
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
        drain.pid, drain.deadline_s = proc.pid, round(limit, 1)
        other: list[str] = []
        try:
            outcome = await asyncio.wait_for(self._converse(proc, plan, drain, other), limit)
        except asyncio.TimeoutError:
            outcome = {
                "state": "failed",
                "error": f"the drain did not finish within {round(limit, 1):g} s ({why}): stopped, hung or too "
                f"slow, its child (pid {proc.pid}) was killed; nothing was committed by this host, the step "
                "stays in RAM",
            }
        finally:
            await self._end(proc)
        if not outcome:
            tail = " | ".join(other[-5:]) or "no output"
            outcome = {"state": "failed", "error": f"the drain exited with status {proc.returncode}: {tail}"}
        return outcome

    async def _converse(
        self, proc: asyncio.subprocess.Process, plan: dict[str, Any], drain: Drain, other: list[str]
    ) -> dict[str, Any]:
        """Hand the child its plan and follow its progress lines to its end; its last state line ({} if
        none)."""
        assert proc.stdin is not None and proc.stdout is not None
        outcome: dict[str, Any] = {}
        proc.stdin.write(json.dumps(plan).encode())
        await proc.stdin.drain()
        proc.stdin.close()
        async for raw in proc.stdout:
            try:
                doc = json.loads(raw)
            except ValueError:
                other.append(raw.decode(errors="replace").rstrip())
                continue
            if not isinstance(doc, dict):
                other.append(raw.decode(errors="replace").rstrip())
            elif "state" in doc:
                outcome = doc
            elif "claimed_by" in doc:
                by = doc["claimed_by"]
                drain.claimed_by = None if by is None else str(by)
            elif "skipped_claim" in doc:
                self._skipped(drain, doc["skipped_claim"])
            else:
                drain.copied_bytes = int(doc.get("copied_bytes", drain.copied_bytes))
        await proc.wait()
        return outcome

    def _skipped(self, drain: Drain, found: Any) -> None:
        """A claim name another user holds (or a link, not a file): the child went on to the next name."""
        if not isinstance(found, dict):
            return
        what = f"{found.get('path')}: {found.get('why')}: untrusted, skipped"
        drain.skipped_claims.append(what)
        self._log.warning(
            "ram_tier_drain_claim_skipped",
            uid=drain.uid,
            job=drain.job,
            step=drain.step,
            claim=found.get("path"),
            owner=found.get("owner"),
            why=found.get("why"),
            effect="never waited for: the drain takes the next claim name",
        )

    async def _end(self, proc: asyncio.subprocess.Process) -> None:
        """Kill the child if it still runs, and wait for it (a bounded wait: one blocked in the kernel is
        kept here until it is gone, not waited for)."""
        self._lingering = [p for p in self._lingering if p.returncode is None]
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
        try:
            await asyncio.wait_for(proc.wait(), KILL_WAIT_S)
        except asyncio.TimeoutError:
            self._lingering.append(proc)
            self._log.warning(
                "ram_tier_drain_unkillable",
                pid=proc.pid,
                waited_s=KILL_WAIT_S,
                effect="killed, not gone yet (blocked in the kernel: a hung durable store?); the drains go on",
            )


def deadline(nbytes: int, timeout_s: float, rate_mb_s: float) -> tuple[float, str]:
    """How long the drain of a step of ``nbytes`` may run, and where that comes from (pure): ``timeout_s``
    (``drain_timeout_s``) when above 0, else ``DEADLINE_BASE_S`` + the claim's stale time + twice the bytes at
    the slower of ``rate_mb_s`` (``drain_rate_mb_s``; 0: no limit) and ``DEADLINE_MB_S``."""
    if timeout_s > 0:
        return timeout_s, "ram_tier.drain_timeout_s"
    rate = min(rate_mb_s, DEADLINE_MB_S) if rate_mb_s > 0 else DEADLINE_MB_S
    return DEADLINE_BASE_S + CLAIM_STALE_S + 2 * nbytes / (rate * 1e6), (
        f"ram_tier.drain_timeout_s = 0: {DEADLINE_BASE_S:g} s + the claim's {CLAIM_STALE_S:g} s + twice its "
        f"{nbytes} bytes at {rate:g} MB/s"
    )


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
