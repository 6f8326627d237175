"""A simulated Compute Engine metadata server: ``Metadata-Flavor: Google`` both ways, ETags, hanging GETs
(``wait_for_change``, ``last_etag``, ``timeout_sec``), ``recursive`` and ``alt``, preemption and maintenance."""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import Mapping
from datetime import timedelta
from typing import Any, ClassVar

from aiohttp import web

from agent.core.notice import utcnow
from agent.simulate.base import Scenario, Simulator, in_s, listing, raw, rfc3339_seconds, scenario
from agent.simulate.faults import SimulatorError

BASE = "/computeMetadata/v1/"
MAINTENANCE_VALUES = ("NONE", "MIGRATE_ON_HOST_MAINTENANCE", "TERMINATE_ON_HOST_MAINTENANCE")
MAX_TIMEOUT_SEC = 3600
DEFAULT_TIMEOUT_SEC = 300
_TEXT = "application/text"
# What instance/upcoming-maintenance answers while nothing is scheduled: "empty" is {}, the others are the
# metadata server's error document with 200 or with 503.
UPCOMING_IDLE = ("empty", "no-notifications", "no-notifications-503")
NO_NOTIFICATIONS_BODY = b'{ "error": "no notifications have been received yet, try again later" }'


def etag_of(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()[:16]


def _camel(name: str) -> str:
    head, *rest = name.split("-")
    return head + "".join(part[:1].upper() + part[1:] for part in rest)


def _check_idle(value: Any) -> str:
    if value not in UPCOMING_IDLE:
        raise SimulatorError(f"upcoming idle answer must be one of {', '.join(UPCOMING_IDLE)}, got {value!r}")
    return str(value)


def _forbidden(text: str) -> web.Response:
    return raw(text, "text/html", 403)


class GcpSimulator(Simulator):
    cloud = "gcp"
    client_hint = "GCE_METADATA_HOST={hostport} GCE_METADATA_IP={hostport}"
    server_headers: ClassVar[Mapping[str, str]] = {
        "Metadata-Flavor": "Google",
        "Server": "Metadata Server for VM",
        "X-XSS-Protection": "0",
        "X-Frame-Options": "SAMEORIGIN",
    }
    scenarios: ClassVar[Mapping[str, Scenario]] = dict(
        [
            scenario("quiet", "no notices; identity only"),
            scenario("preempted", "the spot VM is preempted", (0, {"type": "preempted"})),
            scenario(
                "maintenance-migrate",
                "live migration announced, over a minute later",
                (0, {"type": "maintenance", "value": "MIGRATE_ON_HOST_MAINTENANCE"}),
                (60, {"type": "maintenance", "value": "NONE"}),
            ),
            scenario(
                "maintenance-terminate",
                "host maintenance that stops the VM (GPU VMs cannot migrate)",
                (0, {"type": "maintenance", "value": "TERMINATE_ON_HOST_MAINTENANCE"}),
            ),
            scenario(
                "upcoming-maintenance",
                "a maintenance window scheduled in an hour, then under way, then complete",
                (0, {"type": "upcoming", "status": "PENDING", "in_s": 3600}),
                (10, {"type": "upcoming", "status": "ONGOING", "in_s": 0}),
                (20, {"type": "upcoming-clear"}),
            ),
            scenario(
                "upcoming-maintenance-503",
                'a maintenance window, then "no notifications have been received yet" with 503',
                (0, {"type": "upcoming", "status": "PENDING", "in_s": 3600}),
                (10, {"type": "upcoming-clear", "answer": "no-notifications-503"}),
            ),
        ]
    )

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        seed: int | None = None,
        offer_upcoming: bool = True,
        on_host_maintenance: str = "TERMINATE",
        upcoming_idle: str = "empty",
        provisioning_model: str | None = "SPOT",
    ) -> None:
        """``offer_upcoming``: whether ``instance/upcoming-maintenance`` exists (404 otherwise, as on machine
        families without it). ``upcoming_idle``: what it answers while nothing is scheduled, one of
        ``UPCOMING_IDLE``. ``provisioning_model``: SPOT or STANDARD (``scheduling/preemptible`` follows
        it), or None for a preemptible VM that predates it (404)."""
        self.offer_upcoming = offer_upcoming
        self.upcoming_idle = _check_idle(upcoming_idle)
        self.on_host_maintenance = on_host_maintenance
        self.provisioning_model = provisioning_model
        self._change = asyncio.Event()
        self._stopping = False
        self.waiting = 0  # hanging GETs now blocked on a change
        self._waiting_signal = asyncio.Event()
        super().__init__(host, port, seed)
        self.reset_state()

    def reset_state(self) -> None:
        self.preempted = False
        self.maintenance_event = "NONE"
        self.upcoming: dict[str, Any] = {}

    def changed(self) -> None:
        change, self._change = self._change, asyncio.Event()
        change.set()

    async def stop(self) -> None:
        self._stopping = True
        self.changed()
        await super().stop()

    def state(self) -> dict[str, Any]:
        return {
            "preempted": self.preempted,
            "maintenance_event": self.maintenance_event,
            "upcoming": self.upcoming,
            "upcoming_idle": self.upcoming_idle,
        }

    def apply(self, event: Mapping[str, Any]) -> None:
        kind = event["type"]
        if kind == "preempted":
            self.preempted = bool(event.get("value", True))
        elif kind == "maintenance":
            value = event.get("value", "TERMINATE_ON_HOST_MAINTENANCE")
            if value not in MAINTENANCE_VALUES:
                raise SimulatorError(f"maintenance value must be one of {', '.join(MAINTENANCE_VALUES)}")
            self.maintenance_event = str(value)
        elif kind == "upcoming":
            status = event.get("status", "PENDING")
            if status not in ("PENDING", "ONGOING"):
                raise SimulatorError("upcoming maintenance status must be PENDING or ONGOING")
            start = utcnow() + in_s(event, 3600)
            end = start + timedelta(seconds=float(event.get("duration_s", 3600)))
            self.upcoming = {
                "can_reschedule": "true" if status == "PENDING" else "false",
                "latest_window_start_time": rfc3339_seconds(start),
                "maintenance_status": status,
                "type": "SCHEDULED",
                "window_end_time": rfc3339_seconds(end),
                "window_start_time": rfc3339_seconds(start),
            }
        elif kind == "upcoming-clear":
            self.upcoming = {}
            if "answer" in event:
                self.upcoming_idle = _check_idle(event["answer"])
        else:
            raise SimulatorError(
                f"unknown GCP event {kind!r}; expected preempted, maintenance, upcoming, upcoming-clear or reset"
            )

    # --- protocol ---

    def _leaves(self) -> dict[str, str]:
        preemptible = "TRUE" if self.provisioning_model in ("SPOT", None) else "FALSE"
        leaves = {
            "instance/id": "4520031799277581759",
            "instance/name": "gpu-trainer-0",
            "instance/hostname": "gpu-trainer-0.us-central1-a.c.sim-project.internal",
            "instance/zone": "projects/123456789012/zones/us-central1-a",
            "instance/machine-type": "projects/123456789012/machineTypes/a2-highgpu-8g",
            "instance/cpu-platform": "Intel Cascade Lake",
            "instance/image": "projects/deeplearning-platform-release/global/images/common-cu121",
            "instance/preempted": "TRUE" if self.preempted else "FALSE",
            "instance/maintenance-event": self.maintenance_event,
            "instance/scheduling/preemptible": preemptible,
            "instance/scheduling/on-host-maintenance": self.on_host_maintenance,
            "instance/scheduling/automatic-restart": "FALSE",
            "instance/service-accounts/default/aliases": "default",
            "instance/service-accounts/default/email": "123456789012-compute@developer.gserviceaccount.com",
            "instance/service-accounts/default/scopes": "https://www.googleapis.com/auth/cloud-platform",
            "project/project-id": "sim-project",
            "project/numeric-project-id": "123456789012",
        }
        if self.provisioning_model is not None:
            leaves["instance/scheduling/provisioning-model"] = self.provisioning_model
        return leaves

    def _token(self) -> str:
        return json.dumps(
            {"access_token": "ya29.simulated-token", "expires_in": 3599, "token_type": "Bearer"}
        )

    def _tree(self, leaves: Mapping[str, str], prefix: str) -> dict[str, Any]:
        tree: dict[str, Any] = {}
        for path, value in leaves.items():
            if not path.startswith(prefix):
                continue
            node = tree
            parts = path[len(prefix) :].split("/")
            for part in parts[:-1]:
                node = node.setdefault(_camel(part), {})
            leaf = parts[-1]
            node[_camel(leaf)] = value.split("\n") if leaf in ("aliases", "scopes") else value
        return tree

    def resolve(self, path: str, recursive: bool, alt: str | None) -> tuple[bytes, str] | None:
        """The body and content type for ``path`` (relative to /computeMetadata/v1/), or None (404)."""
        leaves = self._leaves()
        key = path.rstrip("/")
        if key == "instance/service-accounts/default/token":
            return self._token().encode(), "application/json"
        if key == "instance/upcoming-maintenance":
            if not self.offer_upcoming:
                return None
            if not self.upcoming and self.upcoming_idle != "empty":
                return NO_NOTIFICATIONS_BODY, "application/json"
            return json.dumps(self.upcoming).encode(), "application/json"
        if key in leaves:
            if alt == "json":
                return json.dumps(leaves[key]).encode(), "application/json"
            return leaves[key].encode(), _TEXT
        prefix = key + "/" if key else ""
        if recursive:
            tree = self._tree(leaves, prefix)
            if not tree:
                return None
            if alt == "text":
                lines = [f"{p[len(prefix) :]} {v}" for p, v in sorted(leaves.items()) if p.startswith(prefix)]
                return "\n".join(lines).encode(), _TEXT
            return json.dumps(tree).encode(), "application/json"
        children = listing(list(leaves), prefix)
        if children is None:
            return None
        return ("\n".join(children) + "\n").encode(), _TEXT

    def routes(self, router: web.UrlDispatcher) -> None:
        router.add_get("/", self._h_root)
        router.add_get("/computeMetadata/", self._h_versions)
        router.add_get("/computeMetadata/v1", self._h_get)
        router.add_get(BASE + "{tail:.*}", self._h_get)
        router.add_route("*", "/{tail:.*}", self._h_other)

    async def _h_root(self, request: web.Request) -> web.Response:
        return raw("computeMetadata/\n", _TEXT)

    async def _h_versions(self, request: web.Request) -> web.Response:
        denied = self._check(request)
        return denied or raw("v1/\n", _TEXT)

    async def _h_other(self, request: web.Request) -> web.Response:
        denied = self._check(request)
        if denied:
            return denied
        if request.method not in ("GET", "HEAD"):
            return raw("Method not allowed\n", "text/html", 405)
        return raw("Not Found\n", "text/html", 404)

    @staticmethod
    def _check(request: web.Request) -> web.Response | None:
        if "X-Forwarded-For" in request.headers:
            return _forbidden("Request had an X-Forwarded-For header and was rejected.\n")
        flavor = request.headers.get("Metadata-Flavor")
        legacy = request.headers.get("X-Google-Metadata-Request", "").lower() == "true"
        if (flavor is None or flavor.lower() != "google") and not legacy:
            return _forbidden("Missing Metadata-Flavor:Google header.\n")
        return None

    async def _h_get(self, request: web.Request) -> web.Response:
        denied = self._check(request)
        if denied:
            return denied
        path = request.match_info.get("tail", "")
        query = request.query
        recursive = query.get("recursive", "").lower() == "true"
        alt = query.get("alt")
        if alt not in (None, "json", "text"):
            return raw(f"Invalid alt parameter: {alt}\n", "text/html", 400)
        found = self.resolve(path, recursive, alt)
        if found is None:
            return raw("Not Found\n", "text/html", 404)
        if self._unavailable(found):
            # Answered at once, without an ETag, whatever wait_for_change asks.
            return raw(found[0], found[1], 503)
        if query.get("wait_for_change", "").lower() == "true":
            try:
                timeout = min(MAX_TIMEOUT_SEC, int(query.get("timeout_sec", DEFAULT_TIMEOUT_SEC)))
            except ValueError:
                return raw("Invalid timeout_sec\n", "text/html", 400)
            last_etag = query.get("last_etag")
            current = etag_of(found[0])
            if last_etag is None or last_etag == current:
                found = await self._wait_change(path, recursive, alt, current, max(0, timeout)) or found
        if self._unavailable(found):
            return raw(found[0], found[1], 503)
        body, content_type = found
        return raw(body, content_type, headers={"ETag": etag_of(body)})

    def _unavailable(self, found: tuple[bytes, str]) -> bool:
        return found[0] == NO_NOTIFICATIONS_BODY and self.upcoming_idle == "no-notifications-503"

    async def _wait_change(
        self, path: str, recursive: bool, alt: str | None, etag: str, timeout: float
    ) -> tuple[bytes, str] | None:
        """Block until the value's ETag differs from ``etag`` or ``timeout`` passes; the value then."""
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        self.waiting += 1
        signal, self._waiting_signal = self._waiting_signal, asyncio.Event()
        signal.set()
        try:
            return await self._wait_loop(path, recursive, alt, etag, loop, end)
        finally:
            self.waiting -= 1

    async def wait_for_waiters(self, count: int, timeout: float = 10.0) -> None:
        """Wait until ``count`` hanging GETs are blocked on a change (for tests and benchmarks)."""

        async def reached() -> None:
            while self.waiting < count:
                await self._waiting_signal.wait()

        await asyncio.wait_for(reached(), timeout)

    async def _wait_loop(
        self,
        path: str,
        recursive: bool,
        alt: str | None,
        etag: str,
        loop: asyncio.AbstractEventLoop,
        end: float,
    ) -> tuple[bytes, str] | None:
        while not self._stopping:
            change = self._change
            found = self.resolve(path, recursive, alt)
            if found is None or etag_of(found[0]) != etag:
                return found
            remaining = end - loop.time()
            if remaining <= 0:
                return found
            try:
                await asyncio.wait_for(change.wait(), remaining)
            except asyncio.TimeoutError:
                return self.resolve(path, recursive, alt)
        return None
