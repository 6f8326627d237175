"""The evacuation planner places a notified host's shards outside its failure domain (issue 38, placement):
a host without a notice in another capacity pool first, then (no other pool) one in another placement group,
then any; hosts of the notified host's own pool last, and hosts of another pool with a notice after those
whose domain is unknown. Ring order breaks ties, every rank computes the same plan, and without domains the
plan is the ring's of before, exactly. Pure: plan() over gathered places."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from agent.client.peer._plan import (
    NOTICED_POOL,
    OTHER_GROUP,
    OTHER_POOL,
    RING,
    SAME_POOL,
    UNKNOWN_DOMAIN,
    PeerTierUnusable,
    Place,
    plan,
)
from agent.core.domain import Domain


def dom(zone: str, group: str = "", itype: str = "p4d.24xlarge", capacity: str = "spot") -> Domain:
    return Domain("aws", itype, zone, capacity, group)


def places(*hosts: tuple[str, int, bool, Domain | None]) -> list[Place]:
    """Places from (host, number of ranks, noticed, domain), ranks numbered in order."""
    found: list[Place] = []
    for host, count, noticed, domain in hosts:
        found += [Place(len(found) + k, host, noticed, 100, domain=domain) for k in range(count)]
    return found


def ring_plan(gathered: Sequence[Place]) -> dict[int, int]:
    """The planner of before domains, as it was: the next host in the ring without a notice."""
    grouped: dict[str, list[int]] = {}
    for place in sorted(gathered, key=lambda p: p.rank):
        grouped.setdefault(place.host, []).append(place.rank)
    hosts = list(grouped.items())
    notified = {p.host for p in gathered if p.noticed}
    buddy: dict[int, int] = {}
    for index, (host, ranks) in enumerate(hosts):
        if host in notified:
            after = [hosts[(index + step) % len(hosts)] for step in range(1, len(hosts))]
            survivors = next(r for h, r in after if h not in notified)
            buddy.update({rank: survivors[k % len(survivors)] for k, rank in enumerate(ranks)})
    return buddy


def test_a_notified_hosts_buddy_is_in_another_pool_though_a_sibling_comes_first_in_the_ring() -> None:
    found = plan(
        places(
            ("a", 2, True, dom("us-east-1a")),
            ("b", 2, False, dom("us-east-1a")),
            ("c", 2, False, dom("us-east-1b")),
        )
    )
    assert ({0: 4, 1: 5}, "c", OTHER_POOL) == (
        dict(found.buddy),
        found.placement["a"].holder,
        found.placement["a"].rule,
    )


def test_another_instance_type_or_capacity_type_in_the_same_zone_is_another_pool() -> None:
    for other in (dom("us-east-1a", itype="p5.48xlarge"), dom("us-east-1a", capacity="on-demand")):
        found = plan(
            places(
                ("a", 1, True, dom("us-east-1a")), ("b", 1, False, dom("us-east-1a")), ("c", 1, False, other)
            )
        )
        assert ({0: 2}, OTHER_POOL) == (dict(found.buddy), found.placement["a"].rule), other


def test_same_pool_hosts_are_the_last_choice_and_say_so() -> None:
    found = plan(
        places(
            ("a", 1, True, dom("us-east-1a")),
            ("b", 1, False, dom("us-east-1a")),
            ("c", 1, False, dom("us-east-1a")),
        )
    )
    assert ({0: 1}, SAME_POOL) == (dict(found.buddy), found.placement["a"].rule)  # ring order breaks the tie


def test_within_the_own_pool_another_placement_group_comes_first() -> None:
    found = plan(
        places(
            ("a", 1, True, dom("us-east-1a", "pg-1")),
            ("b", 1, False, dom("us-east-1a", "pg-1")),
            ("c", 1, False, dom("us-east-1a", "pg-2")),
        )
    )
    assert ({0: 2}, OTHER_GROUP) == (dict(found.buddy), found.placement["a"].rule)


def test_another_pool_beats_another_placement_group_of_the_own_pool() -> None:
    found = plan(
        places(
            ("a", 1, True, dom("us-east-1a", "pg-1")),
            ("b", 1, False, dom("us-east-1a", "pg-2")),
            ("c", 1, False, dom("us-east-1b", "pg-1")),
        )
    )
    assert ({0: 2}, OTHER_POOL) == (dict(found.buddy), found.placement["a"].rule)


def test_among_hosts_of_other_pools_a_known_other_placement_group_breaks_the_tie() -> None:
    found = plan(
        places(
            ("a", 1, True, dom("us-east-1a", "pg-1")),
            ("b", 1, False, dom("us-east-1b", "pg-1")),
            ("c", 1, False, dom("us-east-1c", "pg-2")),
        )
    )
    assert ({0: 2}, OTHER_POOL) == (dict(found.buddy), found.placement["a"].rule)


def test_a_pool_with_a_notice_elsewhere_is_avoided_after_other_pools_and_unknown_domains() -> None:
    """A notice names a pool: its other hosts are likely next (issue 38), even for another pool's host."""
    layout = [
        ("a", 1, True, dom("us-east-1a")),
        ("x", 1, True, dom("us-east-1b")),
        ("b", 1, False, dom("us-east-1b")),
        ("c", 1, False, None),
        ("d", 1, False, dom("us-east-1c")),
    ]
    found = plan(places(*layout))
    assert ("d", OTHER_POOL, "d", OTHER_POOL) == (
        found.placement["a"].holder,
        found.placement["a"].rule,
        found.placement["x"].holder,
        found.placement["x"].rule,
    )
    without_d = plan(places(*layout[:4]))
    assert ("c", UNKNOWN_DOMAIN) == (without_d.placement["a"].holder, without_d.placement["a"].rule)
    only_hot = plan(places(*layout[:3]))
    assert ("b", NOTICED_POOL) == (only_hot.placement["a"].holder, only_hot.placement["a"].rule)


