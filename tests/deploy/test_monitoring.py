"""The Grafana dashboard and the Prometheus alert rules in packaging/monitoring/, and the Kubernetes
monitoring overlay there (the base with packaging/kubernetes/components/monitoring): the rules pass
`promtool check rules` and their unit tests, every metric the dashboard and the rules query is one the agent
really exports (read from a running agent's /metrics, which `promtool check metrics` also lints), the
PrometheusRule says what the rules file says, and the overlay builds with the metrics port the PodMonitor
scrapes."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from agent.config import load_config
from agent.service.metrics import parse_listen
from tests.deploy.support import (
    DASHBOARD,
    MONITORING,
    MONITORING_COMPONENT,
    PROMETHEUS_OWN,
    RULES,
    exported,
    metric_names,
    needs_promtool,
    promtool,
)

RULE_TESTS = MONITORING / "prometheus" / "preemptd-alerts.test.yml"
KUBECTL = shutil.which("kubectl")


def dashboard_exprs() -> list[str]:
    doc = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in doc["panels"] for t in p.get("targets", [])]
    exprs += [v["query"]["query"] for v in doc["templating"]["list"] if isinstance(v.get("query"), dict)]
    return exprs


def rule_exprs() -> list[str]:
    yaml = pytest.importorskip("yaml")
    doc = yaml.safe_load(RULES.read_text())
    return [rule["expr"] for group in doc["groups"] for rule in group["rules"]]


@needs_promtool
def test_alert_rules_pass_promtool_check() -> None:
    done = promtool("check", "rules", str(RULES))
    assert (0, "SUCCESS: 8 rules found") == (done.returncode, done.stdout.strip().splitlines()[-1].strip())


@needs_promtool
def test_alert_rules_fire_as_their_unit_tests_expect() -> None:
    done = promtool("test", "rules", str(RULE_TESTS))
    assert 0 == done.returncode, done.stdout + done.stderr


@needs_promtool
async def test_the_agents_exposition_passes_promtool_check_metrics() -> None:
    text, _ = await exported()
    done = promtool("check", "metrics", stdin=text)
    assert (0, "") == (done.returncode, done.stdout + done.stderr)


async def test_dashboard_and_rules_query_only_what_the_agent_exports() -> None:
    _, names = await exported()
    wanted = {name for expr in dashboard_exprs() + rule_exprs() for name in metric_names(expr)}
    assert (set(), True) == (wanted - names - PROMETHEUS_OWN, len(wanted) >= 10)


def test_the_dashboard_is_importable_grafana_json() -> None:
    doc = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in doc["panels"]]
    assert ("preemptd-overview", len(ids), True) == (
        doc["uid"],
        len(set(ids)),
        all(t["datasource"]["uid"] == "${datasource}" for p in doc["panels"] for t in p["targets"]),
    )


def test_the_prometheusrule_says_what_the_rules_file_says() -> None:
    yaml = pytest.importorskip("yaml")
    rule = yaml.safe_load((MONITORING_COMPONENT / "prometheusrule.yaml").read_text())
    assert ("PrometheusRule", yaml.safe_load(RULES.read_text())["groups"]) == (
        rule["kind"],
        rule["spec"]["groups"],
    )


@pytest.mark.service
@pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed (its kustomize builds the overlay)")
def test_the_monitoring_overlay_opens_the_port_the_podmonitor_scrapes() -> None:
    yaml = pytest.importorskip("yaml")
    assert KUBECTL is not None
    built = subprocess.run(
        [KUBECTL, "kustomize", str(MONITORING / "kubernetes")],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    docs = {d["kind"]: d for d in yaml.safe_load_all(built) if d}
    [container] = docs["DaemonSet"]["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    [endpoint] = docs["PodMonitor"]["spec"]["podMetricsEndpoints"]
    listen = load_config(
        path=None, env={"PREEMPTD_METRICS__LISTEN": env["PREEMPTD_METRICS__LISTEN"]}
    ).metrics.listen
    # The node's own address (a host-network pod's IP), which Kubernetes puts in for $(POD_IP).
    pod_ip = next(e for e in container["env"] if e["name"] == "POD_IP")
    assert (("$(POD_IP)", ports[endpoint["port"]]), "/run/preemptd/preemptd.sock", "status.podIP") == (
        parse_listen(listen),
        env["PREEMPTD_SOCKET"],
        pod_ip["valueFrom"]["fieldRef"]["fieldPath"],
    )
