"""The notice board: the active notices, keyed by (source, key), and what each observation does to them
(raised, updated, cleared, expired), with identities that survive restarts. Pure: callers pass ``now``; what
changed goes to the board's listeners (the agent wires the fan-out there), and back to the caller.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from datetime import datetime, timedelta, timezone
from typing import Any

from agent.core.notice import EventType, Notice, Observation

# A deadline that moves later by less than this between two observations is treated as payload jitter (some
# metadata mocks answer "now + 2 min" on every poll): the earlier, safer deadline is kept and no update is sent.
DEADLINE_JITTER = timedelta(seconds=30)


def derive_notice_id(source: str, key: str, identity: str) -> str:
    """A notice's id: a readable source prefix and 64 bits of a hash of what identifies the event. The same
    event gets the same id after any restart, also one that lost the state file's last write."""
    digest = hashlib.blake2b("\0".join((source, key, identity)).encode(), digest_size=8).hexdigest()
    return f"{source}-{digest}"


# How many (source, key) occurrence counts a board keeps: enough for every GPU and condition of a host.
MAX_OCCURRENCES = 4096

# Told of every change, with the ``now`` the caller passed; the board's own wiring (the fan-out, the state
# keeper, the expiry), called in registration order.
ChangeListener = Callable[[list["Change"], datetime], None]


@dataclass(frozen=True)
class Change:
    """What an observation did to the board: the event type and the notice after the change."""

    type: EventType
    notice: Notice


