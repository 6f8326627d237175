"""The evacuation's plan: who holds what (the hosts in a ring, those with a notice, each notified rank's buddy),
computed alike by every rank from what each one tells the others, and the refusal every rank raises when the
peer tier cannot be used. Part of :mod:`agent.client.peer.evacuate`; import from there.

A notified host's buddy host is chosen outside its failure domain (docs/ram-tier.md, "Failure domains and
placement"): a host without a notice in another capacity pool first, then one whose domain is not known,
then one in another pool that has a notice too, then one of the host's own pool in another placement group,
then any; ring order breaks ties. Without any domain that is the next host in the ring without a notice. A
snapshot's holder is chosen by the same rule, with the pools of hosts that left the job lately (``avoid``:
:meth:`agent.client.hazard.Siblings.pools`) counted as pools with a notice.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from agent.client.peer.ramtier import RamTierError
from agent.core.domain import Domain

# Which rule chose a notified host's holder, best first (Placement.rule).
OTHER_POOL = "other_pool"  # another capacity pool, none of whose hosts has a notice
UNKNOWN_DOMAIN = "unknown_domain"  # the holder's domain, or the notified host's, is not known
NOTICED_POOL = "noticed_pool"  # another pool, but one where a host has a notice too
OTHER_GROUP = "other_group"  # the notified host's own pool, another placement group
SAME_POOL = "same_pool"  # the notified host's own pool: the last choice
RING = "ring"  # no rank told a domain (older agents): the next host in the ring without a notice
RULES = (OTHER_POOL, UNKNOWN_DOMAIN, NOTICED_POOL, OTHER_GROUP, SAME_POOL)
# A snapshot's holder chosen by these shares its host's capacity pool (no host of another pool could hold the
# copy): a burst of reclaims in that pool may take both, so a third host keeps a second remote copy.
SHARED_POOL_RULES = (OTHER_GROUP, SAME_POOL)


class PeerTierUnusable(Exception):
    """The step cannot be evacuated into the peers' RAM tiers (why: the message; ``reason``, as reports say
    it: ``all_hosts_noticed``, ``no_room``, ``agent_unreachable``, ``tier_unavailable`` (off, being read back,
    refused), ``evacuation_failed`` (a write or a transfer failed)); raised on every rank alike, before anything
    is committed, so the store can save to the durable root instead."""

    def __init__(self, message: str, reason: str = "evacuation_failed") -> None:
        super().__init__(message)
        self.reason = reason

    def __reduce__(self) -> tuple[Any, ...]:  # gathered over the group with its reason
        return (type(self), (str(self), self.reason))


def fallback_reason(error: RamTierError) -> str:
    """A RAM tier's refusal as a :class:`PeerTierUnusable` reason."""
    return {"unreachable": "agent_unreachable", "full": "no_room"}.get(error.reason, "tier_unavailable")


@dataclass(frozen=True)
class Place:
    """What one rank tells the others before an evacuation."""

    rank: int
    host: str  # the RAM tier it writes into: host name and tier path
    noticed: bool
    estimate: int  # bytes its shard should take
    problem: str | None = None  # why its host's RAM tier cannot be used
    reason: str = "tier_unavailable"  # that, as PeerTierUnusable's reason
    domain: Domain | None = None  # its host's failure domain (RamTier.domain_of), None when not known
    avoid: tuple[str, ...] = ()  # a snapshot's: pools where this rank saw the job lose hosts lately


@dataclass(frozen=True)
class Placement:
    """Where a notified host's shards go and why: the holder host, the rule that chose it (one of
    :data:`RULES`, or :data:`RING`), and both hosts' domains as far as they are known."""

    holder: str
    rule: str
    domain: Domain | None = None
    holder_domain: Domain | None = None

    def to_json(self) -> dict[str, str | None]:
        return {
            "holder": self.holder,
            "rule": self.rule,
            "domain": None if self.domain is None else str(self.domain),
            "holder_domain": None if self.holder_domain is None else str(self.holder_domain),
        }


