"""What a training process knows about the agent's notices: a lenient decoder for event JSON and a pure state
machine that folds events into the set of active notices and the pending checkpoint triggers.

No I/O and no clock reads of its own, so the threaded and the asyncio watcher share it and it is tested
without sockets. Decoding is deliberately forgiving (unknown kinds, severities and fields are kept or
ignored, never fatal): the contract lets the agent add to it without bumping the version.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from agent.core.errors import NoticeError
from agent.core.notice import parse_time as parse_rfc3339

NOTICE = "notice"
UPDATE = "update"
CLEARED = "cleared"
SNAPSHOT = "snapshot"
READY = "ready"

# Notices that mean "this host is going away or breaking": a checkpoint is worth taking now.
DEFAULT_TRIGGER_KINDS = frozenset({"termination", "maintenance", "rebalance", "gpu_fault"})
_SEVERITY_RANK = {"info": 0, "warning": 1, "critical": 2}


@dataclass(frozen=True)
class Notice:
    """One notice as a client sees it (``deadline`` is an aware UTC datetime or None)."""

    id: str
    kind: str
    severity: str
    source: str = ""
    reason: str = ""
    deadline: datetime | None = None
    drill: bool = False
    detail: Mapping[str, Any] = field(default_factory=dict)

    def time_left(self, now: datetime) -> float | None:
        """Seconds until the deadline (never negative), or None when the notice has none."""
        if self.deadline is None:
            return None
        return max(0.0, (self.deadline - now).total_seconds())


@dataclass(frozen=True)
class Trigger:
    """Why a checkpoint should be taken now: a notice from the agent or a signal to the process."""

    reason: str  # "notice" or "signal"
    at: datetime
    notice: Notice | None = None
    signum: int | None = None

    @property
    def deadline(self) -> datetime | None:
        return self.notice.deadline if self.notice is not None else None

    @property
    def notice_id(self) -> str | None:
        return self.notice.id if self.notice is not None else None


@dataclass(frozen=True)
class Change:
    """What one event did to the client's view: ``type`` is ``notice``, ``update`` or ``cleared``."""

    type: str
    notice: Notice


@dataclass(frozen=True)
class TriggerPolicy:
    """Which notices call for a checkpoint: by kind (empty means every kind), minimum severity, drills."""

    kinds: frozenset[str] = DEFAULT_TRIGGER_KINDS
    min_severity: str = "info"
    drills: bool = True

    def matches(self, notice: Notice) -> bool:
        if self.kinds and notice.kind not in self.kinds:
            return False
        if _SEVERITY_RANK.get(notice.severity, 2) < _SEVERITY_RANK.get(self.min_severity, 0):
            return False
        return self.drills or not notice.drill


def parse_time(text: Any) -> datetime | None:
    """An RFC 3339 time as an aware UTC datetime; None for null or anything unreadable (the agent's own
    parser, which reads the same times on Python 3.10 as on 3.11)."""
    try:
        return parse_rfc3339(text)
    except NoticeError:
        return None


def parse_notice(doc: Any) -> Notice | None:
    """Decode a notice object; None when it has no usable ``id`` (such a notice cannot be tracked)."""
    if not isinstance(doc, Mapping):
        return None
    notice_id = doc.get("id")
    if not isinstance(notice_id, str) or not notice_id:
        return None
    detail = doc.get("detail")
    return Notice(
        id=notice_id,
        kind=str(doc.get("kind") or "unknown"),
        severity=str(doc.get("severity") or "critical"),
        source=str(doc.get("source") or ""),
        reason=str(doc.get("reason") or ""),
        deadline=parse_time(doc.get("deadline")),
        drill=doc.get("drill") is True,
        detail=dict(detail) if isinstance(detail, Mapping) else {},
    )


def parse_event(data: str) -> Mapping[str, Any] | None:
    """The JSON object of one SSE ``data`` payload, or None when it is not one."""
    try:
        doc = json.loads(data)
    except ValueError:
        return None
    return doc if isinstance(doc, Mapping) else None


