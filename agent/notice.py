"""Notices, events and the notice board: the pure core that decides what clients are told.

A *source* reports :class:`Observation` values keyed by its own stable key; the :class:`NoticeBoard` turns
them into :class:`Notice` values with a stable identity and a lifecycle (new → updated → cleared) and
returns the resulting :class:`Event` values. Nothing here does I/O or reads the clock on its own.
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta, timezone
from typing import Any

from agent.errors import NoticeError

SCHEMA_VERSION = 1

# A deadline that moves later by less than this between two observations is treated as payload jitter (some
# metadata mocks answer "now + 2 min" on every poll): the earlier, safer deadline is kept and no update is sent.
DEADLINE_JITTER = timedelta(seconds=30)


class Kind(str, enum.Enum):
    TERMINATION = "termination"
    REBALANCE = "rebalance"
    MAINTENANCE = "maintenance"
    GPU_FAULT = "gpu_fault"
    GPU_DEGRADED = "gpu_degraded"
    HOST_DEGRADED = "host_degraded"


class Severity(str, enum.Enum):
    INFO = "info"
    WARNING = "warning"
    CRITICAL = "critical"

    @property
    def rank(self) -> int:
        return _SEVERITY_RANK[self]


_SEVERITY_RANK = {Severity.INFO: 0, Severity.WARNING: 1, Severity.CRITICAL: 2}

DEFAULT_SEVERITY: Mapping[Kind, Severity] = {
    Kind.TERMINATION: Severity.CRITICAL,
    Kind.REBALANCE: Severity.WARNING,
    Kind.MAINTENANCE: Severity.WARNING,
    Kind.GPU_FAULT: Severity.CRITICAL,
    Kind.GPU_DEGRADED: Severity.WARNING,
    Kind.HOST_DEGRADED: Severity.WARNING,
}


class EventType(str, enum.Enum):
    SNAPSHOT = "snapshot"
    NOTICE = "notice"
    UPDATE = "update"
    CLEARED = "cleared"
    READY = "ready"


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


def format_time(value: datetime) -> str:
    """RFC 3339 in UTC with millisecond precision and a ``Z`` suffix."""
    if value.tzinfo is None:
        raise ValueError("naive datetime: preemptd only handles timezone-aware UTC times")
    return value.astimezone(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def parse_time(text: str) -> datetime:
    """Parse an RFC 3339 time (``Z`` or an offset) into an aware UTC datetime."""
    if not isinstance(text, str) or not text:
        raise NoticeError(f"expected an RFC 3339 time, got {text!r}")
    candidate = text.strip()
    if candidate.endswith(("Z", "z")):
        candidate = candidate[:-1] + "+00:00"
    try:
        parsed = datetime.fromisoformat(candidate)
    except ValueError as exc:
        raise NoticeError(f"expected an RFC 3339 time, got {text!r}") from exc
    if parsed.tzinfo is None:
        raise NoticeError(f"time {text!r} has no zone; expected UTC ('Z') or an offset")
    return parsed.astimezone(timezone.utc)


def derive_notice_id(source: str, key: str, identity: str) -> str:
    """A notice's id: a readable source prefix and 64 bits of a hash of what identifies the event. The same
    event gets the same id after any restart, also one that lost the state file's last write."""
    digest = hashlib.blake2b("\0".join((source, key, identity)).encode(), digest_size=8).hexdigest()
    return f"{source}-{digest}"


# Where a cloud names its events (Azure Scheduled Events, AWS scheduled maintenance), that name is the
# event's identity; it outlives a reboot of the host.
EVENT_ID_FIELDS = ("EventId", "event_id", "eventId")
# How many (source, key) occurrence counts a board keeps: enough for every GPU and condition of a host.
MAX_OCCURRENCES = 4096


@dataclass(frozen=True)
class Observation:
    """One condition a source sees right now, under a key that is stable for that source.

    ``severity`` defaults to the kind's usual severity. ``detail`` carries the cloud's or the device's own
    fields and is treated as read-only.
    """

    key: str
    kind: Kind
    reason: str
    deadline: datetime | None = None
    severity: Severity | None = None
    detail: Mapping[str, Any] = field(default_factory=dict)
    drill: bool = False
    identity: str | None = None  # the cloud's own name for the event; else taken from ``detail``

    @property
    def event_identity(self) -> str | None:
        if self.identity:
            return self.identity
        for name in EVENT_ID_FIELDS:
            value = self.detail.get(name)
            if isinstance(value, str) and value:
                return value
        return None

    @property
    def effective_severity(self) -> Severity:
        return self.severity if self.severity is not None else DEFAULT_SEVERITY[self.kind]