@dataclass(frozen=True)
class Plan:
    """Who holds what: the hosts in ring order (by lowest rank), those with a notice, and each sending
    rank's buddy."""

    hosts: tuple[tuple[str, tuple[int, ...]], ...]
    notified: frozenset[str]
    buddy: Mapping[int, int] = field(default_factory=dict)
    placement: Mapping[str, Placement] = field(default_factory=dict)  # by notified host

    def host_of(self, rank: int) -> str:
        return next(host for host, ranks in self.hosts if rank in ranks)

    def leader(self, host: str) -> int:
        """The rank that reserves, commits and frees for its host: the lowest one."""
        return dict(self.hosts)[host][0]

    def senders_to(self, rank: int) -> list[int]:
        return sorted(sender for sender, receiver in self.buddy.items() if receiver == rank)

    def placement_json(self) -> dict[str, dict[str, str | None]]:
        """Each notified host's holder and why, for status and reports."""
        return {host: found.to_json() for host, found in sorted(self.placement.items())}


def host_domains(places: Sequence[Place]) -> dict[str, Domain | None]:
    """Each host's domain: the first one its ranks told, in rank order (they read one agent)."""
    domains: dict[str, Domain | None] = {}
    for place in sorted(places, key=lambda p: p.rank):
        if domains.get(place.host) is None:
            domains[place.host] = place.domain
    return domains


def _rank(mine: Domain | None, theirs: Domain | None, noticed_pools: frozenset[str]) -> tuple[int, str, bool]:
    """A candidate holder's tier (its index in RULES), that rule, and whether it is known to be in another
    placement group than the notified host. ``noticed_pools``: the pool names (``Domain.pool_name``) with a
    notice."""
    other_group = bool(mine and theirs and mine.group and theirs.group and mine.group != theirs.group)
    noticed = theirs is not None and theirs.pool_name in noticed_pools
    if noticed and theirs is not None and (mine is None or theirs.pool != mine.pool):
        rule = NOTICED_POOL
    elif mine is None or theirs is None:
        rule = UNKNOWN_DOMAIN
    elif theirs.pool != mine.pool:
        rule = OTHER_POOL
    else:
        rule = OTHER_GROUP if other_group else SAME_POOL
    return RULES.index(rule), rule, other_group


def choose_holder(
    hosts: Sequence[tuple[str, Sequence[int]]],
    index: int,
    notified: Collection[str],
    domains: Mapping[str, Domain | None],
    avoid: Collection[str] = (),
) -> tuple[int, str]:
    """The index in ``hosts`` (ring order) of the host that holds the shards of ``hosts[index]``, and the
    rule that chose it: the best tier of :data:`RULES`, then a known other placement group, then the next in
    the ring. Without any domain: the next host in the ring without a notice, rule :data:`RING`. ``avoid``:
    more pool names to count as noticed (where hosts of the job were lost lately). The same on every rank for
    the same arguments."""
    mine = domains.get(hosts[index][0])
    noticed_pools = frozenset(d.pool_name for h, d in domains.items() if d is not None and h in notified)
    noticed_pools |= frozenset(avoid)
    best: tuple[tuple[int, bool, int], int, str] | None = None
    for step in range(1, len(hosts)):
        at = (index + step) % len(hosts)
        if hosts[at][0] in notified:
            continue
        tier, rule, other_group = _rank(mine, domains.get(hosts[at][0]), noticed_pools)
        key = (tier, not other_group, step)
        if best is None or key < best[0]:
            best = (key, at, rule)
    if best is None:
        raise ValueError("every host has a notice")
    if all(d is None for d in domains.values()):
        return best[1], RING
    return best[1], best[2]


def usable_hosts(places: Sequence[Place]) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """The hosts in ring order (by lowest rank), each with its ranks; PeerTierUnusable naming every rank whose
    host's tier cannot be used."""
    problems = [f"rank {p.rank}: {p.problem}" for p in places if p.problem]
    if problems:
        raise PeerTierUnusable("; ".join(problems), next(p.reason for p in places if p.problem))
    grouped: dict[str, list[int]] = {}
    for place in sorted(places, key=lambda p: p.rank):
        grouped.setdefault(place.host, []).append(place.rank)
    return tuple((host, tuple(ranks)) for host, ranks in grouped.items())


