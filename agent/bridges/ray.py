"""The Ray bridge (``[actions.ray]``): on a termination notice it drains this host's Ray node through Ray's own
GCS API with reason *preemption*, the agent's message and the notice's deadline — what ``ray drain-node
--reason DRAIN_NODE_REASON_PREEMPTION --deadline-remaining-seconds`` does, and what Ray's autoscaler does for
the clouds it manages — so Ray places nothing new there and Ray Train restarts from its checkpoint elsewhere.

Ray is an optional extra (``preemptd[ray]``) imported only here, in a worker thread, when the bridge starts;
its GCS client blocks, so every call runs in a thread with Ray's own RPC timeout. docs/ray.md has more.
"""

from __future__ import annotations

import asyncio
import importlib
import os
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import structlog

from agent.actions.common import Recent, applies
from agent.bridges.common import drain_reason, register_metrics
from agent.bridges.slurm_commands import host_names
from agent.config import NoticeKindName, SeverityName
from agent.notice import Event, EventType, Notice, format_time, utcnow
from agent.ports import Host
from agent.tasks import TaskSet

log = structlog.get_logger("preemptd.ray")

NOT_INSTALLED = (
    "Ray is not installed in the agent's environment, so the Ray bridge cannot drain this node; "
    "install it with pip install 'preemptd[ray]' (the same Ray version as the cluster's)"
)


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
    drills: bool = True
    timeout_s: float = 10.0
    retries: int = 2
    history_size: int = 50


class RayError(Exception):
    """Ray refused or failed; the message says what to do."""


@dataclass(frozen=True)
class RayNode:
    node_id: str
    address: str
    is_head: bool
    alive: bool


