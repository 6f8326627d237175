"""Notices and events: the pure value types that decide what clients are told, and the time helpers.

A *source* reports :class:`Observation` values keyed by its own stable key; the notice board
(:mod:`agent.core.board`) turns them into :class:`Notice` values with a stable identity and a lifecycle (new →
updated → cleared), and each change goes out as an :class:`Event`. Nothing here does I/O or reads the clock
on its own.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from agent.core.errors import NoticeError

SCHEMA_VERSION = 1


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


# RFC 3339 allows a fraction of a second of any length ("…:00.5Z", Go's "…:00.123456789Z"); Python 3.10's
# datetime.fromisoformat takes exactly 3 or 6 digits, 3.11's any number (cut to microseconds). Padded or cut
# to 6 digits first, a time reads the same on both.
_FRACTION = re.compile(r"(?<=:[0-9][0-9])\.([0-9]+)")


def parse_time(text: str) -> datetime:
    """Parse an RFC 3339 time (``Z`` or an offset) into an aware UTC datetime."""
    if not isinstance(text, str) or not text:
        raise NoticeError(f"expected an RFC 3339 time, got {text!r}")
    candidate = text.strip()
    if candidate.endswith(("Z", "z")):
        candidate = candidate[:-1] + "+00:00"
    candidate = _FRACTION.sub(lambda m: "." + m.group(1)[:6].ljust(6, "0"), candidate, count=1)
    try:
        parsed = datetime.fromisoformat(candidate)
    except ValueError as exc:
        raise NoticeError(f"expected an RFC 3339 time, got {text!r}") from exc
    if parsed.tzinfo is None:
        raise NoticeError(f"time {text!r} has no zone; expected UTC ('Z') or an offset")
    return parsed.astimezone(timezone.utc)


# Where a cloud names its events (Azure Scheduled Events, AWS scheduled maintenance), that name is the
# event's identity; it outlives a reboot of the host.
EVENT_ID_FIELDS = ("EventId", "event_id", "eventId")


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
