"""The evacuation's plan: who holds what (the hosts in a ring, those with a notice, each notified rank's buddy),
computed alike by every rank from what each one tells the others, and the refusal every rank raises when the
peer tier cannot be used. Part of :mod:`agent.client.peer.evacuate`; import from there.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from agent.client.peer.ramtier import RamTierError


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


@dataclass(frozen=True)
class Plan:
    """Who holds what: the hosts in ring order (by lowest rank), those with a notice, and each sending
    rank's buddy."""

    hosts: tuple[tuple[str, tuple[int, ...]], ...]
    notified: frozenset[str]
    buddy: Mapping[int, int] = field(default_factory=dict)

    def host_of(self, rank: int) -> str:
        return next(host for host, ranks in self.hosts if rank in ranks)

    def leader(self, host: str) -> int:
        """The rank that reserves, commits and frees for its host: the lowest one."""
        return dict(self.hosts)[host][0]

    def senders_to(self, rank: int) -> list[int]:
        return sorted(sender for sender, receiver in self.buddy.items() if receiver == rank)


def plan(places: Sequence[Place]) -> Plan:
    """The evacuation plan every rank computes alike from the gathered places; PeerTierUnusable when a rank
    cannot use its host's tier or when every host has a notice. The k-th rank of a notified host sends to the
    (k mod n)-th rank of the next host in the ring without a notice."""
    problems = [f"rank {p.rank}: {p.problem}" for p in places if p.problem]
    if problems:
        raise PeerTierUnusable("; ".join(problems), next(p.reason for p in places if p.problem))
    grouped: dict[str, list[int]] = {}
    for place in sorted(places, key=lambda p: p.rank):
        grouped.setdefault(place.host, []).append(place.rank)
    hosts = tuple((host, tuple(ranks)) for host, ranks in grouped.items())
    notified = frozenset(p.host for p in places if p.noticed)
    if len(notified) == len(hosts):
        raise PeerTierUnusable(
            f"every host of the job has a notice ({len(hosts)} of {len(hosts)})", "all_hosts_noticed"
        )
    buddy: dict[int, int] = {}
    for index, (host, ranks) in enumerate(hosts):
        if host not in notified:
            continue
        after = [hosts[(index + step) % len(hosts)] for step in range(1, len(hosts))]
        _, survivors = next(h for h in after if h[0] not in notified)
        for k, rank in enumerate(ranks):
            buddy[rank] = survivors[k % len(survivors)]
    return Plan(hosts, notified, buddy)
