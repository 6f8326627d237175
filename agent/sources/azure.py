"""Azure: Scheduled Events (Preempt, Terminate, Reboot, Redeploy, Freeze) from the instance metadata
service, filtered to this VM, with the ``StartRequests`` acknowledgement and a client-side rate limit.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from email.utils import parsedate_to_datetime
from typing import Any

import structlog

from agent.config import AzureConfig
from agent.core.errors import NoticeError
from agent.core.notice import Kind, Observation, Severity, parse_time, utcnow
from agent.core.ports import AZURE_ACK
from agent.sources.base import Sink, Source
from agent.sources.cloud_http import Backoff, CloudError, MetadataClient, ParseError, run_all, status_error
from agent.sources.cloud_identity import IdentityReader
from agent.sources.clouds import CloudSpec, Lead

log = structlog.get_logger("preemptd.sources.azure")

EVENTS_PATH = "/metadata/scheduledevents"
INSTANCE_PATH = "/metadata/instance"
HEADERS = {"Metadata": "true"}
EVENT_KEY_PREFIX = "scheduledevents/"
# Azure answers 429 above 5 requests per second per VM. Azure counts arrivals and we can only space
# departures, so keep one request of headroom whatever the configuration says.
MAX_REQUESTS_PER_S = 4

_KINDS: Mapping[str, tuple[Kind, Severity]] = {
    "preempt": (Kind.TERMINATION, Severity.CRITICAL),
    "terminate": (Kind.TERMINATION, Severity.CRITICAL),
    "reboot": (Kind.MAINTENANCE, Severity.CRITICAL),
    "redeploy": (Kind.MAINTENANCE, Severity.CRITICAL),
    "freeze": (Kind.MAINTENANCE, Severity.WARNING),
}


@dataclass(frozen=True)
class ScheduledEvents:
    incarnation: int
    observations: tuple[Observation, ...]
    # Events for other VMs of the availability set or scale set, ignored but counted for status.
    ignored: int = 0


# --- pure parsers --------------------------------------------------------------------------------------


def parse_not_before(text: Any) -> datetime | None:
    """``NotBefore``: RFC 1123 (``Mon, 19 Sep 2016 18:29:47 GMT``), ISO 8601 as Microsoft's mock sends it, or
    ``""`` once the event has started (None)."""
    if text is None or (isinstance(text, str) and not text.strip()):
        return None
    if not isinstance(text, str):
        raise ParseError(f"NotBefore: expected a string, got {text!r}")
    value = text.strip()
    if "," in value or value.endswith(("GMT", "UTC")):
        try:
            parsed = parsedate_to_datetime(value)
        except (TypeError, ValueError) as exc:
            raise ParseError(f"NotBefore: {value!r} is not an RFC 1123 time") from exc
        if parsed.tzinfo is None:
            parsed = parsed.replace(tzinfo=timezone.utc)
        return parsed.astimezone(timezone.utc)
    try:
        return parse_time(value)
    except NoticeError:
        pass
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError as exc:
        raise ParseError(f"NotBefore: {value!r} is neither RFC 1123 nor ISO 8601") from exc
    # A zone-less ISO time from a mock: Scheduled Events are in UTC.
    return (parsed if parsed.tzinfo else parsed.replace(tzinfo=timezone.utc)).astimezone(timezone.utc)


# The fields of an event a notice keeps in its detail, as Azure names them.
_DETAIL_KEYS = (
    "EventId",
    "EventType",
    "EventStatus",
    "ResourceType",
    "Resources",
    "NotBefore",
    "Description",
    "EventSource",
    "DurationInSeconds",
)


def parse_scheduled_events(
    body: bytes,
    vm_name: str | None,
    now: datetime,
    known_deadlines: Mapping[str, datetime] | None = None,
) -> ScheduledEvents:
    """The Scheduled Events document. Events whose ``Resources`` do not name ``vm_name`` are another VM's
    (None: the name is unknown, keep them all). ``known_deadlines``: each event's deadline as last read.

    A ``Started`` event is happening now, whatever was scheduled: Azure starts an approved event
    (``StartRequests``) early and then drops its ``NotBefore``. Its deadline is the earlier of the one seen
    while it was scheduled and the time it was first seen started (``now`` on that read; the known deadline
    keeps that time on later reads)."""
    incarnation, events = _parse_document(body)
    known = known_deadlines or {}
    wanted = vm_name.lower() if vm_name else None
    observations: list[Observation] = []
    ignored = 0
    for event in events:
        event_id, resources = _event_identity(event)
        if wanted is not None and resources and wanted not in {str(r).lower() for r in resources}:
            ignored += 1
            continue
        observations.append(_event_observation(event, event_id, incarnation, known, now))
    return ScheduledEvents(incarnation, tuple(observations), ignored)


def _parse_document(body: bytes) -> tuple[int, list[Any]]:
    """The document's ``DocumentIncarnation`` and its ``Events`` array (empty when absent)."""
    try:
        doc = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise ParseError(f"scheduled events: not JSON: {body[:60]!r}") from exc
    if not isinstance(doc, Mapping):
        raise ParseError(f"scheduled events: expected an object, got {doc!r}")
    incarnation = doc.get("DocumentIncarnation", 0)
    events = doc.get("Events")
    if isinstance(incarnation, str) and incarnation.strip().isdigit():
        incarnation = int(incarnation)  # some mocks send it as a string
    if not isinstance(incarnation, int) or isinstance(incarnation, bool):
        raise ParseError(f"scheduled events: DocumentIncarnation must be an integer, got {incarnation!r}")
    if "DocumentIncarnation" not in doc and "Events" not in doc:
        raise ParseError(f"scheduled events: neither DocumentIncarnation nor Events in {body[:60]!r}")
    if events is None:
        events = []
    if not isinstance(events, list):
        raise ParseError(f"scheduled events: Events must be an array, got {events!r}")
    return incarnation, events


