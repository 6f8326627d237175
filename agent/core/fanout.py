"""The one fan-out: every event the agent emits (a notice raised, updated or cleared; a notice ready) goes
out here, in a fixed order: to the SSE subscribers first (the hub: encode once, never wait on a client),
then to the listeners in registration order (the state keeper's sequence lease, the actions component's
reactors, the advisor, the metrics), then to the history record. So no action can delay a client, and the
history holds what the listeners saw. The fan-out listens to the notice board: a change reaches it with no
detour through the agent.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from datetime import datetime
from typing import Any, TypeVar

from agent.core.board import Change
from agent.core.notice import Event, EventType, Notice, Severity, format_time
from agent.core.subscribers import Hub

T = TypeVar("T")


def call_each(listeners: Iterable[Callable[[T], None]], arg: T, log: Any, failed: str) -> None:
    """Call every listener with ``arg``; one that raises is logged as ``failed`` and the rest still run (a
    listener's bug must not keep the event from the others)."""
    for listener in listeners:
        try:
            listener(arg)
        except Exception as exc:
            log.error(failed, listener=repr(listener), error=repr(exc))


def history_record(event: Event) -> dict[str, Any]:
    """The history-log record of an event (``time`` is added by the writer)."""
    if event.type is EventType.READY:
        data = {k: v for k, v in event.data.items() if k != "notice_id"}
        return {"type": "ready", "notice_id": event.data.get("notice_id"), "data": data}
    assert event.notice is not None
    return {"type": event.type.value, "notice": event.notice.to_json(event.time)}


class Fanout:
    def __init__(self, hub: Hub, record: Callable[[dict[str, Any]], None], log: Any) -> None:
        self.hub = hub
        self._log = log
        self._record = record
        self._listeners: list[Callable[[Event], None]] = []

    def on_event(self, listener: Callable[[Event], None]) -> None:
        self._listeners.append(listener)

    def _send(self, event: Event) -> Event:
        """After the hub published ``event``: the listeners, then the history."""
        call_each(self._listeners, event, self._log, "event_listener_failed")
        self._record(history_record(event))
        return event

    def ready(self, notice_id: str, notice: Notice | None, data: Mapping[str, Any], now: datetime) -> Event:
        """A ``ready`` event for a notice (the ready step), through the same path as the board's changes."""
        event = self.hub.publish(EventType.READY, now, notice=notice, data={"notice_id": notice_id, **data})
        self._send(event)
        self._log.info("notice_ready", notice_id=notice_id, **data)
        return event

    def changed(self, changes: list[Change], now: datetime) -> None:
        """The board's listener: each change becomes one event, emitted (as above) and logged once."""
        for change in changes:
            notice = change.notice
            event = self._send(self.hub.publish(change.type, now, notice=notice))
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
