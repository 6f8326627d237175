"""The one fan-out: every event the agent emits (a notice raised, updated or cleared; a notice ready) goes
out here, in a fixed order: to the SSE subscribers first (the hub: encode once, never wait on a client),
then to the listeners (the actions component's reactors, the advisor), then to the history record. So no
action can delay a client, and the history holds what the listeners saw.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any

from agent.core.board import Change
from agent.core.notice import Event, EventType, Notice, Severity, format_time
from agent.core.subscribers import Hub


def history_record(event: Event) -> dict[str, Any]:
    """The history-log record of an event (``time`` is added by the writer)."""
    if event.type is EventType.READY:
        data = {k: v for k, v in event.data.items() if k != "notice_id"}
        return {"type": "ready", "notice_id": event.data.get("notice_id"), "data": data}
    assert event.notice is not None
    return {"type": event.type.value, "notice": event.notice.to_json(event.time)}


class Fanout:
    def __init__(
        self,
        hub: Hub,
        record: Callable[[dict[str, Any]], None],
        on_error: Callable[[Callable[[Event], None], Exception], None],
        log: Any,
    ) -> None:
        self.hub = hub
        self._log = log
        self._record = record
        self._on_error = on_error
        self._listeners: list[Callable[[Event], None]] = []

    def add(self, listener: Callable[[Event], None]) -> None:
        self._listeners.append(listener)

    def emit(
        self,
        event_type: EventType,
        now: datetime,
        notice: Notice | None = None,
        data: Mapping[str, Any] | None = None,
    ) -> Event:
        event = self.hub.publish(event_type, now, notice=notice, data=data)
        for listener in self._listeners:
            try:
                listener(event)
            except Exception as exc:  # a listener's bug must not stop the event reaching the others
                self._on_error(listener, exc)
        self._record(history_record(event))
        return event

    def apply(self, changes: list[Change], now: datetime) -> None:
        """Board changes become events here: each is emitted (as above) and logged once."""
        for change in changes:
            event = self.emit(change.type, now, notice=change.notice)
            notice = change.notice
            name = {EventType.NOTICE: "notice_raised", EventType.UPDATE: "notice_updated"}.get(
                change.type, "notice_cleared"
            )
            critical = change.type is not EventType.CLEARED and notice.severity is Severity.CRITICAL
            (self._log.warning if critical else self._log.info)(
                name,
                notice_id=notice.id,
                kind=notice.kind.value,
                severity=notice.severity.value,
                source=notice.source,
                reason=notice.reason,
                deadline=format_time(notice.deadline) if notice.deadline else None,
                seconds_left=notice.seconds_left(event.time),
                drill=notice.drill,
                seq=event.seq,
                subscribers=len(self.hub),
            )
