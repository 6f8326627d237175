"""Static checks of packaging/ and the operator guide: scripts parse, manifests and configs load, every
configuration key is documented. The package builds themselves run in packaging/ci-check.sh."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import typing
from pathlib import Path
from typing import Any

import pytest

from agent.config import Config, load_config
from agent.service.daemon import Agent, build_components
from tests.deploy.support import BRIDGE_PERMISSIONS

REPO = Path(__file__).resolve().parents[2]
PACKAGING = REPO / "packaging"
GUIDE = REPO / "docs" / "operator-guide.md"


def config_keys(cls: type[Any] = Config, prefix: str = "") -> list[str]:
    """Every configuration key as it is written in the guide: dotted, or bare inside ``[[arrays]]``."""
    keys: list[str] = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        args = typing.get_args(hint)
        if dataclasses.is_dataclass(hint):
            keys += config_keys(hint, f"{prefix}{f.name}.")  # type: ignore[arg-type]
        elif args and dataclasses.is_dataclass(args[0]):
            keys.append(f"{prefix}{f.name}")
            keys += [f"{f.name}[].{k}" for k in config_keys(args[0])]  # type: ignore[arg-type]
        elif f.name != "config_file" and not f.metadata.get("internal"):  # loader bookkeeping, not keys
            keys.append(f"{prefix}{f.name}")
    return keys


def test_every_configuration_key_is_in_the_operator_guide() -> None:
    guide = GUIDE.read_text()
    missing = []
    for key in config_keys():
        name = key.split("[].")[-1]
        spelled = (f"`{name}`", f"`{key}`", f"`[[{key}]]`", f"`[{key}]`")
        if not any(s in guide for s in spelled):
            missing.append(key)
    assert [] == missing


def toml_blocks(text: str) -> list[str]:
    return re.findall(r"```toml\n(.*?)```", text, flags=re.DOTALL)


def test_the_guides_example_configuration_loads_and_builds(tmp_path: Path) -> None:
    [example] = toml_blocks(GUIDE.read_text())
    path = tmp_path / "config.toml"
    path.write_text(example)
    config = load_config(path, env={})
    assert ["torchrun", "lightning-jobs", "faulty-gpu"] == [rule.name for rule in config.actions.signals]
    [actions] = [c for c in build_components(config) if c.name == "actions"]
    actions.setup(Agent(config))
    assert 1 == len(actions.reactors.by_name()["hooks"].hooks)  # type: ignore[attr-defined]


def test_the_packaged_default_configuration_loads() -> None:
    config = load_config(PACKAGING / "config.toml", env={})
    assert config.actions == Config().actions


def test_the_packaged_configuration_prints_with_the_ram_tier_on(tmp_path: Path) -> None:
    """``preemptd run --print-config`` with the shipped file, as the packaged unit starts the agent: the RAM
    tier is on (the unit grants what it needs: tests/ramtier/test_unit.py), every other key at its default."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREEMPTD_")}
    done = subprocess.run(
        [sys.executable, "-m", "agent", "run", "--config", str(PACKAGING / "config.toml"), "--print-config"],
        capture_output=True, text=True, timeout=60, check=False, cwd=tmp_path, env={**env, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert 0 == done.returncode, done.stderr
    shown = json.loads(done.stdout)["ram_tier"]
    assert {"enabled": True, "path": "/dev/shm/preemptd", "cap_bytes": 0, "cap_fraction": 0.25} == {
        key: shown[key] for key in ("enabled", "path", "cap_bytes", "cap_fraction")
    }


@pytest.mark.parametrize(
    "script",
    ["debian/build.sh", "ci-check.sh", "rpm/build.sh", "debian/postinst", "debian/prerm", "debian/postrm"],
)
def test_packaging_scripts_parse_and_are_executable(script: str) -> None:
    path = PACKAGING / script
    shell = "sh" if path.parent.name == "debian" and path.suffix == "" else "bash"
    assert 0 == subprocess.run([shell, "-n", str(path)], check=False).returncode
    assert os.access(path, os.X_OK)


def test_maintainer_scripts_never_fail_without_a_running_systemd() -> None:
    """In a chroot or an image build, systemctl calls are guarded by /run/systemd/system."""
    for name in ("postinst", "prerm", "postrm"):
        text = (PACKAGING / "debian" / name).read_text()
        for line in text.splitlines():
            if re.search(r"\b(systemctl|deb-systemd-invoke)\b", line) and not line.lstrip().startswith("#"):
                assert "|| true" in line, f"{name}: {line.strip()}"


def load_yaml(name: str) -> list[dict[str, Any]]:
    yaml = pytest.importorskip("yaml")
    return [doc for doc in yaml.safe_load_all((PACKAGING / "kubernetes" / name).read_text()) if doc]


def test_the_daemonset_shares_the_socket_directory_and_reaches_the_host() -> None:
    [ds] = load_yaml("daemonset.yaml")
    spec = ds["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    [container] = spec["containers"]
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert ("DaemonSet", True, True) == (ds["kind"], spec["hostNetwork"], spec["hostPID"])
    assert "/run/preemptd" == volumes[mounts["/run/preemptd"]]["hostPath"]["path"]
    assert {"operator": "Exists"} in spec["tolerations"]  # GPU, spot, drained: every taint
    assert {"NVIDIA_VISIBLE_DEVICES": "all"}.items() <= {
        e["name"]: e.get("value") for e in container["env"]
    }.items()
    assert "nvidia.com/gpu" not in str(container.get("resources", {}))  # monitors all GPUs, takes none


def test_the_kubernetes_configmap_is_a_valid_configuration() -> None:
    config = load_config(PACKAGING / "kubernetes" / "config.toml", env={})
    assert 0o666 == config.socket_mode
    from agent.bridges.kubernetes import TABLE, KubernetesConfig

    assert config.table(TABLE, KubernetesConfig).enabled is True  # the node termination handler


def _mounted(spec: dict[str, Any], container: dict[str, Any], path: str) -> str:
    """The node directory a pod's container sees at ``path`` (its hostPath volume's path)."""
    volumes = {v["name"]: v for v in spec["volumes"]}
    [name] = [m["name"] for m in container["volumeMounts"] if m["mountPath"] == path]
    return str(volumes[name]["hostPath"]["path"])


def test_the_ram_tier_is_one_node_directory_at_the_agents_path_in_the_agent_and_the_training_pod(
    tmp_path: Path,
) -> None:
    """Clients use the path the agent names: the agent's pod and a training pod must see the same node
    directory there; the agent's container holds what serving other users' jobs and the drain need."""
    from agent.ramtier import RamTierConfig

    tier = load_config(PACKAGING / "kubernetes" / "config.toml", env={}).table("ram_tier", RamTierConfig)
    [ds] = load_yaml("daemonset.yaml")
    [agent] = ds["spec"]["template"]["spec"]["containers"]
    [pod] = load_yaml("training-pod-example.yaml")
    [train] = pod["spec"]["containers"]
    assert tier.enabled and str(tier.path).startswith("/dev/shm/")
    assert str(tier.path) == _mounted(ds["spec"]["template"]["spec"], agent, str(tier.path))
    assert str(tier.path) == _mounted(pod["spec"], train, str(tier.path))
    added = set(agent["securityContext"]["capabilities"]["add"])
    assert {"CHOWN", "DAC_OVERRIDE", "SETUID", "SETGID", "KILL"} == added


def test_the_kustomization_lists_every_manifest_and_generates_the_configmap() -> None:
    [kustomization] = load_yaml("kustomization.yaml")
    manifests = {p.name for p in (PACKAGING / "kubernetes").glob("*.yaml")} - {"kustomization.yaml"}
    manifests.discard("training-pod-example.yaml")  # applied to training namespaces, not with the agent
    assert manifests == set(kustomization["resources"])
    assert "rbac.yaml" in manifests
    [generated] = kustomization["configMapGenerator"]
    assert ("preemptd-config", ["config.toml"]) == (generated["name"], generated["files"])


def test_the_cluster_role_grants_the_bridge_its_calls_and_nothing_more() -> None:
    docs = {doc["kind"]: doc for doc in load_yaml("rbac.yaml")}
    granted = {
        (group, resource, verb)
        for rule in docs["ClusterRole"]["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
    assert BRIDGE_PERMISSIONS == granted
    assert not any(
        "resourceNames" in rule or "nonResourceURLs" in rule for rule in docs["ClusterRole"]["rules"]
    )
    binding = docs["ClusterRoleBinding"]
    assert ("ClusterRole", docs["ClusterRole"]["metadata"]["name"]) == (
        binding["roleRef"]["kind"],
        binding["roleRef"]["name"],
    )
    account = docs["ServiceAccount"]["metadata"]
    assert [
        {"kind": "ServiceAccount", "name": account["name"], "namespace": account["namespace"]}
    ] == binding["subjects"]


def test_the_daemonset_runs_as_the_bridges_service_account_and_knows_its_node() -> None:
    [ds] = load_yaml("daemonset.yaml")
    [account] = [doc for doc in load_yaml("rbac.yaml") if doc["kind"] == "ServiceAccount"]
    spec = ds["spec"]["template"]["spec"]
    assert account["metadata"]["name"] == spec["serviceAccountName"]
    assert account["metadata"]["namespace"] == ds["metadata"]["namespace"]
    assert spec["automountServiceAccountToken"] is True
    [container] = spec["containers"]
    env = {e["name"]: e for e in container["env"]}
    assert {"fieldRef": {"fieldPath": "spec.nodeName"}} == env["NODE_NAME"]["valueFrom"]
    # A restarted agent comes back to the node it tainted (it tolerates every taint, its own included).
    assert {"operator": "Exists"} in spec["tolerations"]


def test_the_image_installs_the_kubernetes_extra() -> None:
    text = (PACKAGING / "kubernetes" / "Dockerfile").read_text()
    assert '"/src[kubernetes]"' in text


def test_the_rpm_spec_parses() -> None:
    if shutil.which("rpmspec") is None:
        pytest.skip("rpmspec is not installed (packaging/ci-check.sh installs rpm)")
    done = subprocess.run(
        ["rpmspec", "-q", "--qf", "%{NAME} %{VERSION}\n", str(PACKAGING / "rpm" / "preemptd.spec")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert (0, "preemptd") == (done.returncode, done.stdout.split()[0] if done.stdout else done.stderr)
