"""The Kubernetes bridge's answer to "which job is this process in" (agent/core/jobs.py), for the RAM tier's
job ids: the pod the process runs in (its cgroup names the pod's UID, as for the drain) and that pod's owner.

- A JobSet's pods carry its UID as the label ``jobset.sigs.k8s.io/jobset-uid``: ``jobset-<uid>``. It stays the
  same when the JobSet restarts (which recreates its Jobs) and differs between two JobSets of one name.
- Any other pod is named by its controller (``ownerReferences`` with ``controller: true``): a Job (the same
  across the Job's retries), a PyTorchJob, a StatefulSet...: ``<kind>-<uid>``, the kind in lower case.
- A pod without a controller is a job of its own that nothing restarts: no name (set ``PREEMPTD_JOB_ID``).

The node's pod list is read again when the pod is not in the one read last, or that one is older than
``POD_LIST_S``."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from agent.bridges.kubernetes import plan
from agent.core.jobs import JobName, UnknownJob, job_name_registry
from agent.core.offers import Capabilities

if TYPE_CHECKING:
    from agent.bridges.kubernetes.bridge import KubernetesBridge

JOBSET_UID = "jobset.sigs.k8s.io/jobset-uid"
POD_LIST_S = 60.0


def job_of_pod(pod: Mapping[str, Any]) -> JobName:
    """The job a pod belongs to (see the module); UnknownJob when it has no controller."""
    meta = pod.get("metadata") or {}
    key = plan.pod_key(pod)
    jobset = (meta.get("labels") or {}).get(JOBSET_UID)
    if isinstance(jobset, str) and jobset:
        return JobName(f"jobset-{jobset}", f"pod {key}'s JobSet ({JOBSET_UID})")
    for owner in meta.get("ownerReferences") or []:
        kind, uid = owner.get("kind"), owner.get("uid")
        if owner.get("controller") and isinstance(kind, str) and isinstance(uid, str) and kind and uid:
            return JobName(f"{kind.lower()}-{uid}", f"pod {key}'s controller {kind} {owner.get('name', '?')}")
    raise UnknownJob(f"pod {key} has no controller (a bare pod): set PREEMPTD_JOB_ID in its spec")


class PodOwner:
    """The job-name source: the process's pod's owner."""

    def __init__(self, bridge: KubernetesBridge, clock: Callable[[], float] = time.monotonic) -> None:
        self.bridge = bridge
        self._clock = clock
        self._pods: dict[str, dict[str, Any]] = {}
        self._read_at: float | None = None

    async def __call__(self, pid: int) -> JobName:
        uids = plan.pod_uids_of(pid, self.bridge._proc)
        if not uids:
            raise UnknownJob(f"pid {pid} runs in no pod (its cgroup names none)")
        stale = self._read_at is None or self._clock() - self._read_at > POD_LIST_S
        if stale or not uids & self._pods.keys():
            pods = await self.bridge._call(lambda api: api.list_pods(), "list", "pods")
            self._pods = {str((p.get("metadata") or {}).get("uid")): p for p in pods}
            self._read_at = self._clock()
        for uid in sorted(uids):
            if uid in self._pods:
                return job_of_pod(self._pods[uid])
        raise UnknownJob(f"pid {pid}'s pod {sorted(uids)[0]} is not among node {self.bridge.node}'s pods")


def offer(hooks: Capabilities, bridge: KubernetesBridge) -> None:
    """Offer the pods' owners as job names (``hooks``: the host's, with ``capability`` and ``provide``)."""
    job_name_registry(hooks).add("kubernetes", PodOwner(bridge))
