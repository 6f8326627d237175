"""The Kubernetes bridge on the fake API server: when each pod is evicted, and how failures (403, 409,
429 with Retry-After, a PodDisruptionBudget, an unreachable API, a rotated service-account token) are
retried and shown in status and metrics."""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lightkube", reason="the kubernetes extra is not installed")

from prometheus_client import CollectorRegistry, generate_latest
from structlog.testing import capture_logs

from agent.bridges.kubernetes.api import KubeApi
from agent.bridges.kubernetes.bridge import Collector, KubernetesBridge
from agent.bridges.kubernetes.config import KubernetesConfig
from agent.core.notice import EventType, Kind, Notice, parse_time, utcnow
from agent.core.reports import Report
from tests.actions_support import event, make_notice
from tests.deploy.support import BRIDGE_PERMISSIONS
from tests.k8s_fake import NODE, FakeKube, make_certificate


def make_bridge(kube: FakeKube, tmp_path: Path, **settings: Any) -> KubernetesBridge:
    settings.setdefault("retry_max_s", 2.0)
    config = KubernetesConfig(
        enabled=True, node=NODE, kubeconfig=str(kube.write_kubeconfig(tmp_path / "kubeconfig")), **settings
    )
    return KubernetesBridge(
        config, node=NODE, connect=lambda: KubeApi.connect(config, NODE), now=utcnow, proc=tmp_path / "proc"
    )


def termination(deadline_in: float = 120.0) -> Notice:
    return make_notice(drill=False, source="aws", deadline_in=deadline_in)


def participant_report(pod_name: str) -> Report:
    """A report from a training process inside pod ``pod_name`` (its host name is the pod's name)."""
    return Report(
        kind="checkpoint",
        phase="started",
        received_at=utcnow(),
        client={"name": "train.py", "host": pod_name, "participant": True, "job": "llm", "rank": 0},
    )


def metrics(bridge: KubernetesBridge) -> str:
    registry = CollectorRegistry()
    registry.register(Collector(bridge))
    return generate_latest(registry).decode()


async def test_a_pod_without_participants_goes_at_once_and_a_training_pod_waits_for_ready(
    kube: FakeKube, tmp_path: Path
) -> None:
    kube.add_pod("ml", "train-0", node=NODE, owner="Job", grace_s=30)
    kube.add_pod("web", "inference-7f-x", node=NODE, owner="ReplicaSet", grace_s=30)
    bridge = make_bridge(kube, tmp_path)
    bridge.on_report(participant_report("train-0"))
    notice = termination(deadline_in=300)
    await bridge.start()
    try:
        bridge.handle(event(EventType.NOTICE, notice))
        await kube.wait_for(lambda: ("web", "inference-7f-x") in kube.evicted)
        assert ("ml", "train-0") in kube.pods  # its training has not saved yet
        pods = bridge.status()["drains"][notice.id]["pods"]
        assert (True, "waiting") == (pods["ml/train-0"]["participant"], pods["ml/train-0"]["state"])
        bridge.handle(event(EventType.READY, notice, {"notice_id": notice.id, "reason": "all_participants"}))
        await kube.wait_for(lambda: ("ml", "train-0") in kube.evicted)
        await bridge.drain()
    finally:
        await bridge.stop(2)
    first_eviction = kube.calls("POST", r".*/eviction")[0]
    assert "/api/v1/namespaces/web/pods/inference-7f-x/eviction" == first_eviction.path
    # The node was cordoned before any pod was evicted, so no replacement lands on it.
    cordon = next(
        r for r in kube.calls("PATCH", rf"/api/v1/nodes/{NODE}") if r.body["spec"].get("unschedulable")
    )
    assert cordon.at < first_eviction.at
    drain = bridge.status()["drains"][notice.id]
    assert {"ml/train-0": "evicted", "web/inference-7f-x": "evicted"} == {
        key: pod["state"] for key, pod in drain["pods"].items()
    }
    assert "all_participants" == drain["ready"]


