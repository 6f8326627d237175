"""The Kubernetes bridge's limit on the notice window (agent/window/): a training pod that is evicted
(by this bridge's drain, or by the kubelet when the node shuts down) gets SIGTERM and, its
``terminationGracePeriodSeconds`` later, SIGKILL. The pods are the node's pods a participant runs in, found as
the drain finds them (plan.pods_with_participants); the list is read again at most every ``POD_LIST_S``
unless the participants changed."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from agent.bridges.kubernetes import plan
from agent.bridges.kubernetes.drain import alive
from agent.core.offers import Capabilities
from agent.window.limits import Limit, limit_registry

if TYPE_CHECKING:
    from agent.bridges.kubernetes.bridge import KubernetesBridge

POD_LIST_S = 300.0
LENGTHEN = (
    "raise the pod's terminationGracePeriodSeconds (GKE spot and preemptible nodes give pods at most 15 s at node "
    "shutdown, whatever they ask); the bridge evicts a training pod only after the notice's ready or at the "
    "deadline minus its grace and actions.kubernetes.margin_s"
)


class PodGrace:
    """The limit source: the shortest grace among the participants' pods (none known: no limit)."""

    def __init__(self, bridge: KubernetesBridge, clock: Callable[[], float] = time.monotonic) -> None:
        self.bridge = bridge
        self._clock = clock
        self._pods: list[dict[str, Any]] = []
        self._read: tuple[float, frozenset[Any]] | None = None

    async def __call__(self) -> Sequence[Limit]:
        bridge = self.bridge
        participants = [p for p in bridge._participants.values() if alive(p)]
        who = frozenset((p.get("pid"), p.get("host")) for p in participants)
        if not participants:
            return []
        if self._read is None or self._read[1] != who or self._clock() - self._read[0] > POD_LIST_S:
            self._pods = await bridge._call(lambda api: api.list_pods(), "list", "pods")
            self._read = (self._clock(), who)
        keys = plan.pods_with_participants(self._pods, participants, bridge._proc)
        graces = sorted(
            (plan.grace_of(pod), plan.pod_key(pod)) for pod in self._pods if plan.pod_key(pod) in keys
        )
        if not graces:
            return []
        seconds, key = graces[0]
        return [
            Limit(
                "pod_grace",
                seconds,
                f"pod {key}: terminationGracePeriodSeconds"
                + (f" (of {len(graces)} training pods)" if len(graces) > 1 else ""),
                lengthen=LENGTHEN,
            )
        ]


def offer(hooks: Capabilities, bridge: KubernetesBridge) -> None:
    """Offer the training pods' grace to the window (``hooks``: the host's, with ``capability`` and ``provide``)."""
    limit_registry(hooks).add("kubernetes", PodGrace(bridge))
