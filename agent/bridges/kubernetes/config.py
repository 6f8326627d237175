"""The ``[actions.kubernetes]`` table: which notices make the agent taint, cordon and drain its node, and
how. Standard library only, so the table is checked even where the client library is not installed."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from agent.config import NoticeKindName, Seconds, SeverityName
from agent.core.errors import ConfigError

TABLE = "actions.kubernetes"

# A qualified name as Kubernetes validates label and taint keys: an optional DNS subdomain prefix and a
# name of at most 63 characters.
_NAME = r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
_PREFIX = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"
QUALIFIED_NAME = re.compile(rf"({_PREFIX}/)?{_NAME}")
# A node's name is a DNS subdomain.
NODE_NAME = re.compile(rf"{_PREFIX}")
# A condition type is a CamelCase word by convention; the API accepts a qualified name.
CONDITION_TYPE = QUALIFIED_NAME


@dataclass(frozen=True)
class KubernetesConfig:
    """The node termination handler: on a notice of ``kinds``, taint, cordon, set a condition, post an
    Event, then evict the node's pods once its training participants saved (or at the latest moment)."""

    enabled: bool = False
    # The node this agent runs on; empty: the NODE_NAME variable (the DaemonSet sets it from spec.nodeName).
    node: str = ""
    # A kubeconfig file; empty: the pod's service account in a cluster, else KUBECONFIG or ~/.kube/config.
    kubeconfig: str = ""
    context: str = ""
    kinds: tuple[NoticeKindName, ...] = ("termination", "maintenance")
    min_severity: SeverityName = "warning"
    # A drill taints, cordons and drains the node for real when true: a full rehearsal.
    drills: bool = False
    taint: bool = True
    taint_key: str = "preemptd.io/notice"
    taint_effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] = "NoSchedule"
    # "aws-node-termination-handler": its taint keys per kind (spot-itn, scheduled-maintenance,
    # rebalance-recommendation), for clusters whose tolerations and tooling expect them.
    taint_names: Literal["preemptd", "aws-node-termination-handler"] = "preemptd"
    cordon: bool = True
    condition: bool = True
    condition_type: str = "PreemptdNotice"
    event: bool = True
    # The namespace of the Events about the node (the kubelet's own node Events are in "default").
    event_namespace: str = "default"
    drain: bool = True
    # Pods whose processes are no participant (inference servers, notebooks) go at once with "at_once";
    # "with_participants" holds them until the training pods are ready too.
    pods_without_participants: Literal["at_once", "with_participants"] = "at_once"
    # A pod is evicted no later than deadline - its terminationGracePeriodSeconds - drain_margin_s.
    drain_margin_s: float = 10.0
    # Wait between attempts at an eviction a PodDisruptionBudget blocks, when the API gives no Retry-After;
    # the cap of the backoff between attempts at an eviction that failed otherwise (409, 5xx, no answer).
    eviction_retry_s: Seconds = 5.0
    # Longest wait honoured from a Retry-After, and the cap of the backoff while the API is unreachable.
    retry_max_s: Seconds = 30.0
    request_timeout_s: Seconds = 10.0

    def __post_init__(self) -> None:
        where = TABLE
        if self.node and not NODE_NAME.fullmatch(self.node):
            raise ConfigError(f"{where}.node: {self.node!r} is not a node name (a lower-case DNS subdomain)")
        if not QUALIFIED_NAME.fullmatch(self.taint_key):
            raise ConfigError(
                f"{where}.taint_key: {self.taint_key!r} is not a valid taint key; use a qualified name such "
                "as 'preemptd.io/notice'"
            )
        if not CONDITION_TYPE.fullmatch(self.condition_type):
            raise ConfigError(
                f"{where}.condition_type: {self.condition_type!r} is not a valid condition type; use a word "
                "such as 'PreemptdNotice'"
            )
        if not NODE_NAME.fullmatch(self.event_namespace):
            raise ConfigError(f"{where}.event_namespace: {self.event_namespace!r} is not a namespace name")
        for key in ("drain_margin_s", "eviction_retry_s", "retry_max_s", "request_timeout_s"):
            value = getattr(self, key)
            if value < 0 or (key != "drain_margin_s" and value == 0):
                raise ConfigError(f"{where}.{key}: {value!r} must be a positive number of seconds")
