"""AWS EC2: spot interruption, rebalance recommendation, scheduled maintenance and Auto Scaling lifecycle
notices read from the instance metadata service (IMDSv2), with pure parsers under a thin polling loop.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Any

import structlog

from agent.config import AwsConfig
from agent.core.errors import NoticeError
from agent.core.notice import Kind, Observation, Severity, parse_time, utcnow
from agent.sources.base import Sink, Source
from agent.sources.cloud_http import (
    Backoff,
    Cadence,
    CloudError,
    LevelState,
    MetadataClient,
    ParseError,
    Reply,
    status_error,
)
from agent.sources.cloud_identity import IdentityReader
from agent.sources.clouds import CloudSpec, Lead

log = structlog.get_logger("preemptd.sources.aws")

TOKEN_PATH = "/latest/api/token"
TOKEN_TTL_HEADER = "X-aws-ec2-metadata-token-ttl-seconds"
TOKEN_HEADER = "X-aws-ec2-metadata-token"

INSTANCE_ACTION = "/latest/meta-data/spot/instance-action"
REBALANCE = "/latest/meta-data/events/recommendations/rebalance"
MAINTENANCE = "/latest/meta-data/events/maintenance/scheduled"
LIFECYCLE = "/latest/meta-data/autoscaling/target-lifecycle-state"

IDENTITY_PATHS = {
    "instance_id": "/latest/meta-data/instance-id",
    "instance_type": "/latest/meta-data/instance-type",
    "zone": "/latest/meta-data/placement/availability-zone",
    "life_cycle": "/latest/meta-data/instance-life-cycle",
    "placement_group": "/latest/meta-data/placement/group-name",  # 404 outside a placement group
}

# Stable observation keys: one per condition, never derived from the payload (whose `time` may drift).
KEY_SPOT = "spot/instance-action"
KEY_REBALANCE = "events/recommendations/rebalance"
KEY_LIFECYCLE = "autoscaling/target-lifecycle-state"
MAINTENANCE_KEY_PREFIX = "events/maintenance/scheduled/"

_SPOT_ACTIONS = ("terminate", "stop", "hibernate")
IMDSV2_RETRY_S = 300.0
# Codes that take the instance away from the job (the others are host work that may pass unnoticed).
_DISRUPTIVE_MAINTENANCE = {"instance-reboot", "system-reboot", "instance-stop", "instance-retirement"}
_MONTH_NAMES = ("jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec")
_MONTHS = {name: number for number, name in enumerate(_MONTH_NAMES, start=1)}
_MAINTENANCE_TIME = re.compile(
    r"^\s*(\d{1,2}) ([A-Za-z]{3}) (\d{4}) (\d{1,2}):(\d{2}):(\d{2}) (?:GMT|UTC)\s*$",
)


# --- pure parsers --------------------------------------------------------------------------------------


def _json(body: bytes, what: str) -> Any:
    try:
        return json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise ParseError(f"{what}: not JSON: {body[:60]!r}") from exc


def _time(text: Any, what: str) -> datetime:
    try:
        return parse_time(text)
    except NoticeError as exc:
        raise ParseError(f"{what}: {exc}") from exc


def parse_instance_action(body: bytes, now: datetime | None = None) -> Observation:
    """``spot/instance-action``: ``{"action": "terminate", "time": "2017-09-18T08:22:00Z"}``. Hibernation
    starts at once whatever ``time`` says, so its deadline is ``now`` when given."""
    doc = _json(body, "spot/instance-action")
    if not isinstance(doc, Mapping):
        raise ParseError(f"spot/instance-action: expected an object, got {doc!r}")
    raw_action = doc.get("action")
    deadline = _time(doc.get("time"), "spot/instance-action")
    if not isinstance(raw_action, str) or raw_action.lower() not in _SPOT_ACTIONS:
        # The document exists only when AWS has decided to interrupt the instance: an action this agent
        # does not know (one AWS adds later, or a malformed one) is still the instance going away.
        return Observation(
            key=KEY_SPOT,
            kind=Kind.TERMINATION,
            severity=Severity.CRITICAL,
            reason=f"EC2 spot interruption with an unknown action {raw_action!r}: treated as a termination",
            deadline=deadline,
            detail={"action": raw_action, "time": doc.get("time"), "unknown_action": True},
        )
    action = raw_action.lower()
    if action == "hibernate" and now is not None:
        deadline = min(deadline, now)
    return Observation(
        key=KEY_SPOT,
        kind=Kind.TERMINATION,
        reason=f"EC2 spot interruption: the instance will {action}",
        deadline=deadline,
        detail={"action": action, "time": doc.get("time")},
    )


def parse_rebalance(body: bytes) -> Observation:
    """``events/recommendations/rebalance``: ``{"noticeTime": "2020-10-27T08:22:00Z"}``."""
    doc = _json(body, "rebalance recommendation")
    if not isinstance(doc, Mapping):
        raise ParseError(f"rebalance recommendation: expected an object, got {doc!r}")
    notice_time = _time(doc.get("noticeTime"), "rebalance recommendation")
    return Observation(
        key=KEY_REBALANCE,
        kind=Kind.REBALANCE,
        reason="EC2 rebalance recommendation: elevated risk of spot interruption",
        detail={"noticeTime": doc.get("noticeTime"), "notice_time": notice_time.isoformat()},
    )


def parse_maintenance_time(text: Any) -> datetime:
    """The scheduled-events layout ``21 Jan 2019 09:00:43 GMT`` (day without a leading zero), locale-free.
    RFC 3339 is accepted too, as some mocks send it."""
    if not isinstance(text, str) or not text.strip():
        raise ParseError(f"maintenance time: expected a time, got {text!r}")
    match = _MAINTENANCE_TIME.match(text)
    if match is None:
        try:
            return parse_time(text)
        except NoticeError as exc:
            raise ParseError(f"maintenance time: {text!r} is not like '21 Jan 2019 09:00:43 GMT'") from exc
    day, month_name, year, hour, minute, second = match.groups()
    month = _MONTHS.get(month_name.lower())
    if month is None:
        raise ParseError(f"maintenance time: unknown month in {text!r}")
    try:
        return datetime(int(year), month, int(day), int(hour), int(minute), int(second), tzinfo=timezone.utc)
    except ValueError as exc:
        raise ParseError(f"maintenance time: {text!r}: {exc}") from exc


def parse_maintenance(body: bytes) -> list[Observation]:
    """``events/maintenance/scheduled``: a JSON array of events; ``canceled`` and ``completed`` ones are over.
    An empty body or ``[]`` means none."""
    if not body.strip():
        return []
    doc = _json(body, "scheduled maintenance")
    if isinstance(doc, Mapping):
        doc = [doc]
    if not isinstance(doc, list):
        raise ParseError(f"scheduled maintenance: expected an array, got {doc!r}")
    observations: list[Observation] = []
    for item in doc:
        if not isinstance(item, Mapping):
            raise ParseError(f"scheduled maintenance: expected event objects, got {item!r}")
        state = str(item.get("State") or "active").lower()
        if state in ("canceled", "cancelled", "completed"):
            continue
        event_id = item.get("EventId")
        code = str(item.get("Code") or "unknown")
        if not isinstance(event_id, str) or not event_id:
            raise ParseError(f"scheduled maintenance: event without an EventId: {item!r}")
        not_before = parse_maintenance_time(item.get("NotBefore"))
        detail = {
            k: item[k]
            for k in ("Code", "Description", "EventId", "NotBefore", "NotAfter", "State")
            if k in item
        }
        if "NotBeforeDeadline" in item:
            detail["NotBeforeDeadline"] = item["NotBeforeDeadline"]
        observations.append(
            Observation(
                key=MAINTENANCE_KEY_PREFIX + event_id,
                kind=Kind.MAINTENANCE,
                severity=Severity.CRITICAL if code in _DISRUPTIVE_MAINTENANCE else Severity.WARNING,
                reason=f"EC2 scheduled event {code}: {item.get('Description') or code}",
                deadline=not_before,
                detail=detail,
            )
        )
    return observations


def parse_lifecycle_state(body: bytes) -> Observation | None:
    """``autoscaling/target-lifecycle-state``: only ``Terminated`` is a notice."""
    try:
        state = body.decode("utf-8").strip()
    except UnicodeDecodeError as exc:
        raise ParseError(f"target-lifecycle-state: not text: {body[:40]!r}") from exc
    if not state or len(state) > 64 or not state.replace(":", "").replace("-", "").isalnum():
        raise ParseError(f"target-lifecycle-state: unexpected value {body[:60]!r}")
    if state != "Terminated":
        return None
    return Observation(
        key=KEY_LIFECYCLE,
        kind=Kind.TERMINATION,
        reason="EC2 Auto Scaling is terminating the instance (target lifecycle state Terminated)",
        detail={"target_lifecycle_state": state},
    )


# --- the source ----------------------------------------------------------------------------------------


class AwsSource(Source):
    """Polls the four notice endpoints with an IMDSv2 token, each at the cadence its notice needs: the
    interruption notice every ``poll_interval_s``, the others on the same ticks but less often."""

    name = "aws"

    def __init__(self, config: AwsConfig) -> None:
        self.config = config
        self._client = MetadataClient(config.endpoint, config.timeout_s)
        self._token: str | None = None
        self._token_expires = 0.0  # monotonic
        self._imdsv1 = False
        self._v2_retry_at = 0.0  # monotonic; when IMDSv1 is in use, when to try IMDSv2 again
        self._token_lock = asyncio.Lock()
        self._identity = IdentityReader(self.name, "aws", self.read_identity, config.backoff_max_s)
        self._polls = 0

    def status(self) -> Mapping[str, Any]:
        return {
            "endpoint": self.config.endpoint,
            "mode": "imdsv1" if self._imdsv1 else "imdsv2",
            "poll_interval_s": self.config.poll_interval_s,
            "intervals_s": self.intervals(),
            "polls": self._polls,
            "identity": self._identity.status(),
        }

    # token lifecycle

    async def _fetch_token(self) -> None:
        ttl = max(1, min(21600, self.config.token_ttl_s))
        try:
            reply = await self._client.request("PUT", TOKEN_PATH, headers={TOKEN_TTL_HEADER: str(ttl)})
        except CloudError as exc:
            if self.config.imdsv1_fallback:
                self._use_imdsv1(str(exc))
                return
            if not exc.timed_out:
                raise
            raise CloudError(
                f"{exc}. Inside a container the IMDSv2 token reply is dropped when the instance's hop limit "
                "is 1: raise it (aws ec2 modify-instance-metadata-options --http-put-response-hop-limit 2) "
                "or set aws.imdsv1_fallback = true",
                timed_out=True,
            ) from exc
        if reply.status != 200:
            if self.config.imdsv1_fallback:
                self._use_imdsv1(f"token PUT answered HTTP {reply.status}")
                return
            raise status_error("PUT", self._client.base_url + TOKEN_PATH, reply)
        token = reply.text().strip()
        if not token or len(token) > 4096 or not token.isprintable():
            raise ParseError(f"PUT {TOKEN_PATH}: unusable token {reply.body[:40]!r}")
        granted = reply.headers.get(TOKEN_TTL_HEADER)
        try:
            granted_ttl = float(granted) if granted else float(ttl)
        except ValueError:
            granted_ttl = float(ttl)
        self._token = token
        # Refresh well before expiry so a request never races the token's end.
        self._token_expires = time.monotonic() + granted_ttl - min(60.0, granted_ttl / 4)
        self._imdsv1 = False

    def _use_imdsv1(self, why: str) -> None:
        if not self._imdsv1:
            log.warning("imdsv1_fallback", source=self.name, reason=why)
        self._imdsv1 = True
        self._token = None
        self._v2_retry_at = time.monotonic() + IMDSV2_RETRY_S

    async def _ensure_token(self) -> None:
        # One fetch at a time: the concurrent reads of a poll that all meet a 401 share one new token.
        async with self._token_lock:
            now = time.monotonic()
            if self._imdsv1:
                if now >= self._v2_retry_at:  # IMDSv1 is a fallback, not a home: try for a token again
                    await self._fetch_token()
                    if self._token is not None:
                        log.info("imdsv2_restored", source=self.name)
            elif self._token is None or now >= self._token_expires:
                await self._fetch_token()

    async def _get(self, path: str) -> Reply:
        """GET with a fresh token; on 401 the token is dropped and the request retried once."""
        for attempt in (1, 2):
            await self._ensure_token()
            used = self._token
            reply = await self._client.request("GET", path, headers={TOKEN_HEADER: used} if used else None)
            if reply.status == 401 and attempt == 1:
                if self._token == used:
                    self._token = None
                    self._imdsv1 = False
                continue
            return reply
        raise AssertionError("unreachable")

    async def _read(self, path: str) -> bytes | None:
        """The body of a 200, None for a 404 (nothing pending); anything else raises."""
        reply = await self._get(path)
        if reply.status == 404:
            return None
        if reply.status != 200:
            raise status_error("GET", self._client.base_url + path, reply)
        return reply.body

    async def read_identity(self) -> dict[str, str]:
        identity: dict[str, str] = {}
        for field_name, path in IDENTITY_PATHS.items():
            body = await self._read(path)
            if body is not None:
                identity[field_name] = body.decode("utf-8", errors="replace").strip()[:256]
        if "instance_id" not in identity:
            raise CloudError(f"GET {self._client.base_url}{IDENTITY_PATHS['instance_id']}: no instance id")
        return identity

    # polling

    async def _poll_part(self, part: str, state: LevelState) -> None:
        if part == "spot":
            body = await self._read(INSTANCE_ACTION)
            state.set(part, [parse_instance_action(body, utcnow())] if body is not None else [])
        elif part == "rebalance":
            body = await self._read(REBALANCE)
            state.set(part, [parse_rebalance(body)] if body is not None else [])
        elif part == "maintenance":
            body = await self._read(MAINTENANCE)
            state.set(part, parse_maintenance(body) if body is not None else [])
        else:
            body = await self._read(LIFECYCLE)
            obs = parse_lifecycle_state(body) if body is not None else None
            state.set(part, [obs] if obs is not None else [])

    def intervals(self) -> dict[str, float]:
        """How often each path is read: the interruption notice every ``poll_interval_s``; the others, whose
        notices come minutes (rebalance, Auto Scaling) or days (scheduled maintenance) ahead, less often."""
        return {
            "spot": self.config.poll_interval_s,
            "rebalance": self.config.rebalance_interval_s,
            "lifecycle": self.config.lifecycle_interval_s,
            "maintenance": self.config.maintenance_interval_s,
        }

    async def _poll(self, due: list[str], state: LevelState) -> dict[str, CloudError]:
        """Read the paths that are due, concurrently; the error of each path that failed."""
        try:
            # One token fetch before the concurrent reads, so a token failure is one error, not four.
            await self._ensure_token()
        except CloudError as exc:
            return dict.fromkeys(due, exc)
        errors: dict[str, CloudError] = {}
        if len(due) == 1:  # most ticks read the spot path alone: no task to wrap it in
            try:
                await self._poll_part(due[0], state)
            except CloudError as exc:
                errors[due[0]] = exc
            return errors
        results = await asyncio.gather(*(self._poll_part(p, state) for p in due), return_exceptions=True)
        for part, result in zip(due, results, strict=True):
            if isinstance(result, CloudError):
                errors[part] = result
            elif isinstance(result, BaseException):
                raise result
        return errors

    async def run(self, sink: Sink) -> None:
        bound = log.bind(source=self.name)
        intervals = self.intervals()
        state = LevelState(intervals)
        cadence = Cadence(intervals, time.monotonic())
        # Each path backs off on its own: a path that keeps failing must not slow the termination path.
        # A failing slow path is retried sooner than its interval at first, never later than it.
        backoffs = {
            part: Backoff(self.config.poll_interval_s, max(self.config.backoff_max_s, interval))
            for part, interval in intervals.items()
        }
        failing: dict[str, CloudError] = {}  # path -> its last error, until it reads again
        self._identity.start(sink)  # beside the poll: its failures never slow or degrade it
        try:
            while True:
                due = cadence.due(time.monotonic())
                errors = await self._poll(due, state) if due else {}
                state.publish(sink)
                self._polls += 1
                now = time.monotonic()
                for part in due:
                    if part in errors:
                        failing[part] = errors[part]
                        cadence.retry(part, now + backoffs[part].next_delay(errors[part].retry_after_s))
                    else:
                        failing.pop(part, None)
                        backoffs[part].reset()
                        cadence.read(part, now)
                if errors:
                    first = next(iter(errors.values()))
                    sink.error(str(first), errors=len(errors), endpoint=self.config.endpoint)
                elif not failing:
                    sink.ok(endpoint=self.config.endpoint, mode="imdsv1" if self._imdsv1 else "imdsv2")
                await asyncio.sleep(max(0.0, cadence.next_at() - time.monotonic()))
        finally:
            bound.debug("source_stopping")
            await self._identity.stop()
            await self._client.close()


def names_aws(dmi: Mapping[str, str]) -> bool:
    """Pure: whether the DMI strings name EC2 (Nitro and Xen instances say it in different fields)."""
    bios = (dmi.get("bios_vendor", "") + " " + dmi.get("bios_version", "")).lower()
    return (
        dmi.get("sys_vendor", "").lower() == "amazon ec2"
        or "amazon" in bios
        or dmi.get("product_version", "").lower().endswith("amazon")
    )


async def probe(config: AwsConfig, timeout_s: float) -> bool:
    """An IMDSv2 token; IMDSv1-only instances answer the PUT with 403/405 but serve the instance id."""
    async with MetadataClient(config.endpoint, timeout_s) as client:
        reply = await client.request("PUT", TOKEN_PATH, headers={TOKEN_TTL_HEADER: "60"})
        if reply.status == 200 and reply.body.strip():
            return True
        reply = await client.request("GET", "/latest/meta-data/instance-id")
        return reply.status == 200 and reply.body.strip().startswith(b"i-")


LEADS = (
    Lead("termination", 120.0, "aws: spot instance-action, about 2 minutes (best effort)", fixed=True),
    Lead("maintenance", None, "aws: scheduled event's NotBefore (usually days ahead)"),
    Lead("rebalance", None, "aws: rebalance recommendation, advisory (no deadline)", deadline=False),
)

CLOUD = CloudSpec(
    "aws",
    AwsConfig,
    names_aws,
    probe,
    AwsSource,
    simulator="agent.simulate.aws:AwsSimulator",
    rank=10,
    leads=lambda _table: LEADS,
    about="Amazon EC2: instance metadata (IMDSv2)",
)
