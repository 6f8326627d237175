"""The snapshot planner (agent/client/peer/_plan.py, pure and without torch, for agent/client/peer/snapshot.py):
every host's copy goes to one other host, chosen by the evacuation's placement rule (another capacity pool
first; without domains the next host in the ring), and the phases in which hosts send never make a host send
and receive at once."""

from __future__ import annotations

import dataclasses
import random

import pytest

from agent.client.peer._plan import (
    NOTICED_POOL,
    OTHER_POOL,
    RING,
    SAME_POOL,
    PeerTierUnusable,
    Place,
    phases,
    placement_json,
    ring,
    second_ring,
)
from agent.core.domain import Domain


def places(hosts: list[str], per_host: int = 2, domains: dict[str, Domain] | None = None) -> list[Place]:
    return [
        Place(index * per_host + k, host, False, 1 << 20, domain=(domains or {}).get(host))
        for index, host in enumerate(hosts)
        for k in range(per_host)
    ]


def test_without_domains_each_host_is_held_by_the_next_in_the_ring() -> None:
    the_plan = ring(places(["a", "b", "c"]))
    assert {h: p.holder for h, p in the_plan.placement.items()} == {"a": "b", "b": "c", "c": "a"}
    assert {p.rule for p in the_plan.placement.values()} == {RING}
    assert the_plan.buddy == {0: 2, 1: 3, 2: 4, 3: 5, 4: 0, 5: 1}
    assert the_plan.notified == frozenset()


def test_a_copy_goes_to_another_capacity_pool_before_the_next_host_of_the_same_pool() -> None:
    spot = Domain("aws", "p5.48xlarge", "us-east-1a", "spot")
    other = Domain("aws", "p5.48xlarge", "us-east-1b", "spot")
    the_plan = ring(places(["a", "b", "c"], 1, {"a": spot, "b": spot, "c": other}))
    assert the_plan.placement["a"].holder == "c"
    assert the_plan.placement["a"].rule == OTHER_POOL
    assert the_plan.placement["c"].holder in ("a", "b")


def test_one_host_has_no_peer_and_a_bad_tier_names_its_rank() -> None:
    with pytest.raises(PeerTierUnusable, match="one host") as one:
        ring(places(["a"]))
    assert one.value.reason == "one_host"
    bad = [*places(["a", "b"])[:3], Place(3, "b", False, 1, "tier is full", "no_room")]
    with pytest.raises(PeerTierUnusable, match="rank 3: tier is full") as full:
        ring(bad)
    assert full.value.reason == "no_room"


@pytest.mark.parametrize(("count", "expected"), [(2, [0, 1]), (3, [0, 1, 2]), (4, [0, 1, 0, 1])])
def test_a_ring_takes_two_phases_or_three_when_odd(count: int, expected: list[int]) -> None:
    assert phases([(i + 1) % count for i in range(count)]) == expected


def test_no_host_sends_and_receives_in_one_phase_whoever_holds_for_whom() -> None:
    generator = random.Random(38)
    for _ in range(500):
        count = generator.randint(2, 9)
        holders = [generator.choice([j for j in range(count) if j != i]) for i in range(count)]
        found = phases(holders)
        for host, holder in enumerate(holders):
            assert found[host] != found[holder], (holders, found)


SPOT = Domain("aws", "p5.48xlarge", "us-east-1a", "spot")
OTHER = Domain("aws", "p5.48xlarge", "us-east-1b", "spot")


def test_when_every_host_is_in_one_pool_each_copy_has_a_second_remote_holder() -> None:
    """One pool: a burst of reclaims there may take a host and its holder together, so a third host keeps a
    second copy: never the host itself, never its first holder; every rank of the host has a second buddy."""
    gathered = places(["a", "b", "c", "d"], 2, dict.fromkeys("abcd", SPOT))
    first = ring(gathered)
    assert {SAME_POOL} == {p.rule for p in first.placement.values()}
    second = second_ring(gathered, first)
    assert second is not None
    for host, extra in second.placement.items():
        assert extra.holder not in (host, first.placement[host].holder), (host, extra)
    assert sorted(second.buddy) == list(range(8))
    assert all(first.host_of(second.buddy[r]) != first.host_of(first.buddy[r]) for r in range(8))
    shown = placement_json(first, second)
    assert {h: second.placement[h].holder for h in "abcd"} == {h: e["second"] for h, e in shown.items()}


def test_no_second_copy_where_a_holder_is_in_another_pool_without_domains_or_on_two_hosts() -> None:
    mixed = places(["a", "b", "c"], 1, {"a": SPOT, "b": SPOT, "c": OTHER})
    assert {OTHER_POOL} == {p.rule for p in ring(mixed).placement.values()}
    assert second_ring(mixed, ring(mixed)) is None
    unknown = places(["a", "b", "c"])
    assert second_ring(unknown, ring(unknown)) is None
    two = places(["a", "b"], 1, dict.fromkeys("ab", SPOT))
    assert second_ring(two, ring(two)) is None
    assert "second" not in placement_json(ring(two), None)["a"]


def test_a_host_that_sends_nothing_has_no_phase_and_the_others_still_never_send_and_receive_at_once() -> None:
    generator = random.Random(36)
    for _ in range(500):
        count = generator.randint(2, 9)
        holders: list[int | None] = [
            None if generator.random() < 0.3 else generator.choice([j for j in range(count) if j != i])
            for i in range(count)
        ]
        found = phases(holders)
        for host, holder in enumerate(holders):
            if holder is None:
                assert -1 == found[host]
            else:
                assert found[host] >= 0 and found[host] != found[holder], (holders, found)


def test_a_pool_where_the_job_lost_a_host_lately_holds_a_copy_only_when_no_other_pool_can() -> None:
    """A departed host's pool (``Siblings.pools``, told by any one rank: every rank plans with the union) is
    counted as a pool with a notice: host a's copy goes to c in a third pool rather than to b in the pool that
    just lost a host, though b comes first in the ring; with nowhere else to go, b still holds one."""
    third = Domain("aws", "p5.48xlarge", "us-east-1c", "spot")
    gathered = places(["a", "b", "c"], 1, {"a": SPOT, "b": OTHER, "c": third})
    assert "b" == ring(gathered).placement["a"].holder  # the next in the ring, another pool
    told = [gathered[0], dataclasses.replace(gathered[1], avoid=(OTHER.pool_name,)), gathered[2]]
    the_plan = ring(told)
    assert ("c", OTHER_POOL) == (the_plan.placement["a"].holder, the_plan.placement["a"].rule)
    two = [
        dataclasses.replace(p, avoid=(OTHER.pool_name,))
        for p in places(["a", "b"], 1, {"a": SPOT, "b": OTHER})
    ]
    assert ("b", NOTICED_POOL) == (ring(two).placement["a"].holder, ring(two).placement["a"].rule)
