"""A simulated Azure IMDS: Scheduled Events (``DocumentIncarnation``, the event lifecycle Scheduled → Started
→ gone, ``StartRequests`` starting an event at once), instance metadata (or its 404, as Microsoft's Scheduled
Events mock serves it, or IMDS's 429), the ``Metadata: true`` and ``api-version`` rules and the
5-requests-per-second limit."""

from __future__ import annotations

import json
import time
import uuid
from collections import deque
from collections.abc import Mapping
from datetime import datetime, timedelta
from email.utils import format_datetime
from typing import Any, ClassVar

from aiohttp import web

from agent.core.notice import utcnow
from agent.simulate.base import Scenario, Simulator, in_s, scenario
from agent.simulate.faults import SimulatorError

EVENTS_PATH = "/metadata/scheduledevents"
# As Microsoft lists them for Scheduled Events. Both tables of versions keep several a line (`# fmt: skip`):
# one date a line would spread 36 dates over a screen for no reader's gain.
EVENT_API_VERSIONS = (
    "2017-03-01", "2017-08-01", "2017-11-01", "2019-01-01", "2019-04-01", "2019-08-01", "2020-07-01",
)  # fmt: skip
INSTANCE_API_VERSIONS = (
    "2017-03-01", "2017-04-02", "2017-08-01", "2017-12-01", "2018-02-01", "2018-04-02", "2018-10-01",
    "2019-02-01", "2019-03-11", "2019-04-30", "2019-06-01", "2019-06-04", "2019-08-01", "2019-08-15",
    "2019-11-01", "2020-06-01", "2020-07-15", "2020-09-01", "2020-10-01", "2020-12-01", "2021-01-01",
    "2021-02-01", "2021-03-01", "2021-05-01", "2021-10-01", "2021-11-01", "2021-11-15", "2021-12-13",
    "2022-02-01", "2022-03-01", "2022-07-01", "2022-08-01", "2022-11-01", "2023-07-01", "2023-11-15",
    "2024-03-15",
)  # fmt: skip
EVENT_TYPES = ("Freeze", "Reboot", "Redeploy", "Preempt", "Terminate")
# Minimum notice per type (seconds) when an event does not say.
DEFAULT_NOTICE_S = {"Preempt": 30, "Terminate": 300, "Redeploy": 600, "Reboot": 900, "Freeze": 900}
RATE_LIMIT = 5  # requests per second per VM
# What /metadata/instance answers: the document; 404, as a mock that serves only Scheduled Events does
# (Microsoft's own); 429, IMDS's throttling answer.
INSTANCE_ANSWERS = ("serve", "absent", "throttled")
NEWEST = ["2021-12-13", "2021-11-15", "2021-11-01"]


def _not_found() -> web.Response:
    return web.json_response({"error": "Not found"}, status=404)


def _too_many() -> web.Response:
    return web.json_response({"error": "Too many requests"}, status=429)


def _bad(message: str, newest: bool = False) -> web.Response:
    doc: dict[str, Any] = {"error": message}
    if newest:
        doc["newest-versions"] = NEWEST
    return web.json_response(doc, status=400)