class NoticeState:
    """Active notices and pending triggers. Not thread-safe: the watchers guard it with their own lock.

    A trigger is raised once per notice id that the policy matches; :meth:`acknowledge` marks the pending
    triggers handled so one notice causes one emergency checkpoint, however many updates follow. A notice
    whose deadline was already past when the job started (``started_at``; a drill lingers after its
    deadline, a cloud may stay up past it) raises none: the job has nothing to save from before it.
    """

    def __init__(self, policy: TriggerPolicy | None = None, started_at: datetime | None = None) -> None:
        self.policy = policy or TriggerPolicy()
        self.started_at = started_at
        self.notices: dict[str, Notice] = {}
        self.pending: dict[str, Trigger] = {}
        self._handled: set[str] = set()

    def apply(self, event_type: str, doc: Mapping[str, Any], now: datetime) -> list[Change]:
        """Fold one decoded event into the state; returns what changed, in order."""
        if event_type == SNAPSHOT:
            raw = doc.get("notices")
            items = raw if isinstance(raw, list) else []
            return self._snapshot([n for n in map(parse_notice, items) if n is not None], now)
        if event_type not in (NOTICE, UPDATE, CLEARED):
            return []
        notice = parse_notice(doc.get("notice"))
        if notice is None:
            return []
        if event_type == CLEARED:
            return self._clear(notice)
        return [self._raise(notice, now)]

    def _snapshot(self, notices: Iterable[Notice], now: datetime) -> list[Change]:
        current = {n.id: n for n in notices}
        changes = [c for nid, n in list(self.notices.items()) if nid not in current for c in self._clear(n)]
        changes.extend(self._raise(n, now) for n in current.values())
        return changes

    def _raise(self, notice: Notice, now: datetime) -> Change:
        known = notice.id in self.notices
        self.notices[notice.id] = notice
        if notice.id in self.pending:
            self.pending[notice.id] = Trigger("notice", self.pending[notice.id].at, notice=notice)
        elif (
            notice.id not in self._handled and self.policy.matches(notice) and not self._before_start(notice)
        ):
            self.pending[notice.id] = Trigger("notice", now, notice=notice)
        return Change(UPDATE if known else NOTICE, notice)

    def _before_start(self, notice: Notice) -> bool:
        return (
            self.started_at is not None and notice.deadline is not None and notice.deadline < self.started_at
        )

    def _clear(self, notice: Notice) -> list[Change]:
        previous = self.notices.pop(notice.id, None)
        self.pending.pop(notice.id, None)
        self._handled.discard(notice.id)
        return [Change(CLEARED, notice)] if previous is not None else []

    def acknowledge(self) -> None:
        """The pending triggers were acted on (a checkpoint was taken)."""
        self._handled.update(self.pending)
        self.pending.clear()

    def mark_handled(self, notice_ids: Iterable[str]) -> None:
        """Treat these notices as acknowledged, whether or not they are active yet."""
        for notice_id in notice_ids:
            self._handled.add(notice_id)
            self.pending.pop(notice_id, None)

    def first_trigger(self) -> Trigger | None:
        """The most urgent pending trigger: earliest deadline first, then the oldest."""
        if not self.pending:
            return None
        far = datetime.max.replace(tzinfo=timezone.utc)
        return min(self.pending.values(), key=lambda t: (t.deadline or far, t.at))

    def most_urgent(self) -> Notice | None:
        """The active notice that matters most: severity, then earliest deadline."""
        if not self.notices:
            return None
        far = datetime.max.replace(tzinfo=timezone.utc)
        return min(
            self.notices.values(),
            key=lambda n: (-_SEVERITY_RANK.get(n.severity, 2), n.deadline or far, n.id),
        )

    def earliest_deadline(self, triggering_only: bool = True) -> datetime | None:
        deadlines = [
            n.deadline
            for n in self.notices.values()
            if n.deadline is not None and (not triggering_only or self.policy.matches(n))
        ]
        return min(deadlines) if deadlines else None
