"""The Kubernetes bridge (``[actions.kubernetes]``): the agent as its node's termination handler. It taints,
cordons and annotates the node at once and evicts its pods once the training on the node has flushed; see
docs/kubernetes.md. The client library (lightkube) is the optional extra ``preemptd[kubernetes]`` and is
imported only when the bridge is enabled."""

from __future__ import annotations

import contextlib
import os
import platform
import sys
import weakref
from typing import TYPE_CHECKING, Any

from agent.bridges.kubernetes.config import NODE_NAME, TABLE, KubernetesConfig
from agent.core.errors import ConfigError
from agent.core.jobs import withdraw_job_names
from agent.core.plugins import Part, Table
from agent.window.limits import withdraw_limits

if TYPE_CHECKING:
    from agent.bridges.kubernetes.bridge import Collector, KubernetesBridge
    from agent.core.ports import Host, ReactorFactory

__all__ = ["REACTOR", "TABLE", "KubernetesConfig", "build_reactor", "node_name"]

# One metrics collector per agent; a reload points it at the new bridge.
_collectors: weakref.WeakKeyDictionary[Any, Collector] = weakref.WeakKeyDictionary()


def node_name(config: KubernetesConfig, environ: dict[str, str] | None = None) -> str:
    """The node: the configured name, else NODE_NAME (set by the DaemonSet from ``spec.nodeName``)."""
    env = os.environ if environ is None else environ
    name = config.node or env.get("NODE_NAME", "").strip()
    if not name:
        raise ConfigError(
            f"{TABLE}.node: no node name; set it, or give the agent NODE_NAME through the downward API "
            "(env: NODE_NAME from fieldRef spec.nodeName, as packaging/kubernetes/daemonset.yaml does)"
        )
    if not NODE_NAME.fullmatch(name):
        raise ConfigError(f"{TABLE}.node: NODE_NAME {name!r} is not a node name (a lower-case DNS subdomain)")
    return name


def build_reactor(host: Host) -> KubernetesBridge | None:
    """The bridge when ``[actions.kubernetes] enabled = true``; ConfigError when it cannot run (no node
    name, the client library missing)."""
    config = host.config.table(TABLE, KubernetesConfig)
    if not config.enabled:
        # A reload that turns the bridge off takes back what the running one offered the other parts.
        withdraw_limits(host.hooks, "kubernetes")
        withdraw_job_names(host.hooks, "kubernetes")
        return None
    node = node_name(config)
    try:
        from agent.bridges.kubernetes.api import KubeApi
        from agent.bridges.kubernetes.bridge import Collector, KubernetesBridge
    except ImportError as exc:
        if sys.version_info < (3, 11):  # the extra installs nothing there (pyproject.toml)
            raise ConfigError(
                f"{TABLE}.enabled: the Kubernetes bridge needs Python 3.11 or newer (its client library, "
                f"lightkube on httpx2, does), and this agent runs on Python {platform.python_version()}; "
                "run it from the DaemonSet's image (packaging/kubernetes, Python 3.11) or install preemptd "
                "with 'preemptd[kubernetes]' on a Python 3.11 or newer"
            ) from None
        raise ConfigError(
            f"{TABLE}.enabled: the Kubernetes bridge needs its client library ({exc.name or exc}); "
            "install it with: pip install 'preemptd[kubernetes]'"
        ) from None

    def connect() -> KubeApi:
        return KubeApi.connect(config, node)

    bridge = KubernetesBridge(config, node=node, connect=connect, now=host.now, active=host.board.active)
    collector = _collectors.get(host)
    if collector is None:
        collector = Collector(bridge)
        host.hooks.add_metrics_collector(collector)
        # A host that cannot be weakly referenced gets one collector per build.
        with contextlib.suppress(TypeError):
            _collectors[host] = collector
    collector.bridge = bridge
    from agent.bridges.kubernetes import jobname, window

    window.offer(host.hooks, bridge)  # the training pods' grace, for the window (agent/window/)
    jobname.offer(host.hooks, bridge)  # the pods' owners, for the RAM tier's job ids (agent/core/jobs.py)
    return bridge


# The entry of the reactor registry (agent/actions/registry.py).
REACTOR: Part[ReactorFactory] = Part("kubernetes", build_reactor, (Table(TABLE, KubernetesConfig),))
