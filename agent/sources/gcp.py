"""Google Compute Engine: preemption and host-maintenance notices from the metadata server, watched with
hanging GETs (``wait_for_change``) so a change reaches the board within milliseconds.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Mapping
from datetime import datetime, timedelta
from typing import Any

import structlog

from agent.config import GcpConfig
from agent.core.errors import NoticeError
from agent.core.notice import Kind, Observation, Severity, parse_time, utcnow
from agent.sources.base import Sink, Source
from agent.sources.cloud_http import (
    Backoff,
    CloudError,
    LevelState,
    MetadataClient,
    ParseError,
    Reply,
    run_all,
    status_error,
)
from agent.sources.cloud_identity import IdentityReader
from agent.sources.clouds import CloudSpec, Lead

log = structlog.get_logger("preemptd.sources.gcp")

DEFAULT_HOST = "metadata.google.internal"
BASE = "/computeMetadata/v1/"
FLAVOR = {"Metadata-Flavor": "Google"}

PREEMPTED = "instance/preempted"
MAINTENANCE_EVENT = "instance/maintenance-event"
UPCOMING = "instance/upcoming-maintenance"

# The answer of instance/upcoming-maintenance while nothing is scheduled (with 200 or 503).
NO_NOTIFICATIONS = "no notifications have been received yet"

KEY_PREEMPTED = "instance/preempted"
KEY_MAINTENANCE = "instance/maintenance-event"
KEY_UPCOMING = "instance/upcoming-maintenance"

IDENTITY_PATHS = {
    "instance_id": "instance/id",
    "name": "instance/name",
    "zone": "instance/zone",
    "machine_type": "instance/machine-type",
}
SCHEDULING_PATHS = {
    "preemptible": "instance/scheduling/preemptible",
    "on_host_maintenance": "instance/scheduling/on-host-maintenance",
    "provisioning_model": "instance/scheduling/provisioning-model",
}


def gcp_endpoint(configured: str, env: Mapping[str, str] | None = None) -> str:
    """The metadata server's base URL: the configured one, else ``$GCE_METADATA_HOST`` (honoured by Google's
    own clients), else ``http://metadata.google.internal``."""
    if configured:
        return configured.rstrip("/")
    host = (os.environ if env is None else env).get("GCE_METADATA_HOST", "").strip()
    if host:
        return host.rstrip("/") if "://" in host else f"http://{host}"
    return f"http://{DEFAULT_HOST}"


# --- pure parsers --------------------------------------------------------------------------------------


def _text(body: bytes, what: str) -> str:
    try:
        text = body.decode("utf-8").strip()
    except UnicodeDecodeError as exc:
        raise ParseError(f"{what}: not text: {body[:40]!r}") from exc
    return text


def parse_preempted(body: bytes, now: datetime, notice_s: float = 30.0) -> Observation | None:
    """``instance/preempted``: ``TRUE`` or ``FALSE``. A preempted VM is powered off about 30 s later."""
    text = _text(body, PREEMPTED).upper()
    if text == "FALSE":
        return None
    if text != "TRUE":
        raise ParseError(f"{PREEMPTED}: expected TRUE or FALSE, got {body[:40]!r}")
    return Observation(
        key=KEY_PREEMPTED,
        kind=Kind.TERMINATION,
        reason="Google Cloud preempted the VM (spot/preemptible): ACPI soft-off, then hard off",
        deadline=now + timedelta(seconds=notice_s),
        detail={"preempted": "TRUE"},
    )