@dataclass(frozen=True)
class Notice:
    """An active (or just cleared) notice as clients see it."""

    id: str
    kind: Kind
    severity: Severity
    source: str
    key: str
    reason: str
    detected_at: datetime
    updated_at: datetime
    deadline: datetime | None = None
    drill: bool = False
    detail: Mapping[str, Any] = field(default_factory=dict)
    cleared_at: datetime | None = None

    def seconds_left(self, now: datetime) -> float | None:
        if self.deadline is None:
            return None
        return round(max(0.0, (self.deadline - now).total_seconds()), 3)

    def to_json(self, now: datetime) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "id": self.id,
            "kind": self.kind.value,
            "severity": self.severity.value,
            "source": self.source,
            "key": self.key,
            "reason": self.reason,
            "detected_at": format_time(self.detected_at),
            "updated_at": format_time(self.updated_at),
            "deadline": format_time(self.deadline) if self.deadline else None,
            "seconds_left": self.seconds_left(now),
            "drill": self.drill,
            "detail": dict(self.detail),
        }
        if self.cleared_at is not None:
            doc["cleared_at"] = format_time(self.cleared_at)
        return doc

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> Notice:
        """Decode a notice; unknown fields are ignored, missing or wrong required ones raise NoticeError."""
        if not isinstance(doc, Mapping):
            raise NoticeError(f"a notice must be a JSON object, got {type(doc).__name__}")
        try:
            kind = Kind(doc["kind"])
            severity = Severity(doc["severity"])
            notice_id = _require_str(doc, "id")
            source = _require_str(doc, "source")
            reason = _require_str(doc, "reason")
            detected_at = parse_time(doc["detected_at"])
            updated_at = parse_time(doc.get("updated_at") or doc["detected_at"])
        except KeyError as exc:
            raise NoticeError(f"notice is missing the field {exc.args[0]!r}") from exc
        except ValueError as exc:
            raise NoticeError(f"notice has an invalid value: {exc}") from exc
        deadline_text = doc.get("deadline")
        cleared_text = doc.get("cleared_at")
        detail = doc.get("detail") or {}
        if not isinstance(detail, Mapping):
            raise NoticeError("notice field 'detail' must be an object")
        return cls(
            id=notice_id,
            kind=kind,
            severity=severity,
            source=source,
            key=str(doc.get("key") or notice_id),
            reason=reason,
            detected_at=detected_at,
            updated_at=updated_at,
            deadline=parse_time(deadline_text) if deadline_text else None,
            drill=bool(doc.get("drill", False)),
            detail=dict(detail),
            cleared_at=parse_time(cleared_text) if cleared_text else None,
        )


def _require_str(doc: Mapping[str, Any], name: str) -> str:
    value = doc[name]
    if not isinstance(value, str) or not value:
        raise NoticeError(f"notice field {name!r} must be a non-empty string, got {value!r}")
    return value


@dataclass(frozen=True)
class Event:
    """One entry of the event stream. ``seq`` orders events and is the SSE ``id``."""

    seq: int
    type: EventType
    time: datetime
    notice: Notice | None = None
    notices: tuple[Notice, ...] = ()
    data: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self, now: datetime | None = None) -> dict[str, Any]:
        at = now if now is not None else self.time
        doc: dict[str, Any] = {
            "schema": SCHEMA_VERSION,
            "seq": self.seq,
            "type": self.type.value,
            "time": format_time(self.time),
        }
        if self.type is EventType.SNAPSHOT:
            doc["notices"] = [n.to_json(at) for n in self.notices]
        elif self.notice is not None:
            doc["notice"] = self.notice.to_json(at)
        if self.data:
            doc["data"] = dict(self.data)
        return doc

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> Event:
        if not isinstance(doc, Mapping):
            raise NoticeError(f"an event must be a JSON object, got {type(doc).__name__}")
        schema = doc.get("schema")
        if schema != SCHEMA_VERSION:
            raise NoticeError(f"unsupported event schema {schema!r}; this version reads {SCHEMA_VERSION}")
        try:
            event_type = EventType(doc["type"])
            seq = doc["seq"]
            time = parse_time(doc["time"])
        except KeyError as exc:
            raise NoticeError(f"event is missing the field {exc.args[0]!r}") from exc
        except ValueError as exc:
            raise NoticeError(f"event has an invalid value: {exc}") from exc
        if not isinstance(seq, int) or isinstance(seq, bool) or seq < 0:
            raise NoticeError(f"event field 'seq' must be a non-negative integer, got {seq!r}")
        notice_doc = doc.get("notice")
        notices = doc.get("notices") or []
        if not isinstance(notices, list):
            raise NoticeError("event field 'notices' must be a list")
        data = doc.get("data") or {}
        return cls(
            seq=seq,
            type=event_type,
            time=time,
            notice=Notice.from_json(notice_doc) if notice_doc is not None else None,
            notices=tuple(Notice.from_json(n) for n in notices),
            data=dict(data) if isinstance(data, Mapping) else {},
        )


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
    """

    def __init__(self, id_factory: Callable[[str], str] | None = None, scope: str = "") -> None:
        self._id_factory = id_factory
        self._scope = scope
        self._by_key: dict[tuple[str, str], Notice] = {}
        self._occurrences: dict[tuple[str, str], int] = {}

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
            change = self.observe(source, obs, now)
            if change is not None:
                changes.append(change)
        for key in sorted(self.keys_of(source) - seen):
            change = self.clear(source, key, now, "no longer reported")
            if change is not None:
                changes.append(change)
        return changes

    def expire(self, now: datetime, grace_for: Callable[[Notice], timedelta | None]) -> list[Change]:
        """Clear notices whose deadline passed more than ``grace_for(notice)`` ago; ``None`` keeps a notice
        (the agent keeps notices of running sources: the source itself says when they end)."""
        changes: list[Change] = []
        for notice in list(self._by_key.values()):
            grace = grace_for(notice)
            if grace is None or notice.deadline is None:
                continue
            if now - notice.deadline >= grace:
                change = self.clear(notice.source, notice.key, now, "deadline passed")
                if change is not None:
                    changes.append(change)
        return changes

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