async def test_with_participants_setting_holds_every_pod_until_ready(kube: FakeKube, tmp_path: Path) -> None:
    kube.add_pod("web", "inference-7f-x", node=NODE, owner="ReplicaSet")
    bridge = make_bridge(kube, tmp_path, pods_without_participants="with_participants", event=False)
    notice = termination(deadline_in=300)
    await bridge.start()
    try:
        bridge.handle(event(EventType.NOTICE, notice))
        await kube.wait_for(lambda: bool(kube.calls("GET", r"/api/v1/pods")))
        await bridge.settled()
        assert [] == kube.evicted
        bridge.handle(event(EventType.READY, notice, {"notice_id": notice.id, "reason": "grace"}))
        await kube.wait_for(lambda: ("web", "inference-7f-x") in kube.evicted)
    finally:
        await bridge.stop(2)


@pytest.mark.slow
async def test_without_ready_a_training_pod_is_evicted_at_deadline_minus_grace_minus_margin(
    kube: FakeKube, tmp_path: Path
) -> None:
    kube.add_pod("ml", "train-0", node=NODE, owner="Job", grace_s=2)
    bridge = make_bridge(kube, tmp_path, drain_margin_s=1.0, event=False)
    bridge.on_report(participant_report("train-0"))
    notice = termination(deadline_in=5.0)
    assert notice.deadline is not None
    latest = notice.deadline - dt.timedelta(seconds=3)
    await bridge.start()
    try:
        bridge.handle(event(EventType.NOTICE, notice))
        await kube.wait_for(lambda: ("ml", "train-0") in kube.evicted)
        evicted_at = utcnow()
    finally:
        await bridge.stop(2)
    assert evicted_at >= latest
    pod = bridge.status()["drains"][notice.id]["pods"]["ml/train-0"]
    assert abs(parse_time(pod["evict_at"]) - latest) < dt.timedelta(milliseconds=2)
    assert "evicted" == pod["state"]


async def test_an_eviction_a_budget_blocks_is_retried_until_it_is_allowed(
    kube: FakeKube, tmp_path: Path
) -> None:
    kube.add_pod("ml", "train-0", node=NODE, owner="Job")
    kube.block_eviction("ml", "train-0")
    bridge = make_bridge(kube, tmp_path, eviction_retry_s=0.2, event=False)
    notice = termination(deadline_in=120)
    await bridge.start()
    try:
        bridge.handle(event(EventType.NOTICE, notice))
        await kube.wait_for(lambda: len(kube.calls("POST", r".*/eviction")) >= 3)
        assert "blocked_by_budget" == bridge.status()["drains"][notice.id]["pods"]["ml/train-0"]["state"]
        assert "preemptd_kubernetes_pods_pending_eviction 1.0" in metrics(bridge)
        kube.unblock_eviction("ml", "train-0")
        await bridge.drain()
    finally:
        await bridge.stop(2)
    assert [("ml", "train-0")] == kube.evicted
    assert [429, 429, 429] == [r.status for r in kube.calls("POST", r".*/eviction")][:3]
    assert (
        'preemptd_kubernetes_calls_total{outcome="throttled",resource="pods/eviction",verb="create"}'
        in metrics(bridge)
    )


@pytest.mark.slow
async def test_an_eviction_still_blocked_at_the_deadline_is_reported(kube: FakeKube, tmp_path: Path) -> None:
    kube.add_pod("ml", "train-0", node=NODE, owner="Job", grace_s=1)
    kube.block_eviction("ml", "train-0")
    bridge = make_bridge(kube, tmp_path, eviction_retry_s=0.3, event=False)
    notice = termination(deadline_in=2.5)
    await bridge.start()
    try:
        with capture_logs() as logs:
            bridge.handle(event(EventType.NOTICE, notice))
            await bridge.drain()
    finally:
        await bridge.stop(2)
    pod = bridge.status()["drains"][notice.id]["pods"]["ml/train-0"]
    assert "blocked" == pod["state"] and pod["attempts"] >= 2
    assert "disruption budget" in pod["last_error"]
    assert ("ml", "train-0") in kube.pods
    gave_up = [e for e in logs if e["event"] == "kubernetes_eviction_gave_up"]
    assert [("ml/train-0", "blocked")] == [(e["pod"], e["outcome"]) for e in gave_up]
    assert 'preemptd_kubernetes_evictions_total{outcome="blocked"} 1.0' in metrics(bridge)


