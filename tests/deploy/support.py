"""The packaging tests' shared parts: what the Kubernetes bridge's RBAC must grant, and the monitoring files
with promtool."""

from __future__ import annotations

import re
import shutil
import subprocess

import aiohttp
import pytest

from tests.support import REPO, running_agent

# What the Kubernetes bridge calls (agent/bridges/kubernetes/api.py); tests/bridges/test_kubernetes.py checks
# that a full notice cycle makes no other call.
BRIDGE_PERMISSIONS = {
    ("", "nodes", "get"),
    ("", "nodes", "patch"),
    ("", "nodes/status", "patch"),
    ("", "pods", "list"),
    ("", "pods/eviction", "create"),
    ("", "events", "create"),
}


MONITORING = REPO / "packaging" / "monitoring"
# The PodMonitor and the PrometheusRules, as a kustomize component of the DaemonSet's base (the overlay
# packaging/monitoring/kubernetes is the base with it).
MONITORING_COMPONENT = REPO / "packaging" / "kubernetes" / "components" / "monitoring"
PROMTOOL = shutil.which("promtool")
RULES = MONITORING / "prometheus" / "preemptd-alerts.yml"
PROMETHEUS_OWN = {"up"}


DASHBOARD = MONITORING / "grafana" / "preemptd-dashboard.json"


needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool is not installed (Debian: apt-get install prometheus; .ci/run does)"
)


def promtool(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run(
        [PROMTOOL, *args],
        input=stdin,
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=RULES.parent,
    )


def metric_names(expr: str) -> set[str]:
    """The series names a PromQL expression reads: preemptd_* names and Prometheus's own."""
    names = set(re.findall(r"\b(preemptd_[a-z0-9_]+)\b", expr))
    return names | {n for n in PROMETHEUS_OWN if re.search(rf"\b{n}\{{", expr)}


async def exported() -> tuple[str, set[str]]:
    """A running agent's exposition and the sample names its families can have."""
    async with running_agent(settings={"log_level": "error"}) as agent:
        connector = aiohttp.UnixConnector(path=str(agent.socket_path))
        async with (
            aiohttp.ClientSession(connector=connector) as session,
            session.get("http://agent/metrics") as response,
        ):
            text = await response.text()
    names: set[str] = set()
    for name, kind in re.findall(r"^# TYPE (\S+) (\S+)$", text, flags=re.M):
        suffixes = ("_bucket", "_sum", "_count") if kind == "histogram" else ("",)
        names.update(name + suffix for suffix in suffixes)
    return text, names


# Series Prometheus adds itself, not the agent.