def plan(places: Sequence[Place]) -> Plan:
    """The evacuation plan every rank computes alike from the gathered places; PeerTierUnusable when a rank
    cannot use its host's tier or when every host has a notice. The k-th rank of a notified host sends to the
    (k mod n)-th rank of the host :func:`choose_holder` picks (without domains: the next host in the ring
    without a notice)."""
    hosts = usable_hosts(places)
    notified = frozenset(p.host for p in places if p.noticed)
    if len(notified) == len(hosts):
        raise PeerTierUnusable(
            f"every host of the job has a notice ({len(hosts)} of {len(hosts)})", "all_hosts_noticed"
        )
    domains = host_domains(places)
    buddy: dict[int, int] = {}
    placement: dict[str, Placement] = {}
    for index, (host, ranks) in enumerate(hosts):
        if host not in notified:
            continue
        at, rule = choose_holder(hosts, index, notified, domains)
        holder, survivors = hosts[at]
        placement[host] = Placement(holder, rule, domains[host], domains[holder])
        for k, rank in enumerate(ranks):
            buddy[rank] = survivors[k % len(survivors)]
    return Plan(hosts, notified, buddy, placement)


# -- peer snapshots (agent/client/peer/snapshot.py): every host sends, pure like the evacuation's plan --------


def avoided(places: Sequence[Place]) -> frozenset[str]:
    """The pools any rank asks to avoid (the same on every rank, whatever each one's clock expired)."""
    return frozenset(pool for place in places for pool in place.avoid)


def ring(places: Sequence[Place]) -> Plan:
    """Every rank's buddy: the (k mod n)-th rank of the host that holds its host's copy, chosen as an
    evacuation chooses a notified host's holder (:func:`choose_holder`: another capacity pool first, the host's
    own pool last, the pools a rank asks to avoid as if they had a notice; without domains, the next host in
    the ring), with every host sending; PeerTierUnusable when a rank's tier cannot be used or the job has one
    host (no peer to hold a copy)."""
    hosts = usable_hosts(places)
    if len(hosts) < 2:
        raise PeerTierUnusable("the job runs on one host: no peer to keep a copy", "one_host")
    domains, avoid = host_domains(places), avoided(places)
    buddy: dict[int, int] = {}
    placement: dict[str, Placement] = {}
    for index, (host, ranks) in enumerate(hosts):
        at, rule = choose_holder(hosts, index, frozenset(), domains, avoid)
        holder, after = hosts[at]
        placement[host] = Placement(holder, rule, domains[host], domains[holder])
        buddy.update({rank: after[k % len(after)] for k, rank in enumerate(ranks)})
    return Plan(hosts, frozenset(), buddy, placement)


def second_ring(places: Sequence[Place], first: Plan) -> Plan | None:
    """A second remote copy of each host's snapshot whose holder in ``first`` shares its capacity pool (rules
    :data:`SHARED_POOL_RULES`), on the host :func:`choose_holder` picks among the others (not the first
    holder); None when no host needs one, domains are not known, or the job has fewer than three hosts."""
    hosts = first.hosts
    if len(hosts) < 3:
        return None
    domains, avoid = host_domains(places), avoided(places)
    buddy: dict[int, int] = {}
    placement: dict[str, Placement] = {}
    for index, (host, ranks) in enumerate(hosts):
        chosen = first.placement[host]
        if chosen.rule not in SHARED_POOL_RULES:
            continue
        at, rule = choose_holder(hosts, index, frozenset({chosen.holder}), domains, avoid)
        holder, after = hosts[at]
        placement[host] = Placement(holder, rule, domains[host], domains[holder])
        buddy.update({rank: after[k % len(after)] for k, rank in enumerate(ranks)})
    return Plan(hosts, frozenset(), buddy, placement) if buddy else None


def placement_json(first: Plan, second: Plan | None) -> dict[str, dict[str, str | None]]:
    """A snapshot's placement for its tier.json and status: each host's holder and why, and its second
    holder where it has one."""
    found = first.placement_json()
    for host, extra in (second.placement if second is not None else {}).items():
        found[host]["second"] = extra.holder
    return found


def phases(holders: Sequence[int | None]) -> list[int]:
    """The phase in which each host sends its copy to its holder (``holders[i]``: the index of host i's
    holder; None: host i sends nothing, phase -1), so that no host sends and receives in one phase (a
    blocking send waits for its receiver): the smallest phase that its holder does not send in and none of
    the hosts it holds for sends in. A ring of even length takes two phases, an odd one three."""
    found: list[int] = []
    for index, holder in enumerate(holders):
        if holder is None:
            found.append(-1)
            continue
        taken = {found[holder]} if holder < index else set()
        taken |= {found[other] for other in range(index) if holders[other] == index}
        found.append(next(phase for phase in range(len(holders)) if phase not in taken))
    return found