def _event_identity(event: Any) -> tuple[str, list[Any]]:
    """An event's ``EventId`` and the ``Resources`` it names (empty: every VM)."""
    if not isinstance(event, Mapping):
        raise ParseError(f"scheduled events: expected event objects, got {event!r}")
    event_id = event.get("EventId")
    if not isinstance(event_id, str) or not event_id:
        raise ParseError(f"scheduled events: event without an EventId: {event!r}")
    resources = event.get("Resources") or []
    if not isinstance(resources, list):
        raise ParseError(f"scheduled events: Resources must be an array in {event_id}")
    return event_id, resources


def _event_observation(
    event: Mapping[str, Any],
    event_id: str,
    incarnation: int,
    known: Mapping[str, datetime],
    now: datetime,
) -> Observation:
    """One of this VM's events as an observation (its deadline as ``parse_scheduled_events`` says)."""
    event_type = str(event.get("EventType") or "")
    kind, severity = _KINDS.get(event_type.lower(), (Kind.MAINTENANCE, Severity.WARNING))
    deadline = parse_not_before(event.get("NotBefore"))
    status = str(event.get("EventStatus") or "Scheduled")
    if status.lower() == "started":
        deadline = min(t for t in (deadline, known.get(event_id), now) if t is not None)
    elif deadline is None:
        deadline = known.get(event_id, now)
    detail = {k: event[k] for k in _DETAIL_KEYS if k in event}
    detail["DocumentIncarnation"] = incarnation
    return Observation(
        key=EVENT_KEY_PREFIX + event_id,
        kind=kind,
        severity=severity,
        reason=f"Azure scheduled event {event_type or 'unknown'} ({status.lower()})",
        deadline=deadline,
        detail=detail,
    )


def parse_instance(body: bytes) -> dict[str, str]:
    """``/metadata/instance``: the fields of ``compute`` that identify this VM."""
    try:
        doc = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise ParseError(f"instance metadata: not JSON: {body[:60]!r}") from exc
    compute = doc.get("compute") if isinstance(doc, Mapping) else None
    if not isinstance(compute, Mapping) or not isinstance(compute.get("name"), str) or not compute["name"]:
        raise ParseError("instance metadata: no compute.name")
    fields = {"name": "name", "vmId": "vm_id", "vmSize": "vm_size", "location": "location", "zone": "zone"}
    identity = {
        ours: str(compute[theirs]) for theirs, ours in fields.items() if compute.get(theirs) is not None
    }
    identity["priority"] = str(compute.get("priority") or "Regular")
    if compute.get("placementGroupId"):  # a scale set's placement group; "" outside one
        identity["placement_group_id"] = str(compute["placementGroupId"])
    return identity


# --- the source ----------------------------------------------------------------------------------------


