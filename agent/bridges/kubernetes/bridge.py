"""The Kubernetes bridge reactor: makes the agent its node's termination handler.

On a notice of the configured kinds it taints and cordons the node, sets a Node condition and posts an
Event at once; it evicts the node's pods through the Eviction API once the node's training participants
(processes subscribed on the socket or reporting as participants) reported their emergency checkpoint (the
agent's ``ready``), or at the latest moment a pod's grace period still ends before the deadline; pods
without participants go at once. When the last notice clears it
removes what it set, and only that. Every call runs in tasks the bridge owns, so nothing here holds up an
event on its way to the local clients.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from datetime import datetime
from functools import partial
from pathlib import Path
from typing import Any

import structlog
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from agent.bridges.kubernetes import plan
from agent.bridges.kubernetes.api import KubeApi, KubeError
from agent.bridges.kubernetes.config import KubernetesConfig
from agent.bridges.kubernetes.drain import BACKOFF_START_S, Drainer, alive
from agent.core.notice import Event, EventType, Notice, Severity, format_time
from agent.core.reports import Report
from agent.core.tasks import TaskSet

log = structlog.get_logger("preemptd.kubernetes")

# Conflicts (409) are retried at once from a fresh read, this many times in a row before backing off.
CONFLICT_RETRIES = 5
# Participants remembered (processes that reported as one or subscribed); dead ones are forgotten first.
MAX_PARTICIPANTS = 256


class KubernetesBridge:
    """The reactor (``agent.core.ports.Reactor``) named ``kubernetes``."""

    name = "kubernetes"

    def __init__(
        self,
        config: KubernetesConfig,
        *,
        node: str,
        connect: Callable[[], KubeApi],
        now: Callable[[], datetime],
        active: Callable[[], Iterable[Notice]] = tuple,
        proc: Path = Path("/proc"),
        host_name: str | None = None,
    ) -> None:
        self.config = config
        self.node = node
        self._connect = connect
        self._now = now
        self._active = active
        self._proc = proc
        self._host_name = host_name or socket.gethostname()
        self._api: KubeApi | None = None
        self._tasks = TaskSet("kubernetes", failure_event="kubernetes_task_failed")
        self._notices: dict[str, Notice] = {}  # active notices the bridge acts on
        self._evented: set[str] = set()  # notices whose Event is posted
        self._cleared: dict[str, Notice] = {}  # cleared notices whose "cleared" Event is still to post
        self._participants: dict[str, dict[str, Any]] = {}
        self._dirty = asyncio.Event()
        self._settled = asyncio.Event()  # the node's state was attempted once since the last change
        self._settled.set()
        self._node_task: asyncio.Task[Any] | None = None
        self.node_state: dict[str, Any] = {"tainted": [], "cordoned": False, "condition": False}
        self.calls: Counter[tuple[str, str, str]] = Counter()
        self.drainer = Drainer(
            config,
            node=node,
            call=self._call,
            spawn=self._spawn,
            now=now,
            participants=lambda: list(self._participants.values()),
            node_settled=self.settled,
            proc=proc,
        )
        self.last_error: str | None = None
        self.last_error_at: datetime | None = None
        self.errors = 0

    # --- reactor contract -----------------------------------------------------------------------------

    async def start(self) -> None:
        # The node is brought to what the notices active now ask for: those restored at an agent restart
        # (their taint stays until they clear), or none (a taint left by an agent that stopped while its
        # notice cleared is removed).
        for notice in self._active():
            if notice.id not in self._notices and self._applies(notice):
                self._notices[notice.id] = notice
                if self.config.drain:
                    self.drainer.begin(notice)
        self._node_task = self._spawn(self._node_loop(), "node")
        self._changed()

    async def stop(self, timeout: float) -> None:
        await self._tasks.close(timeout, grace=0)
        if self._api is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._api.close(), timeout=max(0.1, timeout))
            self._api = None

    def carry_over(self, previous: KubernetesBridge) -> None:
        """A reload: take over the notices acted on, the drains (their evictions finish under the old
        configuration, released by the ready this bridge now hears), the participants and the counters."""
        self._notices.update(previous._notices)
        self._evented |= previous._evented
        self._cleared.update(previous._cleared)
        self._participants.update(previous._participants)
        if previous._node_task is not None:
            previous._node_task.cancel("replaced by a reload")
        self.calls.update(previous.calls)
        self.drainer.adopt(previous.drainer)
        self._changed()

    def handle(self, event: Event) -> None:
        notice = event.notice
        if event.type is EventType.READY:
            notice_id = str(event.data.get("notice_id") or (notice.id if notice else ""))
            self.drainer.ready(notice_id, str(event.data.get("reason") or "ready"))
            return
        if notice is None:
            return
        if event.type is EventType.CLEARED:
            if self._notices.pop(notice.id, None) is not None:
                if notice.id in self._evented:
                    self._cleared[notice.id] = notice
                if self.drainer.cancel(notice.id):
                    for task in self._tasks:
                        if task.get_name().startswith(f"kubernetes:drain:{notice.id}"):
                            task.cancel("notice cleared")
                self._changed()
            return
        if event.type not in (EventType.NOTICE, EventType.UPDATE) or not self._applies(notice):
            return
        first = notice.id not in self._notices
        self._notices[notice.id] = notice
        self._changed()
        if notice.id in self.drainer.drains:
            self.drainer.update(notice)
        elif first and self.config.drain:
            self.drainer.begin(notice)

    def on_report(self, report: Report) -> None:
        """A participant's report (a save, or its registration) marks its pod as a training pod."""
        if report.client.get("participant") is not True:
            return
        key = (
            f"{report.client.get('job', report.client.get('name', 'client'))}#{report.client.get('rank', '')}"
        )
        pid = report.peer_pid or report.client.get("pid")
        self._remember(f"{key}@{pid}", pid, report.client.get("host"))

    def on_subscriber(self, peer: Mapping[str, Any]) -> None:
        """A process that subscribed to the notices marks its pod as a training pod from its first
        connection: a job that has not saved (or reported) yet is still held for the notice's ready, not
        evicted at once. Its pod is found through the pid's cgroup while the process lives."""
        pid = peer.get("pid")
        if isinstance(pid, int) and pid > 0:
            self._remember(f"subscriber@{pid}", pid, None)

    def _remember(self, key: str, pid: Any, host: Any) -> None:
        self._participants[key] = {"pid": pid, "host": host, "seen": self._now()}
        if len(self._participants) > MAX_PARTICIPANTS:
            # Forget processes that are gone; past the bound, the longest silent ones.
            for old in [k for k, who in self._participants.items() if not alive(who)]:
                del self._participants[old]
            for old in sorted(self._participants, key=lambda k: self._participants[k]["seen"])[
                : max(0, len(self._participants) - MAX_PARTICIPANTS)
            ]:
                del self._participants[old]

    def status(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "node": self.node,
            "state": "acting" if self._notices else "idle",
            "notices": sorted(self._notices),
            "node_state": dict(self.node_state),
            "drains": self.drainer.status(),
            "errors": self.errors,
            "running": sum(1 for task in self._tasks if task is not self._node_task),
        }
        if self.last_error is not None:
            doc["last_error"] = self.last_error
            doc["last_error_at"] = format_time(self.last_error_at) if self.last_error_at else None
        return doc

    async def settled(self) -> None:
        """Wait until the node was brought (or tried to be brought) to what the notices ask for."""
        await self._settled.wait()

    async def drain(self) -> None:
        """Wait until the node is in the state the notices ask for and every eviction has ended (tests)."""
        while True:
            await self._settled.wait()
            busy = [t for t in self._tasks if t is not self._node_task and not t.done()]
            if not busy and self._settled.is_set() and not self._dirty.is_set():
                return
            if busy:
                await asyncio.wait(busy)

    # --- helpers ------------------------------------------------------------------------------------

    def _applies(self, notice: Notice) -> bool:
        cfg = self.config
        if cfg.kinds and notice.kind.value not in cfg.kinds:
            return False
        if notice.severity.rank < Severity(cfg.min_severity).rank:
            return False
        return cfg.drills or not notice.drill

    def _changed(self) -> None:
        self._settled.clear()
        self._dirty.set()

    def _spawn(self, coro: Any, name: str) -> asyncio.Task[Any] | None:
        return self._tasks.spawn(coro, name)

    def _api_client(self) -> KubeApi:
        if self._api is None:
            self._api = self._connect()
        return self._api

    async def _call(self, fn: Callable[[KubeApi], Any], verb: str, resource: str) -> Any:
        """One API call, counted by outcome; a failure is recorded (status, log) and raised."""
        try:
            result = await fn(self._api_client())
        except KubeError as exc:
            self._failed(exc)
            raise
        self.calls[(verb, resource, "ok")] += 1
        return result

    def _failed(self, exc: KubeError) -> None:
        self.calls[(exc.verb, exc.resource, exc.failure)] += 1
        self.errors += 1
        self.last_error = str(exc)
        self.last_error_at = self._now()
        level = log.warning if exc.failure in ("conflict", "throttled") else log.error
        level("kubernetes_call_failed", node=self.node, error=str(exc), failure=exc.failure, code=exc.code)

    async def _sleep_or_change(self, delay: float) -> None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._dirty.wait(), delay)

    # --- the node: taint, cordon, condition, Events ------------------------------------------------------

    async def _node_loop(self) -> None:
        backoff = BACKOFF_START_S
        while True:
            await self._dirty.wait()
            self._dirty.clear()
            try:
                await self._reconcile()
            except KubeError as exc:
                delay = exc.retry_after if exc.retry_after is not None else backoff
                if exc.failure in ("forbidden", "config", "unauthorized", "not_found", "invalid"):
                    delay = self.config.retry_max_s  # needs an operator: try again now and then
                delay = min(delay, self.config.retry_max_s) * random.uniform(0.9, 1.1)
                backoff = min(backoff * 2, self.config.retry_max_s)
                self._settled.set()
                await self._sleep_or_change(delay)
                self._dirty.set()
                continue
            backoff = BACKOFF_START_S
            if not self._dirty.is_set():
                self._settled.set()

    async def _reconcile(self) -> None:
        """Bring the node to what the active notices ask for; every step reads the node afresh, so a
        change made by someone else meanwhile is kept."""
        notices = sorted(
            self._notices.values(), key=lambda n: (n.deadline is None, n.deadline or n.detected_at)
        )
        errors: list[KubeError] = []
        for step in (self._reconcile_spec, self._reconcile_condition, self._post_events):
            try:
                await step(notices)
            except KubeError as exc:
                errors.append(exc)
        if errors:
            raise errors[0]

    async def _reconcile_spec(self, notices: list[Notice]) -> None:
        cfg = self.config
        for attempt in range(CONFLICT_RETRIES + 1):
            node = await self._call(lambda api: api.get_node(), "get", "nodes")
            patch = _node_patch(cfg, node, notices)
            if not patch:
                self._note_node(node)
                return
            version = node.get("metadata", {}).get("resourceVersion")
            patch.setdefault("metadata", {})["resourceVersion"] = version
            try:
                node = await self._call(partial(KubeApi.patch_node, patch=patch), "patch", "nodes")
            except KubeError as exc:
                if exc.failure == "conflict" and attempt < CONFLICT_RETRIES:
                    continue  # someone changed the node: read it again
                raise
            self._note_node(node)
            log.info(
                "kubernetes_node_updated",
                node=self.node,
                taints=[t.get("key") for t in node.get("spec", {}).get("taints") or []],
                unschedulable=bool(node.get("spec", {}).get("unschedulable")),
                notices=[n.id for n in notices],
            )
            return

    def _note_node(self, node: Mapping[str, Any]) -> None:
        keys = plan.taint_keys(self.config)
        self.node_state["tainted"] = [
            t.get("key") for t in node.get("spec", {}).get("taints") or [] if t.get("key") in keys
        ]
        annotations = node.get("metadata", {}).get("annotations") or {}
        self.node_state["cordoned"] = plan.CORDON_ANNOTATION in annotations
        self.node_state["unschedulable"] = bool(node.get("spec", {}).get("unschedulable"))

    async def _reconcile_condition(self, notices: list[Notice]) -> None:
        cfg = self.config
        if not cfg.condition:
            return
        if notices:
            wanted = plan.condition_for(cfg, notices[0], self._now())
            known = self.node_state.get("condition_doc")
            if known is not None and all(known.get(k) == wanted[k] for k in ("status", "reason", "message")):
                return
            patch: dict[str, Any] = {"status": {"conditions": [wanted]}}
        else:
            if not self.node_state["condition"]:
                node = await self._call(lambda api: api.get_node(), "get", "nodes")
                types = [c.get("type") for c in node.get("status", {}).get("conditions") or []]
                if cfg.condition_type not in types:
                    return
            patch = {"status": {"conditions": [{"type": cfg.condition_type, "$patch": "delete"}]}}
        await self._call(lambda api: api.patch_node_status(patch), "patch", "nodes/status")
        self.node_state["condition"] = bool(notices)
        self.node_state["condition_doc"] = patch["status"]["conditions"][0] if notices else None

    async def _post_events(self, notices: list[Notice]) -> None:
        if not self.config.event:
            self._cleared.clear()
            return
        todo = [(n, False) for n in notices if n.id not in self._evented]
        todo += [(n, True) for n in self._cleared.values()]
        if not todo:
            return
        node = await self._call(lambda api: api.get_node(), "get", "nodes")
        for notice, cleared in todo:
            now = self._now()
            if cleared:
                reason = plan.CLEARED_REASON
                message = (
                    f"{notice.kind.value} notice {notice.id} cleared; the agent removed its taint and cordon"
                )
            else:
                reason = plan.REASONS.get(notice.kind.value, "Notice")
                message = plan.describe(notice, now)
            doc = plan.event_for(
                self.config,
                node,
                reason=reason,
                message=message,
                warning=not cleared,
                now=now,
                host=self._host_name,
            )
            try:
                await self._call(partial(KubeApi.create_event, event=doc), "create", "events")
            except KubeError as exc:
                if exc.failure not in ("forbidden", "invalid"):
                    raise
                # An Event is a courtesy: one the API refuses for good is not retried.
            if cleared:
                self._cleared.pop(notice.id, None)
                self._evented.discard(notice.id)
            else:
                self._evented.add(notice.id)