def parse_maintenance_event(body: bytes, now: datetime, notice_s: float = 60.0) -> Observation | None:
    """``instance/maintenance-event``: ``NONE``, ``MIGRATE_ON_HOST_MAINTENANCE`` or
    ``TERMINATE_ON_HOST_MAINTENANCE``; it flips about a minute before the maintenance starts."""
    text = _text(body, MAINTENANCE_EVENT).upper()
    if text in ("NONE", ""):
        return None
    if not text.replace("_", "").isalnum() or len(text) > 64:
        raise ParseError(f"{MAINTENANCE_EVENT}: unexpected value {body[:60]!r}")
    deadline = now + timedelta(seconds=notice_s)
    if text.startswith("TERMINATE"):
        return Observation(
            key=KEY_MAINTENANCE,
            kind=Kind.TERMINATION,
            reason="Google Cloud host maintenance will stop this VM (TERMINATE_ON_HOST_MAINTENANCE)",
            deadline=deadline,
            detail={"maintenance_event": text},
        )
    return Observation(
        key=KEY_MAINTENANCE,
        kind=Kind.MAINTENANCE,
        severity=Severity.WARNING,
        reason=f"Google Cloud host maintenance: {text}",
        deadline=deadline,
        detail={"maintenance_event": text},
    )


def is_no_notifications(body: bytes) -> bool:
    """Whether ``body`` is the metadata server's "nothing scheduled" answer for upcoming maintenance:
    ``{"error": "no notifications have been received yet, try again later"}``. It comes with 200 or with
    503, and means no maintenance is scheduled, not that the server failed."""
    try:
        doc = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return False
    if not isinstance(doc, Mapping) or "maintenance_status" in doc:
        return False
    error = doc.get("error")
    return isinstance(error, str) and NO_NOTIFICATIONS in error.lower()


def parse_upcoming_maintenance(body: bytes, terminate_on_maintenance: bool = True) -> Observation | None:
    """``instance/upcoming-maintenance?alt=json``: ``{}``, ``NONE`` or ``{"error": "no notifications have
    been received yet, ..."}`` when nothing is scheduled, else an object with ``maintenance_status`` and the
    window. GPU VMs cannot live-migrate, so by default a window means the VM stops: critical."""
    text = _text(body, UPCOMING)
    if text in ("", "{}", "NONE"):
        return None
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise ParseError(f"{UPCOMING}: not JSON: {body[:60]!r}") from exc
    if not isinstance(doc, Mapping):
        raise ParseError(f"{UPCOMING}: expected an object, got {doc!r}")
    if not doc or is_no_notifications(body):
        return None
    if "error" in doc and "maintenance_status" not in doc and "window_start_time" not in doc:
        # Some other error document: reading it as a window would raise a false alarm with no deadline.
        raise ParseError(f"{UPCOMING}: the metadata server answered an error: {str(doc['error'])[:120]!r}")
    status = str(doc.get("maintenance_status") or "PENDING").upper()
    if status in ("COMPLETE", "COMPLETED", "NONE"):
        return None
    start_text = doc.get("window_start_time") or doc.get("latest_window_start_time")
    deadline: datetime | None = None
    if start_text:
        try:
            deadline = parse_time(str(start_text))
        except NoticeError as exc:
            raise ParseError(f"{UPCOMING}: window_start_time: {exc}") from exc
    kind_text = str(doc.get("type") or "SCHEDULED")
    return Observation(
        key=KEY_UPCOMING,
        kind=Kind.MAINTENANCE,
        severity=Severity.CRITICAL if terminate_on_maintenance else Severity.WARNING,
        reason=f"Google Cloud {kind_text.lower()} maintenance {status.lower()}",
        deadline=deadline,
        detail={str(k): v for k, v in doc.items() if isinstance(v, (str, int, float, bool))},
    )


def parse_last_segment(body: bytes) -> str:
    """``projects/123/zones/us-central1-a`` → ``us-central1-a``."""
    return body.decode("utf-8", errors="replace").strip().rsplit("/", 1)[-1][:256]


# --- the source ----------------------------------------------------------------------------------------


def _watch_params(extra: Mapping[str, str], etag: str | None, wait: int) -> dict[str, str]:
    """The query of a watch's next read: a plain read, or with ``etag`` a hanging GET of ``wait`` seconds."""
    params = dict(extra)
    if etag is not None:
        params.update(wait_for_change="true", last_etag=etag, timeout_sec=str(wait))
    return params