async def test_a_429_on_the_node_is_retried_after_its_retry_after(kube: FakeKube, tmp_path: Path) -> None:
    kube.fail("PATCH", rf"/api/v1/nodes/{NODE}", 429, retry_after=1)
    bridge = make_bridge(kube, tmp_path, drain=False, condition=False, event=False)
    await bridge.start()
    try:
        bridge.handle(event(EventType.NOTICE, termination()))
        await kube.wait_for(lambda: kube.nodes[NODE]["spec"].get("unschedulable") is True)
    finally:
        await bridge.stop(2)
    throttled, accepted = kube.calls("PATCH", rf"/api/v1/nodes/{NODE}")
    assert (429, 200) == (throttled.status, accepted.status)
    assert accepted.at - throttled.at >= 0.85  # Retry-After: 1, less the jitter
    assert 1 == bridge.calls[("patch", "nodes", "throttled")]


async def test_a_403_names_the_verb_and_resource_and_the_rest_still_happens(
    kube: FakeKube, tmp_path: Path
) -> None:
    kube.fail(
        "PATCH",
        rf"/api/v1/nodes/{NODE}/status",
        403,
        times=100,
        message=f'nodes "{NODE}" is forbidden: User "system:serviceaccount:preemptd:preemptd" cannot patch '
        'resource "nodes/status" in API group "" at the cluster scope',
    )
    bridge = make_bridge(kube, tmp_path, drain=False)
    await bridge.start()
    try:
        with capture_logs() as logs:
            bridge.handle(event(EventType.NOTICE, termination()))
            await kube.wait_for(lambda: bool(kube.node_events(NODE)))
    finally:
        await bridge.stop(2)
    status = bridge.status()
    assert status["last_error"].startswith("patch nodes/status: forbidden (403)")
    assert "needs 'patch' on 'nodes/status'" in status["last_error"]
    assert status["errors"] >= 1
    assert kube.nodes[NODE]["spec"]["unschedulable"] is True  # taint and cordon do not wait for it
    failed = [e for e in logs if e["event"] == "kubernetes_call_failed"]
    assert failed and "forbidden" == failed[0]["failure"]
    assert (
        'preemptd_kubernetes_calls_total{outcome="forbidden",resource="nodes/status",verb="patch"}'
        in metrics(bridge)
    )


@pytest.mark.service
async def test_an_unreachable_api_is_shown_and_retried_until_it_answers(tmp_path: Path) -> None:
    async with FakeKube() as gone:
        port = gone.port
        bridge = make_bridge(gone, tmp_path, drain=False, event=False)
    # The fake has stopped: its port refuses connections.
    await bridge.start()
    try:
        bridge.handle(event(EventType.NOTICE, termination()))
        await bridge.settled()
        status = bridge.status()
        assert "unreachable: ConnectError" in status["last_error"]
        assert "acting" == status["state"]
        assert bridge.calls[("get", "nodes", "unreachable")] >= 1
        back = FakeKube()
        back.add_node(NODE)
        await back.start(port)
        try:
            await back.wait_for(lambda: back.nodes[NODE]["spec"].get("unschedulable") is True)
        finally:
            await back.stop()
    finally:
        await bridge.stop(2)


async def test_a_drill_is_left_alone_unless_drills_are_enabled(kube: FakeKube, tmp_path: Path) -> None:
    bridge = make_bridge(kube, tmp_path)
    await bridge.start()
    try:
        bridge.handle(event(EventType.NOTICE, make_notice(drill=True)))
        bridge.handle(
            event(EventType.NOTICE, make_notice(drill=False, source="aws", severity=None, deadline_in=60))
        )
        bridge.handle(
            event(
                EventType.NOTICE,
                make_notice(drill=False, source="nvml", deadline_in=None, kind=Kind.GPU_FAULT),
            )
        )
        await bridge.drain()
    finally:
        await bridge.stop(2)
    assert 1 == len(bridge.status()["notices"])


# --- in-cluster: the service account ------------------------------------------------------------------------


