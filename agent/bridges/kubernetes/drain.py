"""The drain of the Kubernetes bridge: for each notice, the node's pods and when each goes. A pod that
holds a training participant waits for the notice's ``ready`` or, at the latest, deadline - its grace
period - a margin; the others go at once (or with them). Each eviction is retried as its failure asks
(a PodDisruptionBudget until the deadline) and its outcome shown in status and metrics."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import psutil
import structlog

from agent.bridges.kubernetes import plan
from agent.bridges.kubernetes.api import KubeApi, KubeError
from agent.bridges.kubernetes.config import KubernetesConfig
from agent.core.notice import Notice, format_time
from agent.core.tasks import wait_for_any

log = structlog.get_logger("preemptd.kubernetes")

# First wait after a failed call; doubles up to retry_max_s.
BACKOFF_START_S = 0.5

Call = Callable[[Callable[[KubeApi], Any], str, str], Awaitable[Any]]
Spawn = Callable[[Coroutine[Any, Any, Any], str], "asyncio.Task[Any] | None"]


def alive(participant: Mapping[str, Any]) -> bool:
    """Whether a participant's process still runs (one that gave no pid is taken as alive)."""
    pid = participant.get("pid")
    return not isinstance(pid, int) or psutil.pid_exists(pid)


@dataclass
class PodDrain:
    """One pod of a drain: when it is due, and what happened to it."""

    namespace: str
    name: str
    grace_s: float
    participant: bool
    # waiting → evicting (→ retrying | blocked_by_budget → evicting) → evicted | gone | blocked | failed |
    # cancelled
    state: str = "waiting"
    attempts: int = 0
    evict_at: datetime | None = None
    retry_at: datetime | None = None  # the next attempt, while retrying
    done_at: datetime | None = None
    because: str | None = None  # ready, deadline (its latest moment) or no_participants
    last_error: str | None = None

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "state": self.state,
            "participant": self.participant,
            "grace_s": self.grace_s,
            "attempts": self.attempts,
        }
        if self.evict_at is not None:
            doc["evict_at"] = format_time(self.evict_at)
        if self.retry_at is not None and self.state in ("retrying", "blocked_by_budget"):
            doc["retry_at"] = format_time(self.retry_at)
        if self.done_at is not None:
            doc["done_at"] = format_time(self.done_at)
        if self.because is not None:
            doc["because"] = self.because
        if self.last_error:
            doc["last_error"] = self.last_error
        return doc


@dataclass
class Drain:
    """The drain of one notice: its pods, and the ``ready`` that releases the participants' pods."""

    notice: Notice
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    pods: dict[str, PodDrain] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    ready_reason: str | None = None
    state: str = "planning"

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.notice.kind.value,
            "deadline": format_time(self.notice.deadline) if self.notice.deadline else None,
            "state": self.state,
            "ready": self.ready_reason,
            "pods": {key: pod.to_json() for key, pod in sorted(self.pods.items())},
            "skipped": dict(sorted(self.skipped.items())),
        }


