"""Pure decisions of the Kubernetes bridge, over the API's JSON objects: the taint, condition and Event for a
notice, the node's taint list with ours added or removed (as ``kubectl taint`` computes it), which pods a
drain evicts (as ``kubectl drain`` chooses them), the latest moment to evict a pod, and which pods hold a
training participant. No I/O except reading a process's cgroup file."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from agent.bridges.kubernetes.config import KubernetesConfig
from agent.core.notice import Kind, Notice, format_time

# Set with the cordon, so that clearing uncordons only a node this agent cordoned (the node's own record
# survives an agent restart; an administrator's cordon never carries it).
CORDON_ANNOTATION = "preemptd.io/cordoned-for"
COMPONENT = "preemptd"

AWS_NTH_TAINTS: Mapping[str, str] = {
    Kind.TERMINATION.value: "aws-node-termination-handler/spot-itn",
    Kind.MAINTENANCE.value: "aws-node-termination-handler/scheduled-maintenance",
    Kind.REBALANCE.value: "aws-node-termination-handler/rebalance-recommendation",
}

REASONS: Mapping[str, str] = {
    Kind.TERMINATION.value: "TerminationNotice",
    Kind.REBALANCE.value: "RebalanceRecommendation",
    Kind.MAINTENANCE.value: "MaintenanceScheduled",
    Kind.GPU_FAULT.value: "GPUFault",
    Kind.GPU_DEGRADED.value: "GPUDegraded",
    Kind.HOST_DEGRADED.value: "HostDegraded",
}
CLEARED_REASON = "NoticeCleared"

# Label values: at most 63 characters of [A-Za-z0-9_.-], alphanumeric at both ends.
_LABEL_VALUE_BAD = re.compile(r"[^A-Za-z0-9_.-]+")
# A pod's UID in a cgroup path: .../kubepods-burstable-pod<uid>.slice (systemd driver, '_' for '-') or
# .../kubepods/burstable/pod<uid>/... (cgroupfs driver).
_POD_UID = re.compile(r"pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12})")


def taint_key(config: KubernetesConfig, kind: str) -> str:
    if config.taint_names == "aws-node-termination-handler":
        return AWS_NTH_TAINTS.get(kind, config.taint_key)
    return config.taint_key


def taint_keys(config: KubernetesConfig) -> set[str]:
    """Every key this agent may have set under ``config`` (all are removed when the last notice clears)."""
    keys = {config.taint_key}
    if config.taint_names == "aws-node-termination-handler":
        keys.update(AWS_NTH_TAINTS.values())
    return keys


def label_value(text: str) -> str:
    value = _LABEL_VALUE_BAD.sub("-", text)[:63].strip("-_.")
    return value


def taint_for(config: KubernetesConfig, notice: Notice) -> dict[str, str]:
    return {
        "key": taint_key(config, notice.kind.value),
        "value": label_value(notice.kind.value + ("-drill" if notice.drill else "")),
        "effect": config.taint_effect,
    }


def with_taint(taints: Sequence[Mapping[str, Any]], taint: Mapping[str, str]) -> list[dict[str, Any]] | None:
    """The node's taints with ``taint`` added as ``kubectl taint --overwrite`` does (a new taint first, one
    of the same key and effect replaced in place); None when the node already has it."""
    result = [dict(t) for t in taints]
    for i, current in enumerate(result):
        if (current.get("key"), current.get("effect")) == (taint["key"], taint["effect"]):
            if current.get("value", "") == taint.get("value", ""):
                return None
            result[i] = dict(taint)
            return result
    return [dict(taint), *result]


def without_taints(
    taints: Sequence[Mapping[str, Any]], keys: Iterable[str], effect: str
) -> list[dict[str, Any]] | None:
    """The node's taints without those of ``keys`` and ``effect``; None when there is none of them (an
    administrator's taints, other keys or effects, are kept)."""
    keys = set(keys)
    kept = [dict(t) for t in taints if not (t.get("key") in keys and t.get("effect") == effect)]
    return None if len(kept) == len(taints) else kept


def describe(notice: Notice, now: datetime | None = None) -> str:
    """The message of the condition and the Event: what, from where, the deadline (and, given ``now``,
    how far it is)."""
    what = f"{'Drill: ' if notice.drill else ''}{notice.kind.value} notice from {notice.source}"
    if notice.reason:
        what += f" ({notice.reason})"
    if notice.deadline is None:
        return f"{what}; no deadline"
    when = f"deadline {format_time(notice.deadline)}"
    if now is not None:
        when += f" (in {max(0, round((notice.deadline - now).total_seconds()))} s)"
    return f"{what}; {when}; notice {notice.id}"


