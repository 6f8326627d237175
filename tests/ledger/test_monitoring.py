"""The fleet view of the ledger in packaging/monitoring/: the cost-of-preemption recording rules pass `promtool
check rules` and their unit tests, every metric they and the dashboard's "Cost of preemption" row read is one
a running agent exports, and the row reads only series that the agent or those rules produce."""

from __future__ import annotations

import json
import re

import pytest

from tests.deploy.support import (
    DASHBOARD,
    MONITORING,
    MONITORING_COMPONENT,
    exported,
    metric_names,
    needs_promtool,
    promtool,
)

LEDGER_RULES = MONITORING / "prometheus" / "preemptd-ledger-rules.yml"
LEDGER_RULE_TESTS = MONITORING / "prometheus" / "preemptd-ledger-rules.test.yml"


def ledger_rules() -> list[dict[str, str]]:
    yaml = pytest.importorskip("yaml")
    doc = yaml.safe_load(LEDGER_RULES.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def cost_row_exprs() -> list[str]:
    """The queries of the panels under the "Cost of preemption" row (up to the next row)."""
    panels = json.loads(DASHBOARD.read_text())["panels"]
    start = next(i for i, p in enumerate(panels) if p["type"] == "row" and p["title"] == "Cost of preemption")
    exprs: list[str] = []
    for panel in panels[start + 1 :]:
        if panel["type"] == "row":
            break
        exprs += [t["expr"] for t in panel["targets"]]
    return exprs


@needs_promtool
def test_ledger_rules_pass_promtool_check() -> None:
    done = promtool("check", "rules", str(LEDGER_RULES))
    assert (0, "SUCCESS: 6 rules found") == (done.returncode, done.stdout.strip().splitlines()[-1].strip())


@needs_promtool
def test_ledger_rules_record_what_their_unit_tests_expect() -> None:
    done = promtool("test", "rules", str(LEDGER_RULE_TESTS))
    assert 0 == done.returncode, done.stdout + done.stderr


async def test_ledger_rules_and_the_cost_row_read_only_what_the_agent_exports() -> None:
    """Every preemptd_* series the rules and the row read is in a running agent's exposition; the recorded
    preemptd:* series the row reads are ones the rules record."""
    _, names = await exported()
    rules = ledger_rules()
    recorded = {rule["record"] for rule in rules}
    exprs = [rule["expr"] for rule in rules] + cost_row_exprs()
    wanted = {name for expr in exprs for name in metric_names(expr)}
    used_records = {name for expr in cost_row_exprs() for name in re.findall(r"\bpreemptd:[a-z0-9_:]+", expr)}
    assert (set(), set(), True) == (wanted - names, used_records - recorded, len(wanted) >= 5)


def test_the_ledger_prometheusrule_says_what_the_rules_file_says() -> None:
    yaml = pytest.importorskip("yaml")
    rule = yaml.safe_load((MONITORING_COMPONENT / "prometheusrule-ledger.yaml").read_text())
    kustomization = yaml.safe_load((MONITORING_COMPONENT / "kustomization.yaml").read_text())
    assert ("PrometheusRule", yaml.safe_load(LEDGER_RULES.read_text())["groups"], True) == (
        rule["kind"],
        rule["spec"]["groups"],
        "prometheusrule-ledger.yaml" in kustomization["resources"],
    )