class Drainer:
    """The drains of the notices acted on. ``call`` makes an API call (counted and recorded by the
    bridge), ``spawn`` starts a task the bridge owns (named ``drain:<notice id>...``, so that clearing the
    notice cancels them), ``node_settled`` waits until the node was tainted and cordoned (or tried)."""

    def __init__(
        self,
        config: KubernetesConfig,
        *,
        node: str,
        call: Call,
        spawn: Spawn,
        now: Callable[[], datetime],
        participants: Callable[[], Iterable[Mapping[str, Any]]],
        node_settled: Callable[[], Awaitable[None]],
        proc: Path = Path("/proc"),
    ) -> None:
        self.config = config
        self.node = node
        self._call = call
        self._spawn = spawn
        self._now = now
        self._participants = participants
        self._node_settled = node_settled
        self._proc = proc
        self.drains: dict[str, Drain] = {}
        self.evictions: Counter[str] = Counter()

    def begin(self, notice: Notice) -> None:
        if notice.id in self.drains:
            return
        drain = Drain(notice)
        self.drains[notice.id] = drain
        self._spawn(self._drain(drain), f"drain:{notice.id}")

    def update(self, notice: Notice) -> None:
        """A changed notice (a new deadline): the pods' latest moments are computed again."""
        drain = self.drains.get(notice.id)
        if drain is not None:
            drain.notice = notice
            drain.changed.set()

    def ready(self, notice_id: str, reason: str) -> None:
        drain = self.drains.get(notice_id)
        if drain is not None and not drain.ready.is_set():
            drain.ready_reason = reason
            drain.ready.set()

    def cancel(self, notice_id: str) -> bool:
        """Forget a cleared notice's drain; True when there was one (its tasks are the caller's to cancel)."""
        drain = self.drains.pop(notice_id, None)
        if drain is None:
            return False
        drain.state = "cancelled"
        return True

    def adopt(self, previous: Drainer) -> None:
        """A reload: the drains in flight (their tasks finish under the old configuration) and counts."""
        self.drains.update(previous.drains)
        self.evictions.update(previous.evictions)

    def status(self) -> dict[str, Any]:
        return {notice_id: drain.to_json() for notice_id, drain in self.drains.items()}

    def pending(self) -> int:
        """Pods a drain will still evict (waiting for ready, or being retried)."""
        return sum(
            1
            for drain in self.drains.values()
            for pod in drain.pods.values()
            if pod.state in ("waiting", "evicting", "retrying", "blocked_by_budget")
        )

    async def _drain(self, drain: Drain) -> None:
        # The node is cordoned first, so that an evicted pod's replacement is not scheduled back onto it.
        await self._node_settled()
        pods = await self._list_pods(drain)
        if pods is None:
            return
        self._plan(drain, pods)
        drain.state = "draining"
        # None once the bridge is stopping: those pods are left to the next start.
        workers = [
            task
            for pod in drain.pods.values()
            if (task := self._spawn(self._evict(drain, pod), f"drain:{drain.notice.id}:{pod.key}"))
        ]
        # At ready, pods that appeared since the first list are drained too.
        ready = asyncio.ensure_future(drain.ready.wait())
        everyone = asyncio.ensure_future(asyncio.gather(*workers, return_exceptions=True))
        try:
            await asyncio.wait({ready, everyone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            ready.cancel()
        if drain.ready.is_set():
            pods = await self._list_pods(drain)
            for pod in self._plan(drain, pods or []):
                task = self._spawn(self._evict(drain, pod), f"drain:{drain.notice.id}:{pod.key}")
                if task is not None:
                    workers.append(task)
        await asyncio.gather(*workers, return_exceptions=True)
        drain.state = "done"

    async def _list_pods(self, drain: Drain) -> list[dict[str, Any]] | None:
        backoff = min(BACKOFF_START_S, self.config.eviction_retry_s)
        while True:
            try:
                pods: list[dict[str, Any]] = await self._call(lambda api: api.list_pods(), "list", "pods")
                return pods
            except KubeError as exc:
                # Paced as an eviction's retries: the drain is under way on a node that is going away.
                delay = exc.retry_after if exc.retry_after is not None else backoff
                backoff = min(backoff * 2, self.config.eviction_retry_s)
                wait = self._retry_wait(drain, delay)
                if wait is None:
                    drain.state = "failed"
                    log.error(
                        "kubernetes_drain_failed", node=self.node, notice_id=drain.notice.id, error=str(exc)
                    )
                    return None
                await asyncio.sleep(wait)

    def _plan(self, drain: Drain, pods: list[dict[str, Any]]) -> list[PodDrain]:
        """Add the pods not yet in the drain; return those added."""
        participants = [p for p in self._participants() if alive(p)]
        with_participants = plan.pods_with_participants(pods, participants, self._proc)
        added = []
        for pod in pods:
            key = plan.pod_key(pod)
            if key in drain.pods or key in drain.skipped:
                continue
            why = plan.skip_reason(pod)
            if why is not None:
                drain.skipped[key] = why
                continue
            meta = pod.get("metadata", {})
            entry = PodDrain(
                namespace=str(meta.get("namespace", "")),
                name=str(meta.get("name", "")),
                grace_s=plan.grace_of(pod),
                participant=key in with_participants,
            )
            drain.pods[key] = entry
            added.append(entry)
        return added

    def _due(self, drain: Drain, pod: PodDrain) -> datetime | None:
        """When the pod goes unless ready comes first: at once for a pod without participants (if so
        configured), else the latest moment its grace still ends a margin before the deadline."""
        if not pod.participant and self.config.pods_without_participants == "at_once":
            return drain.notice.detected_at
        return plan.latest_eviction(drain.notice.deadline, pod.grace_s, self.config.drain_margin_s)

    async def _wait_turn(self, drain: Drain, pod: PodDrain) -> None:
        while not drain.ready.is_set():
            pod.evict_at = self._due(drain, pod)
            delay = None if pod.evict_at is None else (pod.evict_at - self._now()).total_seconds()
            if delay is not None and delay <= 0:
                return
            drain.changed.clear()
            await wait_for_any(drain.ready, drain.changed, timeout=delay)

    def _retry_wait(self, drain: Drain, delay: float) -> float | None:
        """How long to wait before the next attempt: ``delay`` (at most retry_max_s), cut short so that one
        more attempt is made at the deadline; None once the deadline has passed (give up)."""
        wait = min(delay, self.config.retry_max_s)
        deadline = drain.notice.deadline
        if deadline is None:
            return wait
        left = (deadline - self._now()).total_seconds()
        return None if left <= 0 else min(wait, left)

    async def _evict(self, drain: Drain, pod: PodDrain) -> None:
        try:
            await self._wait_turn(drain, pod)
        except asyncio.CancelledError:
            pod.state = "cancelled"
            raise
        why = "ready" if drain.ready.is_set() else "deadline" if pod.participant else "no_participants"
        pod.because = why
        backoff = min(BACKOFF_START_S, self.config.eviction_retry_s)
        while True:
            pod.attempts += 1
            pod.state = "evicting"
            try:
                await self._call(lambda api: api.evict(pod.namespace, pod.name), "create", "pods/eviction")
            except KubeError as exc:
                pod.last_error = str(exc)
                if exc.failure == "not_found":
                    self._finish(drain, pod, "gone", why)
                    return
                blocked = exc.failure == "throttled" and any("DisruptionBudget" in c for c in exc.causes)
                if exc.failure == "throttled":
                    delay = exc.retry_after if exc.retry_after else self.config.eviction_retry_s
                elif exc.failure in ("forbidden", "unauthorized"):
                    delay = self.config.retry_max_s
                elif exc.retry_after is not None:
                    delay = exc.retry_after
                else:
                    # A conflict, a server error, no answer: an eviction is one cheap call on a node that is
                    # going away, so it is tried again every eviction_retry_s at most (and at the deadline),
                    # never left a whole retry_max_s behind an API that has come back.
                    delay = backoff
                    backoff = min(backoff * 2, self.config.eviction_retry_s)
                wait = self._retry_wait(drain, delay)
                if wait is None:
                    self._finish(drain, pod, "blocked" if blocked else "failed", why)
                    return
                pod.state = "blocked_by_budget" if blocked else "retrying"
                pod.retry_at = self._now() + timedelta(seconds=wait)
                await asyncio.sleep(wait)
                continue
            self._finish(drain, pod, "evicted", why)
            return

    def _finish(self, drain: Drain, pod: PodDrain, state: str, why: str) -> None:
        pod.state = state
        pod.done_at = self._now()
        self.evictions[state] += 1
        fields = {"node": self.node, "notice_id": drain.notice.id, "pod": pod.key, "because": why}
        if state in ("evicted", "gone"):
            log.info("kubernetes_pod_evicted", outcome=state, **fields)
        else:
            log.error("kubernetes_eviction_gave_up", outcome=state, error=pod.last_error, **fields)
