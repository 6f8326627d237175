"""The Kubernetes bridge's pure decisions (taints, pods to drain, eviction times, participants' pods), its
configuration errors, and the fake API server's patch semantics that the other tests rely on."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from agent.bridges.kubernetes import node_name, plan
from agent.bridges.kubernetes.config import KubernetesConfig
from agent.core.errors import ConfigError
from agent.core.notice import Kind
from tests.actions_support import make_notice
from tests.k8s_fake import PatchError, json_merge_patch, strategic_merge_patch

ADMIN = {"key": "dedicated", "value": "training", "effect": "NoSchedule"}
OURS = {"key": "preemptd.io/notice", "value": "termination", "effect": "NoSchedule"}


def test_our_taint_goes_first_and_an_administrators_stays() -> None:
    assert [OURS, ADMIN] == plan.with_taint([ADMIN], OURS)


def test_a_taint_already_there_is_no_change() -> None:
    assert plan.with_taint([OURS, ADMIN], OURS) is None


def test_a_taint_of_the_same_key_and_effect_is_overwritten_in_place() -> None:
    maintenance = {**OURS, "value": "maintenance"}
    assert [ADMIN, maintenance] == plan.with_taint([ADMIN, OURS], maintenance)


def test_removing_our_taint_keeps_the_others_even_of_the_same_key_with_another_effect() -> None:
    other_effect = {**OURS, "effect": "NoExecute"}
    assert [ADMIN, other_effect] == plan.without_taints(
        [ADMIN, OURS, other_effect], {OURS["key"]}, "NoSchedule"
    )
    assert plan.without_taints([ADMIN], {OURS["key"]}, "NoSchedule") is None


def test_aws_node_termination_handler_names_per_kind() -> None:
    config = KubernetesConfig(taint_names="aws-node-termination-handler")
    assert "aws-node-termination-handler/spot-itn" == plan.taint_for(config, make_notice(drill=False))["key"]
    gpu = make_notice(Kind.GPU_FAULT, drill=False)
    assert "preemptd.io/notice" == plan.taint_for(config, gpu)["key"]  # a kind it has no name for
    assert "aws-node-termination-handler/scheduled-maintenance" in plan.taint_keys(config)


def test_a_drills_taint_value_says_so() -> None:
    assert "termination-drill" == plan.taint_for(KubernetesConfig(), make_notice(drill=True))["value"]


def pod(**meta: Any) -> dict[str, Any]:
    return {"metadata": {"namespace": "ml", "name": "p", **meta}, "spec": {}, "status": {"phase": "Running"}}


@pytest.mark.parametrize(
    ("doc", "expected"),
    [
        (pod(ownerReferences=[{"kind": "DaemonSet", "controller": True, "name": "x"}]), "daemonset"),
        (pod(annotations={"kubernetes.io/config.mirror": "abc"}), "mirror"),
        (pod(ownerReferences=[{"kind": "DaemonSet", "controller": False, "name": "x"}]), None),
        (pod(ownerReferences=[{"kind": "Job", "controller": True, "name": "x"}]), None),
        (pod(), None),
    ],
)
def test_pods_a_drain_leaves_alone(doc: dict[str, Any], expected: str | None) -> None:
    assert expected == plan.skip_reason(doc)


def test_the_latest_eviction_leaves_the_pods_grace_and_the_margin() -> None:
    notice = make_notice(deadline_in=120)
    assert notice.deadline is not None
    assert notice.deadline - timedelta(seconds=40) == plan.latest_eviction(notice.deadline, 30, 10)
    assert plan.latest_eviction(None, 30, 10) is None
    assert 30.0 == plan.grace_of(pod())  # the API's default when the spec does not say


def test_a_participants_pod_is_found_by_the_uid_in_its_cgroup(tmp_path: Path) -> None:
    uid = "0f1e2d3c-4b5a-6978-8695-a4b3c2d1e0f9"
    (tmp_path / "4242").mkdir()
    (tmp_path / "4242" / "cgroup").write_text(
        f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{uid.replace('-', '_')}.slice/"
        "cri-containerd-0123.scope\n"
    )
    pods = [pod(name="train-0", uid=uid), pod(name="other", uid="ffffffff-4b5a-6978-8695-a4b3c2d1e0f9")]
    participants = [{"pid": 4242, "host": "node-hostname"}]
    assert {"ml/train-0"} == plan.pods_with_participants(pods, participants, tmp_path)


def test_a_participants_pod_is_found_by_its_host_name_unless_on_the_host_network(tmp_path: Path) -> None:
    on_host = pod(name="train-1")
    on_host["spec"]["hostNetwork"] = True
    pods = [pod(name="train-0"), on_host]
    participants = [{"pid": 99999999, "host": "train-0"}, {"pid": None, "host": "train-1"}]
    assert {"ml/train-0"} == plan.pods_with_participants(pods, participants, tmp_path)


def test_the_event_names_the_node_as_kubectl_describe_looks_it_up() -> None:
    notice = make_notice(drill=False, source="aws", deadline_in=90)
    node = {"metadata": {"name": "gpu-1", "uid": "u-1"}}
    doc = plan.event_for(
        KubernetesConfig(),
        node,
        reason="TerminationNotice",
        message="m",
        warning=True,
        now=notice.detected_at,
        host="h",
    )
    assert {"apiVersion": "v1", "kind": "Node", "name": "gpu-1", "uid": "u-1"} == doc["involvedObject"]
    assert ("default", "Warning", "preemptd") == (
        doc["metadata"]["namespace"],
        doc["type"],
        doc["source"]["component"],
    )


def test_the_message_has_the_deadline() -> None:
    notice = make_notice(drill=False, source="aws", deadline_in=90)
    assert notice.deadline is not None
    text = plan.describe(notice, notice.detected_at)
    assert "termination notice from aws" in text and "(in 90 s)" in text
    assert notice.deadline.strftime("%Y-%m-%dT%H:%M:%S") in text


@pytest.mark.parametrize(
    ("settings", "key"),
    [
        ({"taint_key": "not a key!"}, "actions.kubernetes.taint_key"),
        ({"node": "Upper_Case"}, "actions.kubernetes.node"),
        ({"condition_type": ""}, "actions.kubernetes.condition_type"),
        ({"eviction_retry_s": 0}, "actions.kubernetes.eviction_retry_s"),
        ({"drain_margin_s": -1}, "actions.kubernetes.drain_margin_s"),
    ],
)
def test_a_bad_setting_names_its_key(settings: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        KubernetesConfig(**settings)


def test_the_node_comes_from_the_config_else_node_name() -> None:
    assert "a" == node_name(KubernetesConfig(node="a"), {"NODE_NAME": "b"})
    assert "b" == node_name(KubernetesConfig(), {"NODE_NAME": "b"})
    with pytest.raises(ConfigError, match="NODE_NAME through the downward API"):
        node_name(KubernetesConfig(), {})
    with pytest.raises(ConfigError, match="is not a node name"):
        node_name(KubernetesConfig(), {"NODE_NAME": "Not/A/Node"})


# --- the fake's patch semantics (as the API server's) ----------------------------------------------------


def test_strategic_merge_replaces_taints_whole_and_merges_conditions_by_type() -> None:
    node = {
        "spec": {"taints": [ADMIN]},
        "status": {"conditions": [{"type": "Ready", "status": "True"}, {"type": "X", "status": "True"}]},
    }
    patched = strategic_merge_patch(
        node,
        {
            "spec": {"taints": [OURS]},
            "status": {"conditions": [{"type": "X", "status": "False"}, {"type": "Y"}]},
        },
    )
    assert [OURS] == patched["spec"]["taints"]
    assert [
        {"type": "Ready", "status": "True"},
        {"type": "X", "status": "False"},
        {"type": "Y"},
    ] == patched["status"]["conditions"]


def test_strategic_merge_deletes_a_condition_by_directive_and_a_key_by_null() -> None:
    node = {"spec": {"unschedulable": True}, "status": {"conditions": [{"type": "Ready"}, {"type": "X"}]}}
    patched = strategic_merge_patch(
        node, {"spec": {"unschedulable": None}, "status": {"conditions": [{"type": "X", "$patch": "delete"}]}}
    )
    assert ({}, [{"type": "Ready"}]) == (patched["spec"], patched["status"]["conditions"])


def test_a_merge_list_element_without_its_key_is_invalid() -> None:
    with pytest.raises(PatchError, match="merge key 'type'"):
        strategic_merge_patch(
            {"status": {"conditions": []}}, {"status": {"conditions": [{"status": "True"}]}}
        )


def test_json_merge_replaces_lists_and_removes_null_keys() -> None:
    node = {"status": {"conditions": [{"type": "Ready"}]}, "metadata": {"annotations": {"a": "1", "b": "2"}}}
    patched = json_merge_patch(
        node, {"status": {"conditions": [{"type": "X"}]}, "metadata": {"annotations": {"a": None}}}
    )
    assert [{"type": "X"}] == patched["status"]["conditions"]
    assert {"b": "2"} == patched["metadata"]["annotations"]


@pytest.mark.service
async def test_the_fake_refuses_a_stale_resource_version_and_keeps_status_and_spec_apart() -> None:
    import aiohttp

    from tests.k8s_fake import MERGE, STRATEGIC, FakeKube

    async with FakeKube() as kube, aiohttp.ClientSession(kube.url) as http:
        node = kube.add_node("n1")
        version = node["metadata"]["resourceVersion"]

        async def patch(path: str, body: dict[str, Any], kind: str = STRATEGIC) -> tuple[int, dict[str, Any]]:
            async with http.patch(path, json=body, headers={"Content-Type": kind}) as response:
                return response.status, await response.json()

        status, doc = await patch(
            "/api/v1/nodes/n1", {"spec": {"unschedulable": True}, "metadata": {"resourceVersion": version}}
        )
        assert (200, True) == (status, doc["spec"]["unschedulable"])
        assert version != doc["metadata"]["resourceVersion"]
        status, doc = await patch(
            "/api/v1/nodes/n1", {"spec": {"unschedulable": None}, "metadata": {"resourceVersion": version}}
        )
        assert (409, "Conflict") == (status, doc["reason"])
        # The main resource ignores status; the status subresource ignores spec.
        status, doc = await patch("/api/v1/nodes/n1", {"status": {"conditions": [{"type": "X"}]}}, MERGE)
        assert ["Ready"] == [c["type"] for c in doc["status"]["conditions"]]
        status, doc = await patch(
            "/api/v1/nodes/n1/status",
            {"spec": {"unschedulable": None}, "status": {"conditions": [{"type": "X", "status": "True"}]}},
        )
        assert (True, ["Ready", "X"]) == (
            doc["spec"]["unschedulable"],
            [c["type"] for c in doc["status"]["conditions"]],
        )
        status, doc = await patch("/api/v1/nodes/n1", {"spec": {"taints": [ADMIN, ADMIN]}})
        assert (422, "Invalid") == (status, doc["reason"])