class Collector:
    """Prometheus collector over the bridge in place (a reload swaps it)."""

    def __init__(self, bridge: KubernetesBridge) -> None:
        self.bridge = bridge

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        bridge = self.bridge
        calls = CounterMetricFamily(
            "preemptd_kubernetes_calls",
            "Kubernetes API calls of the node termination handler, by verb, resource and outcome",
            labels=["verb", "resource", "outcome"],
        )
        for (verb, resource, outcome), value in sorted(bridge.calls.items()):
            calls.add_metric([verb, resource, outcome], value)
        yield calls
        evictions = CounterMetricFamily(
            "preemptd_kubernetes_evictions", "Pods the agent drained, by outcome", labels=["outcome"]
        )
        for outcome, value in sorted(bridge.drainer.evictions.items()):
            evictions.add_metric([outcome], value)
        yield evictions
        waiting = GaugeMetricFamily(
            "preemptd_kubernetes_pods_pending_eviction",
            "Pods of the node that a drain will still evict (waiting for ready, or retried)",
        )
        waiting.add_metric([], bridge.drainer.pending())
        yield waiting


def _node_patch(cfg: KubernetesConfig, node: Mapping[str, Any], notices: list[Notice]) -> dict[str, Any]:
    """The patch that brings ``node``'s taints and cordon to what ``notices`` ask for; empty when it has them."""
    spec, meta = node.get("spec", {}), node.get("metadata", {})
    annotations = meta.get("annotations") or {}
    current = spec.get("taints") or []
    patch: dict[str, Any] = {}
    wanted: dict[str, dict[str, str]] = {}
    if cfg.taint:
        for notice in reversed(notices):  # the earliest deadline's value wins a shared key
            taint = plan.taint_for(cfg, notice)
            wanted[taint["key"]] = taint
    ours = plan.taint_keys(cfg) - set(wanted)
    taints, changed = list(current), False
    removed = plan.without_taints(taints, ours, cfg.taint_effect) if ours else None
    if removed is not None:
        taints, changed = removed, True
    for taint in wanted.values():
        added = plan.with_taint(taints, taint)
        if added is not None:
            taints, changed = added, True
    if changed:
        patch.setdefault("spec", {})["taints"] = taints
    if notices and cfg.cordon and not spec.get("unschedulable"):
        patch.setdefault("spec", {})["unschedulable"] = True
        patch.setdefault("metadata", {}).setdefault("annotations", {})[plan.CORDON_ANNOTATION] = notices[0].id
    elif not notices and plan.CORDON_ANNOTATION in annotations:
        if spec.get("unschedulable"):
            patch.setdefault("spec", {})["unschedulable"] = None
        patch.setdefault("metadata", {}).setdefault("annotations", {})[plan.CORDON_ANNOTATION] = None
    return patch
