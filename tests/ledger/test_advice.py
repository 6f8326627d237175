"""`preemptd advise` says how much longer the advised interval is because of the notices (T* grows by
1/sqrt(1-a) for a covered share a) and what that saves in periodic checkpoints (issue 25 item 5)."""

from __future__ import annotations

import argparse
import io
import json
import math
from typing import Any

from agent.advisor.cli import register, run


def advise(*argv: str) -> tuple[int, str]:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    out = io.StringIO()
    code = run(parser.parse_args(["advise", *argv]), out, io.StringIO())
    return code, out.getvalue()


def offline(share: str) -> dict[str, Any]:
    code, text = advise("--save-time", "4m", "--mtbp", "6h", "--announced-share", share, "--json")
    assert code == 0
    doc: dict[str, Any] = json.loads(text)
    return doc


def test_three_quarters_covered_doubles_the_young_interval() -> None:
    """a = 0.75: the first-order factor is 1/sqrt(0.25) = 2."""
    benefit = offline("0.75")["notice_benefit"]
    assert (0.75, 2.0) == (benefit["covered_share"], benefit["interval_factor"])


def test_the_checkpoints_saved_are_those_of_the_notice_blind_interval_less_the_advised() -> None:
    """Checkpoints a day at the notice-blind interval (every interruption a loss) less those at the advised
    one, and the save time they take."""
    doc = offline("0.75")
    delta = 240.0
    blind = doc["expected_waste"]["if_every_interruption_lost_work"]["interval_s"]
    per_day = 86400.0 / (blind + delta) - 86400.0 / (doc["interval_s"] + delta)
    benefit = doc["notice_benefit"]
    assert (round(per_day, 3), round(per_day * delta, 1), round(doc["interval_s"] / blind, 4)) == (
        benefit["checkpoints_saved_per_day"],
        benefit["checkpoint_time_saved_per_day_s"],
        benefit["exact_factor"],
    )


def test_without_notices_there_is_no_benefit_to_show() -> None:
    """No announced interruptions: no notice_benefit."""
    assert offline("0")["notice_benefit"] is None


def test_the_human_output_says_how_much_longer_the_interval_is() -> None:
    code, text = advise("--save-time", "4m", "--mtbp", "6h", "--announced-share", "75%")
    line = next(line for line in text.splitlines() if line.startswith("Notices"))
    assert (0, True) == (code, "x2.00 longer" in line and "1/sqrt(1-a), a = 75%" in line)


def test_the_factor_is_one_over_the_square_root_of_the_uncovered_share() -> None:
    """A table of shares: 0.5 -> 1.4142, 0.9 -> 3.1623."""
    assert [round(1 / math.sqrt(0.5), 4), round(1 / math.sqrt(0.1), 4)] == [
        offline("0.5")["notice_benefit"]["interval_factor"],
        offline("0.9")["notice_benefit"]["interval_factor"],
    ]
