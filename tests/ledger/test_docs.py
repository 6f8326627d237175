"""Every field `preemptd report --json` prints is documented in docs/ledger.md, and nothing documented is
missing from the output (the report with prices and without)."""

from __future__ import annotations

import re
from datetime import datetime, timezone
from typing import Any

from agent.ledger.facts import Facts, ReportFact
from agent.ledger.report import Prices, build_report
from tests.support import REPO

DOC = (REPO / "docs" / "ledger.md").read_text()


def table_names(text: str) -> set[str]:
    """The first-column `names` of the markdown table rows in ``text``."""
    return set(re.findall(r"^\| `([a-z_.]+)` \|", text, flags=re.M))


def figures_table() -> set[str]:
    return table_names(DOC.split("<!-- figures -->")[1].split("<!-- /figures -->")[0])


def top_level_table() -> set[str]:
    return table_names(DOC.split("Top level:")[1].split("\n\n")[1])


def flatten(doc: dict[str, Any], prefix: str = "") -> set[str]:
    keys: set[str] = set()
    for key, value in doc.items():
        if isinstance(value, dict):
            keys |= flatten(value, f"{prefix}{key}.")
        else:
            keys.add(prefix + key)
    return keys


def reports() -> Facts:
    row = ReportFact(0.0, "A", 1, 0, None, "checkpoint", "finished", 1, 10.0, 100, False, None, None, None)
    return Facts(reports=(row, ReportFact(**{**row.__dict__, "time": 3600.0, "step": 2})))


def test_every_figure_is_documented_and_every_documented_figure_is_printed() -> None:
    now = datetime(2026, 1, 1, tzinfo=timezone.utc)
    priced = build_report(reports(), now, prices=Prices(1.0, 3.0))["total"]
    unpriced = build_report(reports(), now)["total"]
    assert figures_table() == flatten(priced) | flatten(unpriced)


def test_every_top_level_field_is_documented() -> None:
    doc = build_report(reports(), datetime(2026, 1, 1, tzinfo=timezone.utc))
    assert top_level_table() == set(doc)