class AzureSimulator(Simulator):
    cloud = "azure"
    client_hint = "AZURE_POD_IDENTITY_AUTHORITY_HOST={url} (managed identity)"
    scenarios: ClassVar[Mapping[str, Scenario]] = dict(
        [
            scenario("quiet", "no events; identity only"),
            scenario(
                "preempt",
                "this Spot VM is evicted after 30 s",
                (0, {"type": "event", "event_type": "Preempt"}),
            ),
            scenario(
                "terminate",
                "a Terminate with the 5-minute minimum",
                (0, {"type": "event", "event_type": "Terminate"}),
            ),
            scenario(
                "reboot", "a platform Reboot in 15 minutes", (0, {"type": "event", "event_type": "Reboot"})
            ),
            scenario(
                "redeploy", "a Redeploy in 10 minutes", (0, {"type": "event", "event_type": "Redeploy"})
            ),
            scenario(
                "freeze", "a short Freeze in 15 minutes", (0, {"type": "event", "event_type": "Freeze"})
            ),
            scenario(
                "peer-preempt",
                "a Preempt for another VM of the scale set, then one for this VM",
                (0, {"type": "event", "event_type": "Preempt", "resources": ["peer-vm-1"]}),
                (10, {"type": "event", "event_type": "Preempt"}),
            ),
            scenario(
                "preempt-started",
                "a Preempt that starts after 10 s and is gone 5 s later",
                (0, {"type": "event", "event_type": "Preempt", "in_s": 10, "duration_s": 5}),
            ),
        ]
    )

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        seed: int | None = None,
        vm_name: str = "gpu-trainer-0",
        not_before_format: str = "rfc1123",
        rate_limit: int = RATE_LIMIT,
        instance: str = "serve",
        priority: str = "Spot",
        placement_group_id: str = "",
    ) -> None:
        """``not_before_format``: ``"rfc1123"`` as Azure sends it, or ``"iso"`` as Microsoft's mock does.
        ``instance``: what ``/metadata/instance`` answers (:data:`INSTANCE_ANSWERS`). ``priority``: Spot,
        Regular or Low; ``placement_group_id``: the scale set's placement group, ``""`` outside a scale set."""
        if not_before_format not in ("rfc1123", "iso"):
            raise SimulatorError('not_before_format must be "rfc1123" or "iso"')
        self.vm_name = vm_name
        self.priority = priority
        self.placement_group_id = placement_group_id
        self.not_before_format = not_before_format
        self.rate_limit = rate_limit
        self.instance = self._instance_answer(instance)
        self.acknowledged: list[str] = []
        self.throttled = 0
        self._recent: dict[str, deque[float]] = {}
        super().__init__(host, port, seed)
        self.reset_state()

    def reset_state(self) -> None:
        self.incarnation = getattr(self, "incarnation", 0) + 1
        self.events: list[dict[str, Any]] = []

    def state(self) -> dict[str, Any]:
        return {
            "document": self.document(),
            "acknowledged": list(self.acknowledged),
            "throttled": self.throttled,
            "vm_name": self.vm_name,
            "instance": self.instance,
        }

    @staticmethod
    def _instance_answer(answer: Any) -> str:
        if answer not in INSTANCE_ANSWERS:
            raise SimulatorError(
                f"instance answer must be one of {', '.join(INSTANCE_ANSWERS)}, got {answer!r}"
            )
        return str(answer)

    # --- event lifecycle ---

    def _bump(self) -> None:
        self.incarnation += 1

    def _advance(self, now: datetime) -> None:
        """Scheduled events start at NotBefore; started ones are gone after their duration."""
        remaining = []
        changed = False
        for event in self.events:
            if event["EventStatus"] == "Scheduled" and event["_not_before"] <= now:
                self._start(event, now)
                changed = True
            if event["EventStatus"] == "Started" and event["_ends"] <= now:
                changed = True
                continue
            remaining.append(event)
        self.events = remaining
        if changed:
            self._bump()

    @staticmethod
    def _start(event: dict[str, Any], now: datetime) -> None:
        event["EventStatus"] = "Started"
        duration = max(1, int(event["DurationInSeconds"]) if int(event["DurationInSeconds"]) > 0 else 10)
        event["_ends"] = now + timedelta(seconds=duration)

    def _find(self, event_id: Any) -> dict[str, Any]:
        for event in self.events:
            if event_id in (None, event["EventId"]):
                return event
        raise SimulatorError(f"no scheduled event {event_id!r}")

    def apply(self, event: Mapping[str, Any]) -> None:
        kind = event["type"]
        now = utcnow()
        self._advance(now)
        if kind == "event":
            event_type = event.get("event_type", "Preempt")
            if event_type not in EVENT_TYPES:
                raise SimulatorError(f"event_type must be one of {', '.join(EVENT_TYPES)}")
            resources = event.get("resources", [self.vm_name])
            if not isinstance(resources, list) or not all(isinstance(r, str) for r in resources):
                raise SimulatorError("resources must be a list of VM names")
            duration = event.get("duration_s", -1 if event_type != "Freeze" else 5)
            self.events.append(
                {
                    "EventId": str(event.get("event_id") or str(uuid.uuid4()).upper()),
                    "EventStatus": "Scheduled",
                    "EventType": event_type,
                    "ResourceType": "VirtualMachine",
                    "Resources": resources,
                    "Description": str(
                        event.get("description") or f"Virtual machine {event_type.lower()} event."
                    ),
                    "EventSource": str(event.get("source", "Platform")),
                    "DurationInSeconds": int(duration),
                    "_not_before": now + in_s(event, DEFAULT_NOTICE_S[event_type]),
                }
            )
        elif kind == "start":
            self._start(self._find(event.get("event_id")), now)
        elif kind == "complete":
            target = self._find(event.get("event_id"))
            self.events = [e for e in self.events if e is not target]
        elif kind == "instance":
            self.instance = self._instance_answer(event.get("answer", "serve"))
            return  # not a Scheduled Events change: the incarnation stays
        else:
            raise SimulatorError(
                f"unknown Azure event {kind!r}; expected event, start, complete, instance or reset"
            )
        self._bump()

    def _not_before(self, event: Mapping[str, Any]) -> str:
        if event["EventStatus"] == "Started":
            return ""
        when: datetime = event["_not_before"]
        if self.not_before_format == "iso":
            return when.strftime("%Y-%m-%dT%H:%M:%SZ")
        return format_datetime(when, usegmt=True)

    def document(self) -> dict[str, Any]:
        self._advance(utcnow())
        events = []
        for event in self.events:
            public = {k: v for k, v in event.items() if not k.startswith("_")}
            public["NotBefore"] = self._not_before(event)
            events.append(public)
        return {"DocumentIncarnation": self.incarnation, "Events": events}

    def instance_document(self) -> dict[str, Any]:
        return {
            "compute": {
                "azEnvironment": "AzurePublicCloud",
                "location": "eastus",
                "name": self.vm_name,
                "offer": "ubuntu-hpc",
                "osType": "Linux",
                "placementGroupId": self.placement_group_id,
                "platformFaultDomain": "0",
                "platformUpdateDomain": "0",
                "priority": self.priority,
                "provider": "Microsoft.Compute",
                "publisher": "microsoft-dsvm",
                "resourceGroupName": "training",
                "resourceId": f"/subscriptions/00000000-0000-0000-0000-000000000000/resourceGroups/training/"
                f"providers/Microsoft.Compute/virtualMachines/{self.vm_name}",
                "sku": "2204",
                "subscriptionId": "00000000-0000-0000-0000-000000000000",
                "tags": "",
                "version": "22.04.2024010101",
                "vmId": "02aab8a4-74ef-476e-8182-f6d2ba4166a6",
                "vmScaleSetName": "",
                "vmSize": "Standard_ND96asr_v4",
                "zone": "1",
            },
            "network": {
                "interface": [
                    {
                        "ipv4": {"ipAddress": [{"privateIpAddress": "10.0.0.4", "publicIpAddress": ""}]},
                        "macAddress": "000D3AF806EC",
                    }
                ]
            },
        }

    # --- protocol ---

    def routes(self, router: web.UrlDispatcher) -> None:
        router.add_get(EVENTS_PATH, self._h_events)
        router.add_post(EVENTS_PATH, self._h_start_requests)
        router.add_get("/metadata/instance", self._h_instance)
        router.add_get("/metadata/instance/{tail:.*}", self._h_instance)
        router.add_get("/metadata/identity/oauth2/token", self._h_identity_token)
        router.add_route("*", "/{tail:.*}", self._h_other)

    def _throttled(self, request: web.Request) -> bool:
        now = time.monotonic()
        peer = request.remote or "?"
        recent = self._recent.setdefault(peer, deque())
        while recent and now - recent[0] >= 1.0:
            recent.popleft()
        if len(recent) >= self.rate_limit:
            self.throttled += 1
            return True
        recent.append(now)
        return False

    def _check(self, request: web.Request, versions: tuple[str, ...]) -> web.Response | None:
        if "X-Forwarded-For" in request.headers:
            return _bad("Bad request. Requests with X-Forwarded-For headers are not supported.")
        if request.headers.get("Metadata", "").lower() != "true":
            return _bad("Bad request. Required metadata header not specified")
        version = request.query.get("api-version")
        if not version:
            return _bad(
                "Bad request. api-version was not specified in the request. For more information refer to "
                "aka.ms/azureimds",
                newest=True,
            )
        if version not in versions:
            return _bad(
                "Bad request. api-version is invalid or was not specified in the request. For more "
                "information refer to aka.ms/azureimds",
                newest=True,
            )
        if self._throttled(request):
            return _too_many()
        return None

    async def _h_events(self, request: web.Request) -> web.Response:
        denied = self._check(request, EVENT_API_VERSIONS)
        return denied or web.json_response(self.document())

    async def _h_start_requests(self, request: web.Request) -> web.Response:
        denied = self._check(request, EVENT_API_VERSIONS)
        if denied:
            return denied
        try:
            doc = json.loads(await request.read())
            ids = [item["EventId"] for item in doc["StartRequests"]]
        except (ValueError, KeyError, TypeError):
            return _bad('Bad request. Expected {"StartRequests": [{"EventId": "..."}]}')
        self._advance(utcnow())
        known = {e["EventId"]: e for e in self.events}
        unknown = [i for i in ids if i not in known]
        if unknown:
            return _bad(f"Bad request. Unknown EventId {unknown[0]}")
        for event_id in ids:
            self.acknowledged.append(event_id)
            if known[event_id]["EventStatus"] == "Scheduled":
                self._start(known[event_id], utcnow())
        if ids:
            self._bump()
        return web.Response(status=200)

    async def _h_instance(self, request: web.Request) -> web.Response:
        denied = self._check(request, INSTANCE_API_VERSIONS)
        if denied:
            return denied
        if self.instance == "absent":
            return _not_found()
        if self.instance == "throttled":
            return _too_many()
        node: Any = self.instance_document()
        for part in [p for p in request.match_info.get("tail", "").split("/") if p]:
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                return _not_found()
        if request.query.get("format") == "text":
            if isinstance(node, (dict, list)):
                return _bad("Bad request. format=text is only for leaf values")
            return web.Response(text=str(node), content_type="text/plain")
        return web.json_response(node)

    async def _h_identity_token(self, request: web.Request) -> web.Response:
        """Managed identity, for SDKs (azure-identity) pointed here with AZURE_POD_IDENTITY_AUTHORITY_HOST."""
        denied = self._check(request, INSTANCE_API_VERSIONS)
        if denied:
            return denied
        resource = request.query.get("resource")
        if not resource:
            return _bad("Required audience parameter not specified")
        now = int(time.time())
        return web.json_response(
            {
                "access_token": "eyJ0eXAiOiJKV1QiLCJhbGciOiJub25lIn0.simulated.",
                "client_id": "00000000-0000-0000-0000-000000000001",
                "expires_in": "86399",
                "expires_on": str(now + 86399),
                "ext_expires_in": "86399",
                "not_before": str(now),
                "resource": resource,
                "token_type": "Bearer",
            }
        )

    async def _h_other(self, request: web.Request) -> web.Response:
        return _not_found()