class NoticeBoard:
    """The set of active notices, keyed by (source, key). Pure: callers pass ``now``.

    Identity is assigned on first sight and kept for as long as the source keeps reporting the same key,
    across payload changes and across agent restarts (through :meth:`restore`). It is derived, not drawn:
    from the source, the key and the cloud's own event identity when the observation has one, else from the
    ``scope`` (the host's boot) and how many times that key was cleared before, so that an agent that
    crashed before saving its state gives the same event the same id again, and a condition that ends and
    comes back is a new notice.

    Every method that changes notices returns the changes and hands them, once the board holds them all, to
    the listeners added with :meth:`on_change` (none: the board is a plain value, as in unit tests).
    """

    def __init__(self, id_factory: Callable[[str], str] | None = None, scope: str = "") -> None:
        self._id_factory = id_factory
        self._scope = scope
        self._by_key: dict[tuple[str, str], Notice] = {}
        self._occurrences: dict[tuple[str, str], int] = {}
        self._listeners: list[ChangeListener] = []

    def on_change(self, listener: ChangeListener) -> None:
        self._listeners.append(listener)

    def _tell(self, changes: list[Change], now: datetime) -> list[Change]:
        if changes:
            for listener in self._listeners:
                listener(changes, now)
        return changes

    def active(self) -> tuple[Notice, ...]:
        """Active notices, most urgent first (severity, then earliest deadline, then detection)."""
        far = datetime.max.replace(tzinfo=timezone.utc)
        return tuple(
            sorted(
                self._by_key.values(),
                key=lambda n: (-n.severity.rank, n.deadline or far, n.detected_at, n.id),
            )
        )

    def get(self, notice_id: str) -> Notice | None:
        for notice in self._by_key.values():
            if notice.id == notice_id:
                return notice
        return None

    def keys_of(self, source: str) -> set[str]:
        return {key for (src, key) in self._by_key if src == source}

    def __len__(self) -> int:
        return len(self._by_key)

    def restore(self, notices: Iterable[Notice], occurrences: Any = None) -> None:
        """Load notices persisted by an earlier run, identity and deadline unchanged, and the occurrence
        counts of :meth:`occurrences` (ignored when they were saved under another scope)."""
        for notice in notices:
            if notice.cleared_at is None:
                self._by_key[(notice.source, notice.key)] = notice
        if isinstance(occurrences, Mapping) and occurrences.get("scope") == self._scope:
            for row in occurrences.get("counts") or []:
                if (
                    isinstance(row, list)
                    and len(row) == 3
                    and isinstance(row[0], str)
                    and isinstance(row[1], str)
                    and isinstance(row[2], int)
                ):
                    self._occurrences[(row[0], row[1])] = row[2]

    def occurrences(self) -> dict[str, Any]:
        """The occurrence counts, as JSON for the state file."""
        return {"scope": self._scope, "counts": [[s, k, n] for (s, k), n in self._occurrences.items()]}

    def _new_id(self, source: str, obs: Observation) -> str:
        if self._id_factory is not None:
            return self._id_factory(source)
        event = obs.event_identity
        if event is not None:
            return derive_notice_id(source, obs.key, f"event:{event}")
        seen = self._occurrences.get((source, obs.key), 0)
        return derive_notice_id(source, obs.key, f"scope:{self._scope}:{seen}")

    def observe(self, source: str, obs: Observation, now: datetime) -> Change | None:
        """Record that ``source`` sees ``obs`` now; returns the change, or None if clients need not hear."""
        change = self._observe(source, obs, now)
        self._tell([change] if change else [], now)
        return change

    def _observe(self, source: str, obs: Observation, now: datetime) -> Change | None:
        slot = (source, obs.key)
        current = self._by_key.get(slot)
        severity = obs.effective_severity
        if current is None:
            notice = Notice(
                id=self._new_id(source, obs),
                kind=obs.kind,
                severity=severity,
                source=source,
                key=obs.key,
                reason=obs.reason,
                detected_at=now,
                updated_at=now,
                deadline=obs.deadline,
                drill=obs.drill,
                detail=dict(obs.detail),
            )
            self._by_key[slot] = notice
            return Change(EventType.NOTICE, notice)
        deadline = _merge_deadline(current.deadline, obs.deadline)
        if (
            current.kind == obs.kind
            and current.severity == severity
            and current.reason == obs.reason
            and current.deadline == deadline
        ):
            return None
        updated = replace(
            current,
            kind=obs.kind,
            severity=severity,
            reason=obs.reason,
            deadline=deadline,
            detail=dict(obs.detail),
            updated_at=now,
        )
        self._by_key[slot] = updated
        return Change(EventType.UPDATE, updated)

    def clear(self, source: str, key: str, now: datetime, reason: str | None = None) -> Change | None:
        """The source no longer sees ``key``; returns the cleared notice, or None if it was not active."""
        change = self._clear(source, key, now, reason)
        self._tell([change] if change else [], now)
        return change

    def _clear(self, source: str, key: str, now: datetime, reason: str | None) -> Change | None:
        notice = self._by_key.pop((source, key), None)
        if notice is None:
            return None
        slot = (source, key)
        self._occurrences[slot] = self._occurrences.pop(slot, 0) + 1  # re-inserted: newest last
        if len(self._occurrences) > MAX_OCCURRENCES:
            del self._occurrences[next(iter(self._occurrences))]
        detail = dict(notice.detail)
        if reason:
            detail["cleared_reason"] = reason
        return Change(EventType.CLEARED, replace(notice, cleared_at=now, updated_at=now, detail=detail))

    def clear_id(self, notice_id: str, now: datetime, reason: str | None = None) -> Change | None:
        notice = self.get(notice_id)
        if notice is None:
            return None
        return self.clear(notice.source, notice.key, now, reason)

    def replace_source(self, source: str, observations: Iterable[Observation], now: datetime) -> list[Change]:
        """Make ``observations`` the complete set ``source`` sees: new and changed ones are raised, the rest
        of that source's notices are cleared. Call it only after a successful read of the source."""
        changes: list[Change] = []
        seen: set[str] = set()
        for obs in observations:
            if obs.key in seen:
                continue
            seen.add(obs.key)
            change = self._observe(source, obs, now)
            if change is not None:
                changes.append(change)
        for key in sorted(self.keys_of(source) - seen):
            change = self._clear(source, key, now, "no longer reported")
            if change is not None:
                changes.append(change)
        return self._tell(changes, now)

    def expire(self, now: datetime, grace_for: Callable[[Notice], timedelta | None]) -> list[Change]:
        """Clear notices whose deadline passed more than ``grace_for(notice)`` ago; ``None`` keeps a notice
        (the agent keeps notices of running sources: the source itself says when they end)."""
        changes: list[Change] = []
        for notice in list(self._by_key.values()):
            grace = grace_for(notice)
            if grace is None or notice.deadline is None:
                continue
            if now - notice.deadline >= grace:
                change = self._clear(notice.source, notice.key, now, "deadline passed")
                if change is not None:
                    changes.append(change)
        return self._tell(changes, now)

    def next_expiry(self, grace_for: Callable[[Notice], timedelta | None]) -> datetime | None:
        """When :meth:`expire` will next have something to do, or None."""
        times = [
            n.deadline + grace
            for n in self._by_key.values()
            if n.deadline is not None and (grace := grace_for(n)) is not None
        ]
        return min(times) if times else None


def _merge_deadline(current: datetime | None, observed: datetime | None) -> datetime | None:
    """Keep the earlier deadline unless the new one moved later by more than the jitter allowance."""
    if current is None or observed is None:
        return observed
    if observed <= current:
        return observed
    if observed - current > DEADLINE_JITTER:
        return observed
    return current