@pytest.mark.service
async def test_in_cluster_the_service_account_token_is_reread_when_it_rotates(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cert, key = make_certificate(tmp_path)
    account = tmp_path / "serviceaccount"
    account.mkdir()
    (account / "ca.crt").write_bytes(cert.read_bytes())
    (account / "namespace").write_text("preemptd")
    (account / "token").write_text("token-one")
    async with FakeKube(tls=(cert, key), tokens={"token-one"}) as kube:
        kube.add_node(NODE)
        monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
        monkeypatch.setenv("KUBERNETES_SERVICE_PORT", str(kube.port))
        config = KubernetesConfig(enabled=True, node=NODE, drain=False, condition=False, event=False)
        bridge = KubernetesBridge(
            config,
            node=NODE,
            connect=lambda: KubeApi.connect(config, NODE, service_account=account),
            now=utcnow,
        )
        notice = termination()
        await bridge.start()
        try:
            bridge.handle(event(EventType.NOTICE, notice))
            await bridge.drain()
            # The kubelet rotates the projected token; the old one stops working.
            (account / "token").write_text("token-two")
            kube.tokens = {"token-two"}
            bridge.handle(event(EventType.CLEARED, notice))
            await bridge.drain()
        finally:
            await bridge.stop(2)
        assert "unschedulable" not in kube.nodes[NODE]["spec"]
        seen = [(r.authorization, r.status) for r in kube.requests]
        assert ("Bearer token-one", 200) in seen
        assert ("Bearer token-one", 401) in seen
        assert ("Bearer token-two", 200) in seen
        assert kube.url.startswith("https://")
        assert 0 == bridge.errors


async def test_a_kubeconfig_that_is_missing_is_a_config_failure(tmp_path: Path) -> None:
    config = KubernetesConfig(enabled=True, node=NODE, kubeconfig=str(tmp_path / "nope"), drain=False)
    bridge = KubernetesBridge(config, node=NODE, connect=lambda: KubeApi.connect(config, NODE), now=utcnow)
    await bridge.start()
    try:
        bridge.handle(event(EventType.NOTICE, termination()))
        await bridge.settled()
    finally:
        await bridge.stop(2)
    assert bridge.status()["last_error"].startswith("load kubeconfig: config")
    assert str(tmp_path / "nope") in bridge.status()["last_error"]


async def test_a_full_notice_cycle_uses_exactly_the_permissions_rbac_yaml_grants(
    kube: FakeKube, tmp_path: Path
) -> None:
    kube.add_pod("ml", "train-0", node=NODE, owner="Job")
    bridge = make_bridge(kube, tmp_path)
    notice = termination()
    await bridge.start()
    try:
        bridge.handle(event(EventType.NOTICE, notice))
        bridge.handle(event(EventType.READY, notice, {"notice_id": notice.id, "reason": "all_participants"}))
        await bridge.drain()
        bridge.handle(event(EventType.CLEARED, notice))
        await bridge.drain()
    finally:
        await bridge.stop(2)
    assert 0 == bridge.errors
    used = {("", resource, verb) for (verb, resource, outcome) in bridge.calls if outcome == "ok"}
    assert BRIDGE_PERMISSIONS == used


async def test_at_start_what_a_previous_run_left_for_a_notice_now_gone_is_removed(
    kube: FakeKube, tmp_path: Path
) -> None:
    admin = {"key": "dedicated", "value": "training", "effect": "NoSchedule"}
    node = kube.nodes[NODE]
    node["spec"].update(
        unschedulable=True,
        taints=[{"key": "preemptd.io/notice", "value": "termination", "effect": "NoSchedule"}, admin],
    )
    node["metadata"]["annotations"]["preemptd.io/cordoned-for"] = "aws-gone"
    node["status"]["conditions"].append(
        {"type": "PreemptdNotice", "status": "True", "reason": "TerminationNotice"}
    )
    bridge = make_bridge(kube, tmp_path)
    await bridge.start()
    try:
        await bridge.drain()
    finally:
        await bridge.stop(2)
    assert [admin] == kube.nodes[NODE]["spec"]["taints"]
    assert "unschedulable" not in kube.nodes[NODE]["spec"]
    assert ["Ready"] == [c["type"] for c in kube.nodes[NODE]["status"]["conditions"]]
    assert "preemptd.io/cordoned-for" not in kube.nodes[NODE]["metadata"]["annotations"]


async def test_at_start_a_notice_still_active_is_acted_on(kube: FakeKube, tmp_path: Path) -> None:
    notice = termination()
    settings = {"kubeconfig": str(kube.write_kubeconfig(tmp_path / "kubeconfig")), "drain": False}
    config = KubernetesConfig(enabled=True, node=NODE, **settings)
    bridge = KubernetesBridge(
        config, node=NODE, connect=lambda: KubeApi.connect(config, NODE), now=utcnow, active=lambda: [notice]
    )
    await bridge.start()
    try:
        await bridge.drain()
    finally:
        await bridge.stop(2)
    assert [notice.id] == bridge.status()["notices"]
    assert kube.nodes[NODE]["spec"]["unschedulable"] is True
