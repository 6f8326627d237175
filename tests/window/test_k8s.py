"""The window on a real agent with ``[actions.kubernetes]`` against the fake API server (tests/k8s_fake.py): a
participant's pod asks for 15 s of grace (as GKE spot gives at node shutdown), its checkpoints take 20 s, so the
pod's grace binds and the window is too short; a pod without a participant on the node does not count."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

pytest.importorskip("lightkube", reason="the kubernetes extra is not installed")

from agent.client.reporting import Reporter, client_info
from tests.k8s_fake import NODE, FakeKube
from tests.support import running_agent
from tests.window.support import window_until

pytestmark = pytest.mark.timeout(60)


async def test_the_training_pods_grace_binds(kube: FakeKube, base: Path) -> None:
    kube.add_pod("ml", "train-0", node=NODE, owner="Job", grace_s=15)
    kube.add_pod("web", "inference-6d8f-x", node=NODE, owner="ReplicaSet", grace_s=5)  # no participant in it
    settings = {
        "actions.kubernetes.enabled": True,
        "actions.kubernetes.node": NODE,
        "actions.kubernetes.kubeconfig": str(kube.write_kubeconfig(base / "kubeconfig")),
    }
    sock = base / "a.sock"
    async with running_agent(base, settings):
        before = await window_until(sock, lambda doc: doc["state"] == "ok")
        # The participant reports from pod train-0 (its host name), with a 20 s periodic checkpoint.
        reporter = Reporter(sock, client={**client_info(name="train.py"), "host": "train-0"})
        try:
            reporter.register()
            reporter.checkpoint("finished", 1, duration_s=20.0)
            assert await asyncio.to_thread(reporter.flush, 10)
            body = await window_until(sock, lambda doc: doc["kinds"]["termination"]["binding"] == "pod_grace")
        finally:
            reporter.close()
    assert [] == before["window"]["limits"]  # no participant yet: no training pod to ask
    termination = body["window"]["kinds"]["termination"]
    assert (None, 15.0, "pod_grace", 20.0, True) == (
        termination["cloud"]["seconds"],
        termination["effective_s"],
        termination["binding"],
        termination["predicted_flush_s"],
        termination["window_too_short"],
    )
    [limit] = termination["limits"]
    assert "pod ml/train-0: terminationGracePeriodSeconds" == limit["source"]
    assert "terminationGracePeriodSeconds" in termination["lengthen"]
    assert "GKE spot" in termination["lengthen"]
    assert 1 <= len(kube.calls("GET", r"/api/v1/pods"))