def _nothing_upcoming(path: str, reply: Reply, last_body: bytes | None) -> bool:
    """Whether a 503 for the upcoming maintenance says that none is scheduled.

    "No notifications have been received yet" comes with 503 too, and a bare 503 before any good read is
    seen instead of {} on machine families without the API: either way nothing is scheduled, and a window
    seen earlier is over. A bare 503 after a good read is a brief outage during host maintenance and keeps
    what was seen."""
    return reply.status == 503 and path == UPCOMING and (last_body is None or is_no_notifications(reply.body))


class GcpSource(Source):
    """One hanging-GET watcher per notice key, plus a read of identity and scheduling on its own schedule
    (:class:`IdentityReader`: its failures never make the watchers' source degraded)."""

    name = "gcp"

    def __init__(self, config: GcpConfig, env: Mapping[str, str] | None = None) -> None:
        self.config = config
        self.endpoint = gcp_endpoint(config.endpoint, env)
        self._client = MetadataClient(self.endpoint, config.timeout_s, headers=FLAVOR)
        self._failing: dict[str, str] = {}
        self._etags: dict[str, str] = {}
        self._scheduling: dict[str, str] = {}
        self._identity = IdentityReader(self.name, "gcp", self._read_context, config.backoff_max_s)
        self._sink: Sink | None = None

    def status(self) -> Mapping[str, Any]:
        return {
            "endpoint": self.endpoint,
            "etags": dict(self._etags),
            "scheduling": dict(self._scheduling),
            "identity": self._identity.status(),
        }

    def _failed(self, part: str, exc: CloudError) -> None:
        self._failing[part] = str(exc)
        assert self._sink is not None
        self._sink.error(str(exc), watch=part, endpoint=self.endpoint)

    def _succeeded(self, part: str) -> None:
        self._failing.pop(part, None)
        assert self._sink is not None
        if not self._failing:
            self._sink.ok(endpoint=self.endpoint, watching=sorted(self._etags))

    async def _get(self, path: str) -> bytes:
        reply = await self._client.request("GET", BASE + path)
        if reply.status != 200:
            raise status_error("GET", self.endpoint + BASE + path, reply)
        return reply.body

    async def _read_context(self) -> dict[str, str]:
        identity = {name: parse_last_segment(await self._get(path)) for name, path in IDENTITY_PATHS.items()}
        for name, path in SCHEDULING_PATHS.items():
            try:
                self._scheduling[name] = parse_last_segment(await self._get(path))
            except CloudError as exc:
                if exc.status != 404:  # provisioning-model is missing on older VMs
                    raise
        return identity | self._scheduling

    def _parse(self, path: str, body: bytes) -> list[Observation]:
        now = utcnow()
        if path == PREEMPTED:
            obs = parse_preempted(body, now, self.config.preempt_notice_s)
        elif path == MAINTENANCE_EVENT:
            obs = parse_maintenance_event(body, now, self.config.maintenance_notice_s)
        else:
            terminate = self._scheduling.get("on_host_maintenance", "TERMINATE").upper() != "MIGRATE"
            obs = parse_upcoming_maintenance(body, terminate)
        return [obs] if obs is not None else []

    async def _watch(self, path: str, state: LevelState, sink: Sink) -> None:
        """Read once, then hang on ``wait_for_change`` with the last ETag; the server answers as soon as the
        value changes, or with the unchanged value after ``timeout_sec`` (not an error)."""
        backoff = Backoff(0.1, self.config.backoff_max_s)
        wait = max(1, self.config.wait_timeout_s)
        last_body: bytes | None = None
        etag: str | None = None
        extra = {"alt": "json"} if path == UPCOMING else {}
        while True:
            params = _watch_params(extra, etag, wait)
            try:
                # A hanging GET may legitimately take timeout_sec; a plain read gets the usual timeout.
                limit = wait + self.config.timeout_s if etag is not None else self.config.timeout_s
                started = time.monotonic()
                reply = await self._client.request("GET", BASE + path, params=params, timeout_s=limit)
                if reply.status == 404 and path == UPCOMING:
                    log.info("gcp_upcoming_maintenance_unavailable", source=self.name)
                    state.drop_part(path)
                    state.publish(sink)
                    return
                if _nothing_upcoming(path, reply, last_body):
                    state.set(path, [])
                    state.publish(sink)
                    last_body = reply.body
                    etag = None
                    self._succeeded(path)
                    backoff.reset()
                    # The server does not hang on this answer: read it again as often as a hanging GET
                    # answers at rest (a window is announced ahead of its start), not every few seconds.
                    await asyncio.sleep(wait)
                    continue
                if reply.status != 200:
                    raise status_error("GET", self.endpoint + BASE + path, reply)
                new_etag = reply.headers.get("ETag")
                if reply.body != last_body:
                    state.set(path, self._parse(path, reply.body))
                    last_body = reply.body
                    state.publish(sink)
                if new_etag:
                    self._etags[path] = new_etag
                quick = time.monotonic() - started < 0.5
                if not new_etag or (etag is not None and new_etag == etag and quick):
                    # A server without ETags, or one that ignores wait_for_change (some mocks), would make
                    # this a busy loop: poll it once a second instead.
                    await asyncio.sleep(1.0)
                etag = new_etag
                backoff.reset()
                self._succeeded(path)
            except CloudError as exc:
                self._failed(path, exc)
                etag = None  # after an error, re-read at once rather than hang on a stale ETag
                await asyncio.sleep(backoff.next_delay(exc.retry_after_s))

    async def run(self, sink: Sink) -> None:
        self._sink = sink
        watched = (PREEMPTED, MAINTENANCE_EVENT, UPCOMING)
        state = LevelState(watched)
        try:
            await run_all(
                [self._identity.run(sink), *(self._watch(path, state, sink) for path in watched)],
            )
        finally:
            await self._client.close()


