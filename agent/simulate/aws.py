"""A simulated EC2 instance metadata service (IMDSv2): token PUT with TTL, the spot, rebalance, scheduled
maintenance and Auto Scaling lifecycle paths, identity, and IMDS's status codes and bodies."""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Mapping
from datetime import datetime, timedelta
from typing import Any, ClassVar

from aiohttp import web

from agent.core.notice import utcnow
from agent.simulate.base import Scenario, Simulator, in_s, listing, raw, rfc3339_seconds, scenario
from agent.simulate.faults import SimulatorError

TOKEN_TTL_HEADER = "X-aws-ec2-metadata-token-ttl-seconds"
TOKEN_HEADER = "X-aws-ec2-metadata-token"
MAX_TTL = 21600
_MONTHS = ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec")
SPOT_ACTIONS = ("terminate", "stop", "hibernate")
MAINTENANCE_CODES = (
    "instance-reboot",
    "system-reboot",
    "system-maintenance",
    "instance-retirement",
    "instance-stop",
)
VERSIONS = ("1.0", "2007-01-19", "2009-04-04", "2016-09-02", "2021-03-23", "latest")


def maintenance_time(value: datetime) -> str:
    """``21 Jan 2019 09:00:43 GMT``: the scheduled-events layout, day without a leading zero."""
    return f"{value.day} {_MONTHS[value.month - 1]} {value.year} {value:%H:%M:%S} GMT"


def _xhtml(status: int, reason: str) -> str:
    return (
        '<?xml version="1.0" encoding="iso-8859-1"?>\n'
        '<!DOCTYPE html PUBLIC "-//W3C//DTD XHTML 1.0 Transitional//EN"\n'
        '\t"http://www.w3.org/TR/xhtml1/DTD/xhtml1-transitional.dtd">\n'
        '<html xmlns="http://www.w3.org/1999/xhtml" xml:lang="en" lang="en">\n'
        f" <head>\n  <title>{status} - {reason}</title>\n </head>\n"
        f" <body>\n  <h1>{status} - {reason}</h1>\n </body>\n</html>\n"
    )


def _error(status: int, reason: str) -> web.Response:
    return raw(_xhtml(status, reason), "text/html", status)