class RayApi:
    """The few GCS calls the bridge makes, synchronous (run them in a thread). Imports Ray on creation."""

    def __init__(self, address: str, timeout_s: float) -> None:
        raylet = importlib.import_module("ray._raylet")
        autoscaler = importlib.import_module("ray.core.generated.autoscaler_pb2")
        self.address = address or self.default_address()
        self.timeout_s = timeout_s
        self._preemption = autoscaler.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION")
        self._client = raylet.GcsClient(address=self.address)

    @staticmethod
    def default_address() -> str:
        """RAY_ADDRESS, else the cluster that ``ray start`` on this host joined (Ray's own lookup)."""
        services = importlib.import_module("ray._private.services")
        try:
            return str(services.canonicalize_bootstrap_address_or_die(os.environ.get("RAY_ADDRESS")))
        except (ConnectionError, ValueError) as exc:
            raise RayError(f"no Ray cluster found on this host ({exc}); set actions.ray.address") from exc

    def nodes(self) -> list[RayNode]:
        infos = self._client.get_all_node_info(timeout=self.timeout_s)
        return [
            RayNode(
                node_id=node_id.hex(),
                address=str(info.node_manager_address),
                is_head=bool(info.is_head_node),
                alive=int(info.state) == 0,  # GcsNodeInfo.ALIVE
            )
            for node_id, info in infos.items()
        ]

    def drain(self, node_id: str, message: str, deadline_ms: int) -> tuple[bool, str]:
        accepted, rejection = self._client.drain_node(
            node_id, self._preemption, message, deadline_ms, timeout=self.timeout_s
        )
        return bool(accepted), str(rejection or "")

    def draining(self) -> dict[str, int]:
        """Node id (hex) → drain deadline in ms since the epoch (0: none), as the GCS holds it."""
        return {str(k): int(v) for k, v in self._client.get_draining_nodes(timeout=self.timeout_s).items()}


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
        api: Callable[[RayConfig], RayApi] | None = None,
        names: Callable[[], list[str]] = host_names,
        clock: Callable[[], datetime] = utcnow,
    ) -> None:
        self.config = config
        self._make_api = api or (lambda cfg: RayApi(cfg.address, cfg.timeout_s))
        self._api: RayApi | None = None
        self._names = names
        self._clock = clock
        self.tasks = TaskSet("ray")
        self.recent = Recent(config.history_size)
        self.counts: Counter[tuple[str, str]] = Counter()
        self.degraded: str | None = None
        self.node: RayNode | None = None
        self._done: dict[str, dict[str, Any]] = {}
        self._started: asyncio.Event | None = None

    async def start(self) -> None:
        """Import Ray (in a thread: it takes a second) and say at once when it is missing; the cluster is
        looked up in the background so that start never waits on the GCS."""
        self._started = asyncio.Event()
        try:
            await asyncio.to_thread(importlib.import_module, "ray._raylet")
        except ImportError as exc:
            self._degrade(NOT_INSTALLED, error=str(exc))
            self._started.set()
            return
        self.tasks.spawn(self._probe(), "probe")

    async def stop(self, timeout: float) -> None:
        await self.tasks.close(timeout)

    def handle(self, event: Event) -> None:
        notice = event.notice
        if event.type not in (EventType.NOTICE, EventType.UPDATE) or notice is None:
            return
        cfg = self.config
        if notice.id in self._done or not applies(notice, cfg.kinds, cfg.min_severity, cfg.drills):
            return
        self._done[notice.id] = {"kind": notice.kind.value, "state": "pending"}
        while len(self._done) > max(1, cfg.history_size):
            del self._done[next(iter(self._done))]
        self.tasks.spawn(self._drain(notice), f"drain:{notice.id}")

    def status(self) -> dict[str, Any]:
        return {
            "state": "degraded" if self.degraded else "ok",
            "degraded_reason": self.degraded,
            "address": self._api.address if self._api is not None else (self.config.address or None),
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
        """Wait until everything started so far has finished (tests)."""
        await self.tasks.drain()

    # --- steps ----------------------------------------------------------------------------------------

    async def _probe(self) -> None:
        try:
            node = await self._node()
        except RayError as exc:
            self._degrade(str(exc))
        else:
            if node.is_head:
                self._degrade(_head_refusal(node))
            else:
                log.info("ray_ready", node_id=node.node_id, address=self._api.address if self._api else None)
        finally:
            if self._started is not None:
                self._started.set()

    async def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """One GCS call in a thread, retried; RayError with Ray's message when every attempt failed."""
        last: Exception | None = None
        for attempt in range(1 + max(0, self.config.retries)):
            if attempt:
                await asyncio.sleep(0.5 * 2 ** (attempt - 1))
            try:
                return await asyncio.wait_for(asyncio.to_thread(fn, *args), self.config.timeout_s + 5)
            except (RayError, ImportError):
                raise
            except Exception as exc:  # Ray raises its own RpcError, ConnectionError, TimeoutError...
                last = exc
        raise RayError(f"the Ray GCS did not answer: {type(last).__name__}: {last}")

    async def _node(self) -> RayNode:
        if self._api is None:
            try:
                self._api = await self._call(self._make_api, self.config)
            except ImportError as exc:
                raise RayError(NOT_INSTALLED) from exc
        api = self._api
        assert api is not None
        nodes = await self._call(api.nodes)
        self.node = pick_node(nodes, self._names(), self.config.node_id)
        return self.node

    async def _drain(self, notice: Notice) -> None:
        if self._started is not None:
            await self._started.wait()
        entry = self._done[notice.id]
        message = drain_reason(notice)
        try:
            node = await self._node()
        except RayError as exc:
            self._degrade(str(exc))
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
        assert self._api is not None
        try:
            accepted, rejection = await self._call(self._api.drain, node.node_id, message, deadline_ms)
        except RayError as exc:
            self._degrade(str(exc))
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

    def _degrade(self, why: str, **fields: Any) -> None:
        if self.degraded != why:
            log.error("ray_degraded", why=why, effect="notices still reach local clients", **fields)
        self.degraded = why


def _head_refusal(node: RayNode) -> str:
    return (
        f"this host's Ray node {node.node_id} is the head node: draining it would stop the whole cluster's "
        "control plane, so the agent refuses; run the agent's Ray bridge on worker nodes only "
        "(or set actions.ray.node_id to a worker's id)"
    )


def build_reactor(host: Host) -> RayBridge | None:
    """The bridge for ``[actions.ray]``, or None when it is not enabled."""
    config = host.config.table("actions.ray", RayConfig)
    if not config.enabled:
        return None
    bridge = RayBridge(config)
    register_metrics(host, "ray", "Ray", bridge)
    return bridge
