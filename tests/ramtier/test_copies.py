"""What a step's tier.json says of its copies (agent/ramtier/copies.py): the kind and the placement, checked
field by field since the job's client writes it; a malformed placement is dropped, never trusted."""

from __future__ import annotations

from typing import Any

import pytest

from agent.ramtier.copies import MAX_HOSTS, kind_of, placement_of

GOOD = {"a:/ram": {"holder": "b:/ram", "rule": "other_pool", "domain": None}}


def test_a_snapshot_is_marked_and_any_other_step_is_a_step() -> None:
    assert ("snapshot", "step", "step") == (
        kind_of({"snapshot": True}),
        kind_of({}),
        kind_of({"snapshot": 1}),
    )


def test_the_placement_keeps_each_hosts_holder_and_rule() -> None:
    assert {"a:/ram": {"holder": "b:/ram", "rule": "other_pool"}} == placement_of({"placement": GOOD})


def test_a_second_remote_holder_is_kept_and_must_be_a_host_key() -> None:
    second = {"a:/ram": {**GOOD["a:/ram"], "rule": "same_pool", "second": "c:/ram"}}
    expected = {"a:/ram": {"holder": "b:/ram", "rule": "same_pool", "second": "c:/ram"}}
    assert expected == placement_of({"placement": second})
    assert {} == placement_of({"placement": {"a:/ram": {**second["a:/ram"], "second": 3}}})


@pytest.mark.parametrize(
    "placement",
    [
        "a",
        ["a"],
        {"a": "b"},
        {"a": {"holder": "b"}},
        {"a": {"holder": 7, "rule": "ring"}},
        {"": {"holder": "b", "rule": "ring"}},
        {"a": {"holder": "b\n", "rule": "ring"}},
        {"a": {"holder": "x" * 513, "rule": "ring"}},
        {f"h{i}": {"holder": "b", "rule": "ring"} for i in range(MAX_HOSTS + 1)},
    ],
)
def test_a_malformed_placement_is_dropped_whole(placement: Any) -> None:
    assert {} == placement_of({"placement": placement})
