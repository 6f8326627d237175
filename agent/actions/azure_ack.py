"""The Azure acknowledgement (reactor ``azure_acknowledgement``): tells Azure's Scheduled Events that the host
may go (``StartRequests`` with the event's ``EventId``), once per notice, at ``ready``, at the notice itself,
or never (``actions.ready.azure_acknowledge``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from agent.actions.common import OwnedTasks, Recent, log
from agent.core.notice import Event, EventType, Notice, format_time, utcnow
from agent.core.tasks import TaskSet

EVENT_ID_KEYS = ("EventId", "event_id", "eventId")


def azure_event_id(notice: Notice) -> str | None:
    for key in EVENT_ID_KEYS:
        value = notice.detail.get(key)
        if isinstance(value, str) and value:
            return value
    return None


Acknowledge = Callable[[str], Any]


class AzureAcknowledger(OwnedTasks):
    """Sends ``StartRequests`` once per notice, through the ``azure_ack`` capability (``ack``: returns it,
    or None when no Azure source offers it now) or a source object's ``acknowledge(event_id)``. A
    :class:`agent.core.ports.Reactor` named ``azure_acknowledgement``."""

    name = "azure_acknowledgement"

    def __init__(
        self,
        mode: str,
        *,
        source: Callable[[str], Any] | None = None,
        ack: Callable[[], Acknowledge | None] | None = None,
        tasks: TaskSet,
        recent: Recent,
    ) -> None:
        self.mode = mode
        self._source = source
        self._ack = ack
        self._tasks = tasks
        self.recent = self._recent = recent
        self._done: set[str] = set()

    def status(self) -> dict[str, Any]:
        return {"mode": self.mode, "running": len(self._tasks), "acknowledged": len(self._done)}

    def carry_over(self, previous: object) -> None:
        if isinstance(previous, AzureAcknowledger):
            self._done |= previous._done

    def _acknowledger(self, source_name: str) -> Acknowledge | None:
        if self._ack is not None:
            return self._ack()
        source = self._source(source_name) if self._source is not None else None
        method = getattr(source, "acknowledge", None)
        return method if callable(method) else None

    def handle(self, event: Event, notice: Notice | None = None) -> None:
        notice = notice or event.notice
        # "cloud" is the source that found Azure by probing rather than by DMI; its notices carry EventIds.
        if notice is None or notice.source not in ("azure", "cloud") or self.mode == "never":
            return
        if notice.source == "cloud" and azure_event_id(notice) is None:
            return
        wanted = EventType.READY if self.mode == "on_ready" else EventType.NOTICE
        if event.type is not wanted or notice.id in self._done:
            return
        self._done.add(notice.id)
        self._tasks.spawn(self._acknowledge(notice), f"azure-ack:{notice.id}")

    async def _acknowledge(self, notice: Notice) -> None:
        event_id = azure_event_id(notice)
        record: dict[str, Any] = {"at": format_time(utcnow()), "notice_id": notice.id, "event_id": event_id}
        acknowledge = self._acknowledger(notice.source)
        if notice.drill:
            record["outcome"] = "skipped_drill"
        elif event_id is None:
            record.update(outcome="failed", error="the notice carries no Azure EventId")
        elif acknowledge is None:
            record.update(outcome="failed", error="no Azure source with acknowledge() is running")
        else:
            try:
                result = acknowledge(event_id)
                if inspect.isawaitable(result):
                    await result
                record["outcome"] = "sent"
            except Exception as exc:
                record.update(outcome="failed", error=f"{type(exc).__name__}: {exc}")
        self._recent.add(record)
        fields = {k: v for k, v in record.items() if k != "at"}
        if record["outcome"] == "failed":
            log.warning("azure_acknowledge_failed", **fields)
        else:
            log.info("azure_acknowledge", **fields)