class RateLimiter:
    """At most ``limit`` requests in any ``window_s`` (a sliding window over the last request times)."""

    def __init__(self, limit: int, window_s: float = 1.0) -> None:
        self.limit = limit
        self.window_s = window_s
        self._times: deque[float] = deque(maxlen=limit)
        self._lock = asyncio.Lock()

    async def acquire(self) -> None:
        async with self._lock:
            if len(self._times) == self.limit:
                wait = self._times[0] + self.window_s - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
            self._times.append(time.monotonic())


class AzureSource(Source):
    """Polls Scheduled Events every ``poll_interval_s`` (1 s by default, as Microsoft advises); reads this VM's
    identity (``/metadata/instance``) beside it, on its own schedule (:class:`IdentityReader`)."""

    name = "azure"

    def __init__(self, config: AzureConfig) -> None:
        self.config = config
        self._client = MetadataClient(config.endpoint, config.timeout_s, headers=HEADERS)
        self._limiter = RateLimiter(MAX_REQUESTS_PER_S, 1.0)
        self.vm_name: str | None = config.vm_name or None
        self._identity = IdentityReader(self.name, "azure", self._read_identity, config.backoff_max_s)
        self._incarnation: int | None = None
        self._deadlines: dict[str, datetime] = {}
        self._acknowledged: set[str] = set()
        self._ignored = 0
        self._held: set[str] = set()  # events not acknowledged for want of this VM's name (logged once)
        # The next Scheduled Events call may be the one that enables the service (after boot, or after a
        # server error): it gets first_call_timeout_s.
        self.warming_up = True

    @property
    def acknowledge_blocked(self) -> str | None:
        """Why no event may be acknowledged now, or None. Without this VM's name the events are not
        filtered, and a StartRequests lets an event proceed for every VM it lists, not only this one."""
        if self.vm_name:
            return None
        why = "this VM's name is unknown (set azure.vm_name, or let instance metadata answer"
        if self._identity.error:
            why += f"; it said: {self._identity.error}"
        return why + "): acknowledging could start another VM's event"

    def capabilities(self) -> Mapping[str, Callable[..., Any]]:
        return {AZURE_ACK: self.acknowledge}

    def status(self) -> Mapping[str, Any]:
        return {
            "endpoint": self.config.endpoint,
            "vm_name": self.vm_name,
            "document_incarnation": self._incarnation,
            "ignored_events": self._ignored,
            "acknowledged": sorted(self._acknowledged),
            "acknowledge_blocked": self.acknowledge_blocked,
            "warming_up": self.warming_up,
            "identity": self._identity.status(),
        }

    async def _request(
        self,
        method: str,
        path: str,
        api_version: str,
        json_body: Any = None,
        timeout_s: float | None = None,
    ) -> bytes:
        await self._limiter.acquire()
        reply = await self._client.request(
            method, path, params={"api-version": api_version}, json_body=json_body, timeout_s=timeout_s
        )
        if reply.status != 200:
            raise status_error(method, f"{self.config.endpoint}{path}?api-version={api_version}", reply)
        return reply.body

    async def acknowledge(self, event_id: str) -> None:
        """Tell Azure this VM is ready for ``event_id`` to start now (``StartRequests``). This shortens the
        notice window, so only call it once the workload is safe. Raises CloudError if Azure refuses, or
        without sending anything while this VM's name is unknown (:attr:`acknowledge_blocked`)."""
        blocked = self.acknowledge_blocked
        if blocked is not None:
            raise CloudError(f"not acknowledging Azure event {event_id}: {blocked}")
        body = {"StartRequests": [{"EventId": event_id}]}
        await self._request("POST", EVENTS_PATH, self.config.api_version, json_body=body)
        self._acknowledged.add(event_id)
        log.info("azure_event_acknowledged", source=self.name, event_id=event_id)

    async def _read_identity(self) -> dict[str, str]:
        identity = parse_instance(await self._request("GET", INSTANCE_PATH, self.config.instance_api_version))
        if self.vm_name is None:
            self.vm_name = identity["name"]
        return identity

    async def poll_once(self, sink: Sink) -> ScheduledEvents:
        timeout = max(self.config.timeout_s, self.config.first_call_timeout_s) if self.warming_up else None
        try:
            body = await self._request("GET", EVENTS_PATH, self.config.api_version, timeout_s=timeout)
        except CloudError as exc:
            if exc.status is not None and exc.status >= 500:
                self.warming_up = True
            raise
        self.warming_up = False
        events = parse_scheduled_events(body, self.vm_name, utcnow(), self._deadlines)
        self._deadlines = {
            obs.key[len(EVENT_KEY_PREFIX) :]: obs.deadline for obs in events.observations if obs.deadline
        }
        self._incarnation = events.incarnation
        self._ignored = events.ignored
        # Level-triggered: an event that disappears from the document is over (there is no Completed).
        sink.replace(events.observations)
        return events

    async def _acknowledge_new(self, events: ScheduledEvents) -> None:
        if self.acknowledge_blocked is not None:
            held = [obs.key[len(EVENT_KEY_PREFIX) :] for obs in events.observations]
            fresh = [event_id for event_id in held if event_id not in self._held]
            if fresh:
                log.warning(
                    "azure_acknowledge_blocked", source=self.name, events=fresh, why=self.acknowledge_blocked
                )
            self._held.update(fresh)
            return
        for obs in events.observations:
            event_id = obs.key[len(EVENT_KEY_PREFIX) :]
            if event_id not in self._acknowledged and obs.detail.get("EventStatus") != "Started":
                await self.acknowledge(event_id)

    async def run(self, sink: Sink) -> None:
        try:
            await run_all([self._poll_events(sink), self._identity.run(sink)])
        finally:
            await self._client.close()

    async def _poll_events(self, sink: Sink) -> None:
        """The events poll: its health and cadence are the events read's alone. The identity read fails on
        its own (``identity`` in status): with ``azure.vm_name`` set it only labels the instance, and
        without it the events are not filtered, a peer's false alarm being better than a missed preemption.
        """
        if self.vm_name is None:
            # One bounded request: without it the first poll would raise peers' events only to clear them.
            await self._identity.attempted.wait()
        backoff = Backoff(self.config.poll_interval_s, self.config.backoff_max_s)
        interval = max(self.config.poll_interval_s, 1.0 / MAX_REQUESTS_PER_S)
        next_tick = time.monotonic()
        while True:
            try:
                events = await self.poll_once(sink)
                if self.config.acknowledge == "immediate":
                    await self._acknowledge_new(events)
            except CloudError as exc:
                sink.error(str(exc), endpoint=self.config.endpoint, status=exc.status)
                next_tick = time.monotonic() + backoff.next_delay(exc.retry_after_s)
            else:
                backoff.reset()
                sink.ok(
                    endpoint=self.config.endpoint,
                    document_incarnation=self._incarnation,
                    vm_name=self.vm_name,
                )
                next_tick = max(next_tick + interval, time.monotonic())
            await asyncio.sleep(max(0.0, next_tick - time.monotonic()))