def condition_for(config: KubernetesConfig, notice: Notice, now: datetime) -> dict[str, Any]:
    stamp = format_time(now.replace(microsecond=0))
    return {
        "type": config.condition_type,
        "status": "True",
        "reason": REASONS.get(notice.kind.value, "Notice"),
        # No countdown here: the condition changes only when the notice does.
        "message": describe(notice)[:1024],
        "lastHeartbeatTime": stamp,
        "lastTransitionTime": stamp,
    }


def event_for(
    config: KubernetesConfig,
    node: Mapping[str, Any],
    *,
    reason: str,
    message: str,
    warning: bool,
    now: datetime,
    host: str,
) -> dict[str, Any]:
    """A core/v1 Event about the node, as the kubelet writes its own (``kubectl describe node`` lists the
    Events whose involvedObject is the node, by name and uid, with no namespace)."""
    meta = node.get("metadata", {})
    stamp = format_time(now.replace(microsecond=0))
    name = str(meta.get("name", ""))
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {
            "name": f"{name}.{int(now.timestamp() * 1e9):x}",
            "namespace": config.event_namespace,
        },
        "involvedObject": {"apiVersion": "v1", "kind": "Node", "name": name, "uid": meta.get("uid", name)},
        "reason": reason,
        "message": message[:1024],
        "type": "Warning" if warning else "Normal",
        "source": {"component": COMPONENT, "host": host},
        "reportingComponent": COMPONENT,
        "reportingInstance": host,
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "count": 1,
    }


def skip_reason(pod: Mapping[str, Any]) -> str | None:
    """Why a drain leaves this pod alone, as ``kubectl drain --ignore-daemonsets`` does: a DaemonSet's pod
    (it would come straight back and tolerates the taint), a mirror pod (the kubelet's static pod, which the
    API cannot evict); None for a pod to evict (a finished pod too, as kubectl does: that removes it)."""
    meta = pod.get("metadata", {})
    if "kubernetes.io/config.mirror" in (meta.get("annotations") or {}):
        return "mirror"
    for owner in meta.get("ownerReferences") or []:
        if owner.get("controller") and owner.get("kind") == "DaemonSet":
            return "daemonset"
    return None


def pod_key(pod: Mapping[str, Any]) -> str:
    meta = pod.get("metadata", {})
    return f"{meta.get('namespace', '')}/{meta.get('name', '')}"


def grace_of(pod: Mapping[str, Any]) -> float:
    value = pod.get("spec", {}).get("terminationGracePeriodSeconds")
    return float(value) if isinstance(value, (int, float)) else 30.0  # the API's default


def latest_eviction(deadline: datetime | None, grace_s: float, margin_s: float) -> datetime | None:
    """The last moment to evict a pod so that its grace period ends ``margin_s`` before the deadline."""
    if deadline is None:
        return None
    return deadline - timedelta(seconds=grace_s + margin_s)


def pod_uids_of(pid: int, proc: Path = Path("/proc")) -> set[str]:
    """The pod UIDs in a process's cgroup paths (empty outside a pod, or when the process is gone)."""
    try:
        text = (proc / str(pid) / "cgroup").read_text()
    except OSError:
        return set()
    return {uid.replace("_", "-") for uid in _POD_UID.findall(text)}


def pods_with_participants(
    pods: Iterable[Mapping[str, Any]], participants: Iterable[Mapping[str, Any]], proc: Path = Path("/proc")
) -> set[str]:
    """The keys of the pods a participant runs in: its process's cgroup names the pod's UID (the agent
    sees the node's PIDs with hostPID), or the host name it reported is the pod's name (a pod's host name,
    unless it is on the host network)."""
    uids: set[str] = set()
    hosts: set[str] = set()
    for who in participants:
        pid = who.get("pid")
        if isinstance(pid, int) and pid > 0:
            uids |= pod_uids_of(pid, proc)
        host = who.get("host")
        if isinstance(host, str) and host:
            hosts.add(host)
    result = set()
    for pod in pods:
        meta = pod.get("metadata", {})
        on_host_network = bool(pod.get("spec", {}).get("hostNetwork"))
        if meta.get("uid") in uids or (not on_host_network and meta.get("name") in hosts):
            result.add(pod_key(pod))
    return result