class AwsSimulator(Simulator):
    cloud = "aws"
    client_hint = "AWS_EC2_METADATA_SERVICE_ENDPOINT={url}"
    server_headers: ClassVar[Mapping[str, str]] = {"Server": "EC2ws"}
    scenarios: ClassVar[Mapping[str, Scenario]] = dict(
        [
            scenario("quiet", "no notices; identity only"),
            scenario(
                "spot-termination",
                "a spot interruption (terminate) with two minutes of notice",
                (0, {"type": "spot", "action": "terminate", "in_s": 120}),
            ),
            scenario(
                "spot-stop",
                "a spot interruption that stops the instance",
                (0, {"type": "spot", "action": "stop"}),
            ),
            scenario(
                "spot-hibernate",
                "a spot interruption that hibernates at once",
                (0, {"type": "spot", "action": "hibernate", "in_s": 0}),
            ),
            scenario(
                "spot-termination-drifting",
                "a termination whose time is now + 2 min on every request (like the popular mock)",
                (0, {"type": "spot", "action": "terminate", "drift": True}),
            ),
            scenario(
                "rebalance-then-termination",
                "a rebalance recommendation, then a termination 10 s later",
                (0, {"type": "rebalance"}),
                (10, {"type": "spot", "action": "terminate", "in_s": 120}),
            ),
            scenario(
                "maintenance-scheduled-then-canceled",
                "a system-reboot scheduled for tomorrow, canceled 10 s later",
                (0, {"type": "maintenance", "code": "system-reboot", "in_s": 86400}),
                (10, {"type": "maintenance-state", "state": "canceled"}),
            ),
            scenario(
                "asg-terminate",
                "Auto Scaling moves the instance to Terminated",
                (0, {"type": "lifecycle", "state": "InService"}),
                (5, {"type": "lifecycle", "state": "Terminated"}),
            ),
        ]
    )

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        seed: int | None = None,
        imdsv1: bool = False,
        empty_maintenance: str = "[]",
        life_cycle: str = "spot",
        placement_group: str | None = None,
    ) -> None:
        """``imdsv1``: also answer GETs without a token (IMDS "optional"); ``empty_maintenance``: ``"[]"`` or
        ``"404"``, what the scheduled-maintenance path answers when nothing is scheduled. ``life_cycle``:
        ``instance-life-cycle`` (spot, on-demand, scheduled); ``placement_group``: ``placement/group-name``,
        404 when None (an instance outside a placement group)."""
        if empty_maintenance not in ("[]", "404"):
            raise SimulatorError('empty_maintenance must be "[]" or "404"')
        self.imdsv1 = imdsv1
        self.empty_maintenance = empty_maintenance
        self.tokens: dict[str, float] = {}  # token -> monotonic expiry
        self.tokens_issued = 0
        self.unauthorized = 0  # 401 answers
        self.identity = {
            "ami-id": "ami-0abcdef1234567890",
            "instance-id": "i-0123456789abcdef0",
            "instance-type": "p4d.24xlarge",
            "instance-life-cycle": life_cycle,
            "hostname": "ip-10-0-0-12.ec2.internal",
            "local-hostname": "ip-10-0-0-12.ec2.internal",
            "local-ipv4": "10.0.0.12",
            "mac": "0e:12:34:56:78:9a",
            "placement/availability-zone": "us-east-1a",
            "placement/availability-zone-id": "use1-az4",
            "placement/region": "us-east-1",
            "services/domain": "amazonaws.com",
            "services/partition": "aws",
        }
        if placement_group is not None:
            self.identity["placement/group-name"] = placement_group
        super().__init__(host, port, seed)
        self.reset_state()

    def reset_state(self) -> None:
        self.spot: dict[str, Any] | None = None
        self.rebalance: str | None = None
        self.maintenance: list[dict[str, str]] = []
        self.lifecycle: str | None = None

    def expire_tokens(self) -> None:
        self.tokens.clear()

    def state(self) -> dict[str, Any]:
        return {
            "spot": self._spot_doc(),
            "rebalance": self.rebalance,
            "maintenance": self.maintenance,
            "lifecycle": self.lifecycle,
            "tokens": len(self.tokens),
            "tokens_issued": self.tokens_issued,
            "unauthorized": self.unauthorized,
            "imdsv1": self.imdsv1,
        }

    # --- events ---

    def apply(self, event: Mapping[str, Any]) -> None:
        kind = event["type"]
        now = utcnow()
        if kind == "spot":
            action = event.get("action", "terminate")
            # "raw": serve an action AWS does not document (yet), to test how a handler takes it.
            if action not in SPOT_ACTIONS and not (event.get("raw") and isinstance(action, str) and action):
                raise SimulatorError(
                    f'spot action must be one of {", ".join(SPOT_ACTIONS)} (or any text with "raw": true)'
                )
            self.spot = {"action": action, "time": now + in_s(event, 120), "drift": bool(event.get("drift"))}
        elif kind == "spot-clear":
            self.spot = None
        elif kind == "rebalance":
            self.rebalance = rfc3339_seconds(now)
        elif kind == "rebalance-clear":
            self.rebalance = None
        elif kind == "maintenance":
            code = event.get("code", "system-reboot")
            if code not in MAINTENANCE_CODES:
                raise SimulatorError(f"maintenance code must be one of {', '.join(MAINTENANCE_CODES)}")
            start = now + in_s(event, 86400)
            end = start + timedelta(seconds=float(event.get("duration_s", 7200)))
            self.maintenance.append(
                {
                    "Code": code,
                    "Description": str(event.get("description") or f"scheduled {code}"),
                    "EventId": str(event.get("event_id") or f"instance-event-{secrets.token_hex(8)}"),
                    "NotAfter": maintenance_time(end),
                    "NotBefore": maintenance_time(start),
                    "NotBeforeDeadline": maintenance_time(start + timedelta(days=7)),
                    "State": "active",
                }
            )
        elif kind == "maintenance-state":
            state = event.get("state")
            if state not in ("active", "canceled", "completed"):
                raise SimulatorError("maintenance state must be active, canceled or completed")
            target = event.get("event_id")
            matches = [m for m in self.maintenance if target in (None, m["EventId"])]
            if not matches:
                raise SimulatorError(f"no scheduled maintenance event {target!r}")
            matches[-1]["State"] = str(state)
        elif kind == "lifecycle":
            state = event.get("state")
            if state is not None and not isinstance(state, str):
                raise SimulatorError("lifecycle state must be a string or null")
            self.lifecycle = state
        else:
            raise SimulatorError(
                f"unknown AWS event {kind!r}; expected spot, spot-clear, rebalance, rebalance-clear, "
                "maintenance, maintenance-state, lifecycle or reset"
            )

    # --- protocol ---

    def routes(self, router: web.UrlDispatcher) -> None:
        router.add_route("PUT", "/{tail:.*}", self._h_put)
        router.add_get("/latest/api/token", self._h_not_allowed)
        router.add_get("/", self._h_root)
        router.add_get("/{version}", self._h_version)
        router.add_get("/{version}/", self._h_version)
        router.add_get("/{version}/meta-data", self._h_meta)
        router.add_get("/{version}/meta-data/{tail:.*}", self._h_meta)
        router.add_get("/{version}/dynamic/instance-identity/document", self._h_document)
        router.add_route("*", "/{tail:.*}", self._h_not_allowed)

    async def _h_put(self, request: web.Request) -> web.Response:
        if request.path != "/latest/api/token":
            return _error(403, "Forbidden")
        if "X-Forwarded-For" in request.headers:
            return _error(403, "Forbidden")
        try:
            ttl = int(request.headers.get(TOKEN_TTL_HEADER, ""))
        except ValueError:
            return _error(400, "Bad Request")
        if not 1 <= ttl <= MAX_TTL:
            return _error(400, "Bad Request")
        token = secrets.token_urlsafe(42)
        self.tokens[token] = time.monotonic() + ttl
        self.tokens_issued += 1
        return raw(token, "text/plain", headers={TOKEN_TTL_HEADER: str(ttl)})

    def _authorised(self, request: web.Request) -> web.Response | None:
        token = request.headers.get(TOKEN_HEADER)
        if token is None and self.imdsv1:
            return None
        expiry = self.tokens.get(token) if token is not None else None
        if expiry is None or expiry <= time.monotonic():
            self.tokens.pop(token or "", None)
            self.unauthorized += 1
            return _error(401, "Unauthorized")
        return None

    def _version_ok(self, request: web.Request) -> bool:
        return request.match_info["version"] in VERSIONS or request.match_info["version"][:2] == "20"

    async def _h_root(self, request: web.Request) -> web.Response:
        denied = self._authorised(request)
        return denied or raw("\n".join(VERSIONS), "text/plain")

    async def _h_version(self, request: web.Request) -> web.Response:
        denied = self._authorised(request)
        if denied:
            return denied
        if not self._version_ok(request):
            return _error(404, "Not Found")
        return raw("dynamic\nmeta-data\nuser-data", "text/plain")

    async def _h_not_allowed(self, request: web.Request) -> web.Response:
        if request.method in ("GET", "HEAD") and request.path != "/latest/api/token":
            denied = self._authorised(request)
            return denied or _error(404, "Not Found")
        return _error(405, "Method Not Allowed")

    def _spot_doc(self) -> dict[str, str] | None:
        if self.spot is None:
            return None
        at: datetime = utcnow() + timedelta(minutes=2) if self.spot["drift"] else self.spot["time"]
        return {"action": self.spot["action"], "time": rfc3339_seconds(at)}

    def _leaves(self) -> dict[str, str]:

        leaves = dict(self.identity)
        spot = self._spot_doc()
        if spot is not None:
            leaves["spot/instance-action"] = json.dumps(spot)
            leaves["spot/termination-time"] = spot["time"]
        if self.rebalance is not None:
            leaves["events/recommendations/rebalance"] = json.dumps({"noticeTime": self.rebalance})
        if self.maintenance or self.empty_maintenance == "[]":
            leaves["events/maintenance/scheduled"] = json.dumps(self.maintenance, indent=2)
        leaves["events/maintenance/history"] = "[]"
        if self.lifecycle is not None:
            leaves["autoscaling/target-lifecycle-state"] = self.lifecycle
        return leaves

    async def _h_meta(self, request: web.Request) -> web.Response:
        denied = self._authorised(request)
        if denied:
            return denied
        if not self._version_ok(request):
            return _error(404, "Not Found")
        tail = request.match_info.get("tail", "")
        leaves = self._leaves()
        key = tail.rstrip("/")
        if key in leaves:  # a leaf answers with or without a trailing slash (botocore asks with one)
            return raw(leaves[key], "text/plain")
        children = listing(list(leaves), key + "/" if key else "")
        if children is None:
            return _error(404, "Not Found")
        return raw("\n".join(children), "text/plain")

    async def _h_document(self, request: web.Request) -> web.Response:

        denied = self._authorised(request)
        if denied:
            return denied
        doc = {
            "accountId": "123456789012",
            "architecture": "x86_64",
            "availabilityZone": self.identity["placement/availability-zone"],
            "imageId": self.identity["ami-id"],
            "instanceId": self.identity["instance-id"],
            "instanceType": self.identity["instance-type"],
            "privateIp": self.identity["local-ipv4"],
            "region": self.identity["placement/region"],
            "version": "2017-09-30",
        }
        return raw(json.dumps(doc, indent=2), "text/plain")