def names_gcp(dmi: Mapping[str, str]) -> bool:
    """Pure: whether the DMI strings name Compute Engine."""
    product = dmi.get("product_name", "").lower()
    return product == "google compute engine" or dmi.get("sys_vendor", "").lower() == "google"


async def probe(config: GcpConfig, timeout_s: float) -> bool:
    """The instance id, answered with the ``Metadata-Flavor: Google`` header only Google's server sends."""
    async with MetadataClient(gcp_endpoint(config.endpoint), timeout_s) as client:
        reply = await client.request("GET", BASE + "instance/id", headers=FLAVOR)
        return reply.status == 200 and reply.headers.get("Metadata-Flavor", "").lower() == "google"


def leads(config: GcpConfig) -> tuple[Lead, ...]:
    """GCP's notices say no deadline: their leads are the table's figures."""
    preempt_s, maintenance_s = config.preempt_notice_s, config.maintenance_notice_s
    return (
        Lead(
            "termination",
            preempt_s,
            f"gcp: preempted, hard off gcp.preempt_notice_s = {preempt_s:g} s after ACPI soft-off",
            lengthen="set the instance's preemptionNoticeDuration (120 s, in preview since April 2026) and "
            "gcp.preempt_notice_s to the same figure",
        ),
        Lead(
            "maintenance",
            maintenance_s,
            f"gcp: maintenance-event, gcp.maintenance_notice_s = {maintenance_s:g} s",
        ),
    )


CLOUD = CloudSpec(
    "gcp",
    GcpConfig,
    names_gcp,
    probe,
    GcpSource,
    simulator="agent.simulate.gcp:GcpSimulator",
    rank=20,
    leads=leads,
    about="Google Compute Engine: the metadata server's hanging GETs",
)
