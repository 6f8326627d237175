"""The Ray bridge (``[actions.ray]``): on a termination notice it drains this host's Ray node through Ray's own
GCS API with reason *preemption*, the agent's message and the notice's deadline — what ``ray drain-node
--reason DRAIN_NODE_REASON_PREEMPTION --deadline-remaining-seconds`` does, and what Ray's autoscaler does for
the clouds it manages — so Ray places nothing new there and Ray Train restarts from its checkpoint elsewhere.

Ray is an optional extra (``preemptd[ray]``). Its GCS client is used only in a child process
(``python -m agent.bridges.ray_gcs``, one per call): Ray's C++ core writes its own log lines to the process's
stderr, blocks for its own timeouts and may abort the process, so in the agent it would put raw lines in the
JSON log and could hold up or end the agent. The child answers one JSON line; what it writes to stderr comes
back as ``ray_log`` events; a child that outlives its call's bound is killed. docs/ray.md has more.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any

import structlog
from msgspec import Meta

from agent.actions.common import Recent, applies
from agent.bridges.common import drain_reason, register_metrics
from agent.bridges.ray_gcs import RayNode, unreachable
from agent.bridges.slurm_commands import host_names
from agent.config import AtLeastOne, NoticeKindName, Seconds, SecondsOrOff, SeverityName
from agent.core.notice import Event, EventType, Notice, format_time, utcnow
from agent.core.plugins import Part, Table
from agent.core.ports import Host, ReactorFactory
from agent.core.tasks import TaskSet

log = structlog.get_logger("preemptd.ray")

DRILLS_OFF = (
    "a drill: a Ray drain cannot be undone (the node leaves the cluster once it is idle), so drills reach "
    "the local clients but not Ray unless actions.ray.drills = true"
)
# What a child may take beyond its call's own timeout: starting Python and importing Ray, seconds on a busy
# host. Past both, the child is killed and the call counts as unanswered.
CHILD_START_S = 30.0
# Bounds on what a child's stderr may add to the agent's log, per call.
MAX_LOG_LINES = 40
MAX_LOG_CHARS = 2000
# A line of Ray's C++ log: "[2026-12-03 18:27:32,169 W 25758 25776] rpc_client.h:153: Failed to ...".
_NATIVE_LINE = re.compile(r"\[[^\]]*? ([DIWEF]) \d+ \d+\] (\S+?:\d+): (.*)")
_NATIVE_LEVELS = {"D": "debug", "I": "info", "W": "warning", "E": "error", "F": "critical"}
# The child imports this package from where the agent found it, whatever its working directory: a source
# checkout is added to its path (an installed package is found there anyway, and a site-packages directory
# on PYTHONPATH would come before the standard library).
_PACKAGE_ROOT = Path(__file__).resolve().parents[2]
_CHILD_PATH = "" if _PACKAGE_ROOT.name in ("site-packages", "dist-packages") else str(_PACKAGE_ROOT)


@dataclass(frozen=True)
class RayConfig:
    """``[actions.ray]``."""

    enabled: bool = False
    # The GCS address (``host:port``); empty: RAY_ADDRESS, else the cluster this host joined (``ray start``).
    address: str = ""
    # This host's Ray node (hex); empty: the node whose address is this host's. Set it when one host runs
    # several raylets.
    node_id: str = ""
    kinds: tuple[NoticeKindName, ...] = ("termination",)
    min_severity: SeverityName = "info"
    # A drill drains the node for real when true; Ray cannot undo a drain (see DRILLS_OFF).
    drills: bool = False
    timeout_s: Seconds = 10.0
    retries: Annotated[int, Meta(ge=0, le=10)] = 2
    # Between notices, how often the GCS's port is tried (a TCP connection, no Ray call), so that a GCS that
    # went down is said when it happens; 0: only at notices.
    check_interval_s: SecondsOrOff = 30.0
    history_size: AtLeastOne = 50


class RayError(Exception):
    """Ray refused or failed; the message says what to do. ``failure``: ``unreachable`` (the GCS did not
    answer; worth another try), ``not_installed``, ``no_cluster``, ``failed``."""

    def __init__(self, message: str, failure: str = "failed") -> None:
        super().__init__(message)
        self.failure = failure


def pick_node(nodes: list[RayNode], names: list[str], node_id: str = "") -> RayNode:
    """This host's node: ``node_id`` if set, else the one live node at one of this host's addresses."""
    alive = [n for n in nodes if n.alive]
    if node_id:
        for node in alive:
            if node.node_id == node_id:
                return node
        raise RayError(f"the Ray cluster has no live node {node_id} (actions.ray.node_id)")
    wanted = set(names)
    found = [n for n in alive if n.address in wanted]
    if len(found) == 1:
        return found[0]
    if not found:
        seen = ", ".join(sorted({n.address for n in alive})) or "none"
        raise RayError(
            f"no live Ray node has one of this host's addresses ({', '.join(names[:6])}; the cluster's: {seen}); "
            "set actions.ray.node_id"
        )
    raise RayError(
        f"{len(found)} live Ray nodes run at this host's address ({', '.join(n.node_id[:12] for n in found)}); "
        "set actions.ray.node_id to the one this agent serves"
    )


class RayBridge:
    """A reactor: drains this host's Ray node once per matching notice; ``handle`` never blocks."""

    name = "ray"

    def __init__(
        self,
        config: RayConfig,
        *,
        helper: Sequence[str] | None = None,
        names: Callable[[], list[str]] = host_names,
        clock: Callable[[], datetime] = utcnow,
    ) -> None:
        """``helper``: the child's command line (default: this Python, ``-m agent.bridges.ray_gcs``)."""
        self.config = config
        self._helper = list(helper or (sys.executable, "-m", "agent.bridges.ray_gcs"))
        self._address: str | None = None  # the GCS the last answer came from
        self._names = names
        self._clock = clock
        self.tasks = TaskSet("ray")
        self._checks = TaskSet("ray")  # the GCS check between notices: runs until stop
        self.recent = Recent(config.history_size)
        self.counts: Counter[tuple[str, str]] = Counter()
        self.degraded: str | None = None
        self.gcs_down = False  # the last call or check went unanswered
        self.node: RayNode | None = None
        self._done: dict[str, dict[str, Any]] = {}
        self._started: asyncio.Event | None = None

    async def start(self) -> None:
        """Look the cluster and this host's node up in the background (start never waits on the GCS); a
        missing Ray or an unreachable GCS is said as soon as the child answers."""
        self._started = asyncio.Event()
        self.tasks.spawn(self._probe(), "probe")
        if self.config.check_interval_s > 0:
            self._checks.spawn(self._watch(), "watch")

    async def stop(self, timeout: float) -> None:
        await self._checks.close(timeout, grace=0)
        await self.tasks.close(timeout)

    def handle(self, event: Event) -> None:
        notice = event.notice
        if event.type not in (EventType.NOTICE, EventType.UPDATE) or notice is None:
            return
        cfg = self.config
        if notice.id in self._done or not applies(notice, cfg.kinds, cfg.min_severity, True):
            return
        skipped = notice.drill and not cfg.drills
        self._done[notice.id] = (
            {"kind": notice.kind.value, "state": "skipped", "why": DRILLS_OFF}
            if skipped
            else {"kind": notice.kind.value, "state": "pending"}
        )
        while len(self._done) > max(1, cfg.history_size):
            del self._done[next(iter(self._done))]
        if skipped:
            log.info("ray_drill_skipped", notice_id=notice.id, why=DRILLS_OFF)
            return
        self.tasks.spawn(self._drain(notice), f"drain:{notice.id}")

    def status(self) -> dict[str, Any]:
        return {
            "state": "degraded" if self.degraded else "ok",
            "degraded_reason": self.degraded,
            "address": self._address or self.config.address or None,
            "node_id": self.node.node_id if self.node else (self.config.node_id or None),
            "head": self.node.is_head if self.node else None,
            "notices": dict(self._done),
            "actions": self.recent.to_json(),
        }

    def carry_over(self, previous: object) -> None:
        """After a reload: a notice the previous instance drained for is not drained again."""
        if isinstance(previous, RayBridge):
            self._done = previous._done
            self.counts = previous.counts
            self.recent = previous.recent

    async def drain_tasks(self) -> None:
        """Wait until every lookup and drain started so far has finished (tests)."""
        await self.tasks.drain()

    # --- steps ----------------------------------------------------------------------------------------

    async def _probe(self) -> None:
        try:
            node = await self._node()
        except RayError as exc:
            self._degrade(str(exc), exc.failure)
        else:
            if node.is_head:
                self._degrade(_head_refusal(node))
            else:
                log.info("ray_ready", node_id=node.node_id, address=self._address)
        finally:
            if self._started is not None:
                self._started.set()

    async def _watch(self) -> None:
        """Between notices: the GCS's port, every check_interval_s. A GCS that stops answering is said at
        once; one that answers again is looked up again (a call through the child) before the bridge counts
        as whole."""
        cfg = self.config
        if self._started is not None:
            await self._started.wait()
        while True:
            await asyncio.sleep(cfg.check_interval_s)
            address = self._address
            host, _, port = (address or "").rpartition(":")
            if not host or not port.isdigit():
                continue  # no cluster found yet, or Ray missing: the lookup said why
            try:
                _, writer = await asyncio.wait_for(asyncio.open_connection(host, int(port)), cfg.timeout_s)
            except (OSError, asyncio.TimeoutError) as exc:
                detail = f"no TCP connection: {type(exc).__name__}: {exc}".rstrip(": ")
                self._degrade(unreachable(address, detail), "unreachable")
                continue
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
            if self.gcs_down:
                with contextlib.suppress(RayError):
                    await self._node()

    async def _call(self, op: str, **args: Any) -> Any:
        """One GCS call in a child, tried again (with a backoff) while the GCS does not answer; RayError
        when Ray refused, is missing, or every attempt went unanswered."""
        attempts = 1 + max(0, self.config.retries)
        for attempt in range(attempts):
            if attempt:
                await asyncio.sleep(0.5 * 2 ** (attempt - 1))
            try:
                return await self._child(op, args)
            except RayError as exc:
                if exc.failure != "unreachable" or attempt + 1 == attempts:
                    raise
        raise AssertionError("not reached: the last attempt returns or raises")

    async def _child(self, op: str, args: dict[str, Any]) -> Any:
        """Run ``op`` in a child process; its stderr becomes ``ray_log`` events."""
        cfg = self.config
        request = {"op": op, "address": cfg.address, "timeout_s": cfg.timeout_s, **args}
        path = os.pathsep.join(filter(None, (os.environ.get("PYTHONPATH"), _CHILD_PATH)))
        proc = await asyncio.create_subprocess_exec(
            *self._helper,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": path},
            limit=MAX_LOG_CHARS * 64,
        )
        assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
        stdout, stderr = proc.stdout, proc.stderr
        said: list[str] = []  # the child's stderr, kept if it has to be killed

        async def talk() -> bytes:
            async def listen() -> None:
                with contextlib.suppress(ValueError):  # a line past the limit ends the listening
                    async for line in stderr:
                        said.append(line.decode(errors="replace"))

            out, _ = await asyncio.gather(stdout.read(), listen())
            await proc.wait()
            return out

        bound = cfg.timeout_s + CHILD_START_S
        try:
            with contextlib.suppress(ConnectionError):  # a child that ended at once: its output says why
                proc.stdin.write(json.dumps(request).encode())
                await proc.stdin.drain()
                proc.stdin.close()
            out = await asyncio.wait_for(talk(), bound)
        except asyncio.TimeoutError:
            detail = f"no answer within {bound:g} s"
            raise RayError(unreachable(self._address or cfg.address, detail), "unreachable") from None
        finally:
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
            for level, fields in child_log(said, op):
                getattr(log, level)("ray_log", **fields)
        lines = out.decode(errors="replace").strip().splitlines()
        try:
            reply = json.loads(lines[-1])
        except (IndexError, ValueError):
            raise RayError(
                f"the Ray helper ({' '.join(self._helper[:3])}) exited with {proc.returncode} without an "
                "answer; its output is in the ray_log events above"
            ) from None
        if reply.get("address"):
            self._address = str(reply["address"])
        if "error" in reply:
            raise RayError(str(reply["error"]), str(reply.get("failure") or "failed"))
        return reply.get("result")

    async def _node(self) -> RayNode:
        nodes = [RayNode(**node) for node in await self._call("nodes")]
        self.node = pick_node(nodes, self._names(), self.config.node_id)
        if self.gcs_down or (self.degraded is not None and not self.node.is_head):
            # The GCS answers again (or the configuration was fixed): the bridge is whole.
            log.info("ray_recovered", node_id=self.node.node_id, address=self._address, was=self.degraded)
            self.gcs_down = False
            self.degraded = _head_refusal(self.node) if self.node.is_head else None
        return self.node

    async def _drain(self, notice: Notice) -> None:
        if self._started is not None:
            await self._started.wait()
        entry = self._done[notice.id]
        message = drain_reason(notice)
        try:
            node = await self._node()
        except RayError as exc:
            self._degrade(str(exc), exc.failure)
            entry.update(state="failed", error=str(exc))
            self._outcome(notice, "-", "failed", error=str(exc))
            return
        entry["node_id"] = node.node_id
        if node.is_head:
            why = _head_refusal(node)
            entry.update(state="refused", error=why)
            self._outcome(notice, node.node_id, "refused", error=why)
            return
        deadline_ms = int(notice.deadline.timestamp() * 1000) if notice.deadline else 0
        try:
            accepted, rejection = await self._call(
                "drain", node_id=node.node_id, message=message, deadline_ms=deadline_ms
            )
        except RayError as exc:
            self._degrade(str(exc), exc.failure)
            entry.update(state="failed", error=str(exc))
            self._outcome(notice, node.node_id, "failed", error=str(exc))
            return
        if accepted:
            entry.update(state="drained", message=message, deadline_ms=deadline_ms)
            self._outcome(notice, node.node_id, "ok", message=message, deadline_ms=deadline_ms)
        else:
            entry.update(state="rejected", error=rejection)
            self._outcome(notice, node.node_id, "rejected", error=f"Ray rejected the drain: {rejection}")

    def _outcome(self, notice: Notice, node_id: str, outcome: str, **fields: Any) -> None:
        record = {
            "at": format_time(self._clock()),
            "notice_id": notice.id,
            "action": "drain",
            "node_id": node_id,
            "outcome": outcome,
            **fields,
        }
        self.recent.add(record)
        self.counts[("drain", outcome)] += 1
        logged = {k: v for k, v in record.items() if k != "at"}
        if outcome == "ok":
            log.info("ray_drain", **logged)
        else:
            log.warning(f"ray_drain_{outcome}", **logged)

    def _degrade(self, why: str, failure: str = "failed") -> None:
        if failure == "unreachable":
            if not self.gcs_down:  # once per outage, whichever call or check saw it first
                log.error("ray_gcs_unreachable", address=self._address or self.config.address, error=why)
            self.gcs_down = True
        elif self.degraded != why:
            log.error("ray_degraded", why=why, effect="notices still reach local clients")
        self.degraded = why