# Every Azure VM's chassis asset tag (Microsoft's documented way to tell Azure from other Hyper-V hosts).
AZURE_ASSET_TAG = "7783-7084-3265-9085-8269-3286-77"


def names_azure(dmi: Mapping[str, str]) -> bool:
    """Pure: whether the DMI strings name Azure."""
    return dmi.get("chassis_asset_tag", "") == AZURE_ASSET_TAG


async def probe(config: AzureConfig, timeout_s: float) -> bool:
    """The instance document, a JSON object with a ``compute`` object."""
    async with MetadataClient(config.endpoint, timeout_s) as client:
        reply = await client.request(
            "GET",
            "/metadata/instance",
            headers={"Metadata": "true"},
            params={"api-version": config.instance_api_version},
        )
        if reply.status != 200:
            return False
        try:
            doc = json.loads(reply.body)
        except ValueError:
            return False
        return isinstance(doc, dict) and isinstance(doc.get("compute"), dict)


LEADS = (
    Lead("termination", 30.0, "azure: Scheduled Events Preempt, at least 30 s (best effort)", fixed=True),
    Lead(
        "maintenance",
        300.0,
        "azure: Scheduled Events Terminate at least 5 min (Redeploy 10, Reboot/Freeze 15)",
    ),
)

CLOUD = CloudSpec(
    "azure",
    AzureConfig,
    names_azure,
    probe,
    AzureSource,
    simulator="agent.simulate.azure:AzureSimulator",
    rank=30,
    leads=lambda _table: LEADS,
    about="Microsoft Azure: IMDS Scheduled Events",
)