def test_the_own_pool_comes_after_a_pool_with_a_notice_elsewhere() -> None:
    found = plan(
        places(
            ("a", 1, True, dom("us-east-1a")),
            ("b", 1, False, dom("us-east-1a")),
            ("x", 1, True, dom("us-east-1b")),
            ("c", 1, False, dom("us-east-1b")),
        )
    )
    assert (3, NOTICED_POOL) == (found.buddy[0], found.placement["a"].rule)
    assert (1, NOTICED_POOL) == (found.buddy[2], found.placement["x"].rule)  # both pools have a notice


def test_without_any_domain_the_plan_is_the_ring_of_before_exactly() -> None:
    rng = random.Random(38)
    for _ in range(300):
        hosts = [(f"h{i}", rng.randint(1, 3), rng.random() < 0.4, None) for i in range(rng.randint(2, 6))]
        if all(noticed for _, _, noticed, _ in hosts):
            continue
        gathered = places(*hosts)
        rng.shuffle(gathered)  # the ranks' order of arrival is not the plan's business
        found = plan(gathered)
        assert ring_plan(gathered) == dict(found.buddy), hosts
        assert {RING} >= {p.rule for p in found.placement.values()}


def test_every_rank_computes_the_same_plan_from_the_gathered_places() -> None:
    rng = random.Random(6)
    zones = ["us-east-1a", "us-east-1b", "us-east-1c"]
    for _ in range(200):
        hosts = [
            (
                f"h{i}",
                rng.randint(1, 2),
                rng.random() < 0.4,
                rng.choice([None, dom(rng.choice(zones), rng.choice(["", "pg-1", "pg-2"]))]),
            )
            for i in range(rng.randint(2, 6))
        ]
        if all(noticed for _, _, noticed, _ in hosts):
            continue
        gathered = places(*hosts)
        found = plan(gathered)
        for _ in range(4):
            assert found == plan(rng.sample(gathered, len(gathered))), hosts
        assert set(found.placement) == found.notified
        assert all(found.placement[h].holder not in found.notified for h in found.notified)


def test_a_rank_without_a_domain_on_a_host_whose_other_rank_told_one_keeps_the_hosts_domain() -> None:
    gathered = [
        Place(0, "a", True, 1),
        Place(1, "a", True, 1, domain=dom("us-east-1a")),
        Place(2, "b", False, 1, domain=dom("us-east-1a")),
        Place(3, "c", False, 1, domain=dom("us-east-1b")),
    ]
    found = plan(gathered)
    assert ({0: 3, 1: 3}, dom("us-east-1a")) == (dict(found.buddy), found.placement["a"].domain)


def test_placement_json_says_where_each_notified_hosts_copies_are_and_why() -> None:
    found = plan(places(("a", 1, True, dom("us-east-1a", "pg-1")), ("b", 1, False, dom("us-east-1b"))))
    assert {
        "a": {
            "holder": "b",
            "rule": OTHER_POOL,
            "domain": "aws/p4d.24xlarge/us-east-1a/spot group pg-1",
            "holder_domain": "aws/p4d.24xlarge/us-east-1b/spot",
        }
    } == found.placement_json()


def test_every_host_noticed_is_still_refused() -> None:
    with pytest.raises(PeerTierUnusable) as raised:
        plan(places(("a", 1, True, dom("us-east-1a")), ("b", 1, True, dom("us-east-1b"))))
    assert "all_hosts_noticed" == raised.value.reason