def _head_refusal(node: RayNode) -> str:
    return (
        f"this host's Ray node {node.node_id} is the head node: draining it would stop the whole cluster's "
        "control plane, so the agent refuses; run the agent's Ray bridge on worker nodes only "
        "(or set actions.ray.node_id to a worker's id)"
    )


def child_log(lines: Sequence[str], op: str) -> list[tuple[str, dict[str, Any]]]:
    """A child's stderr as ``ray_log`` events, (level, fields): its Python log records (JSON lines), Ray's
    C++ lines (their level and source kept), anything else as a warning; bounded in number and length."""
    events: list[tuple[str, dict[str, Any]]] = []
    for line in (line.rstrip("\n") for line in lines[:MAX_LOG_LINES]):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        native = _NATIVE_LINE.match(line)
        fields: dict[str, Any] = {"call": op}
        if isinstance(record, dict) and "message" in record:
            level, message = str(record.get("level", "")).lower(), str(record["message"])
            fields["logger"] = record.get("logger")
        elif native is not None:
            level, message = _NATIVE_LEVELS[native.group(1)], native.group(3)
            fields["at"] = native.group(2)
        else:
            level, message = "warning", line
        fields["message"] = message[:MAX_LOG_CHARS]
        events.append((level if level in _NATIVE_LEVELS.values() else "warning", fields))
    if len(lines) > MAX_LOG_LINES:
        events.append(
            ("warning", {"call": op, "message": f"{len(lines) - MAX_LOG_LINES} more lines left out"})
        )
    return events


def build_reactor(host: Host) -> RayBridge | None:
    """The bridge for ``[actions.ray]``, or None when it is not enabled."""
    config = host.config.table("actions.ray", RayConfig)
    if not config.enabled:
        return None
    bridge = RayBridge(config)
    register_metrics(host, "ray", "Ray", bridge)
    return bridge


# The entry of the reactor registry (agent/actions/registry.py).
REACTOR: Part[ReactorFactory] = Part("ray", build_reactor, (Table("actions.ray", RayConfig),))
