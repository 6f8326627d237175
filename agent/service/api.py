"""The HTTP API on the Unix socket: status, the event stream, reports, drills and metrics.

Handlers stay thin: bodies are parsed by pure functions (:mod:`agent.core.reports`, :func:`parse_drill`) and
errors become JSON ``{"error": ...}`` answers with a 4xx status that says what was wrong.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from datetime import datetime
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric

from agent import __version__
from agent.core.errors import NoticeError, ReportError
from agent.core.notice import Kind, Severity
from agent.core.peers import creds_doc, is_admin, peer_credentials, peer_doc
from agent.core.ports import ApiHost, MetricsView
from agent.core.reports import brief, parse_report, seconds
from agent.core.subscribers import CLOSE, HubFull, Subscriber
from agent.service.clientlog import BadRequestFilter, ClientMistakes, StreamTally, Tally

AGENT_KEY: web.AppKey[ApiHost] = web.AppKey("agent")
MISTAKES_KEY: web.AppKey[ClientMistakes] = web.AppKey("mistakes")
STREAMS_KEY: web.AppKey[StreamTally] = web.AppKey("streams")
REPORTS_KEY: web.AppKey[Tally] = web.AppKey("reports")
MAX_DRILL_S = 7 * 24 * 3600.0


def parse_drill(doc: Any, default_in_s: float = 120.0) -> tuple[Kind, float, Severity | None, str]:
    """Validate a drill request ``{"kind", "in_s", "severity", "reason"}``; raises NoticeError."""
    if doc is None:
        doc = {}
    if not isinstance(doc, Mapping):
        raise NoticeError("a drill request must be a JSON object")
    unknown = sorted(set(doc) - {"kind", "in_s", "severity", "reason"})
    if unknown:
        shown = ", ".join(brief(name) for name in unknown[:5]) + (
            f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
        )
        raise NoticeError(f"unknown field(s) {shown}; known: in_s, kind, reason, severity")
    try:
        kind = Kind(doc.get("kind", "termination"))
    except ValueError as exc:
        raise NoticeError(
            f"field 'kind' must be one of {', '.join(k.value for k in Kind)}, got {brief(doc.get('kind'))}"
        ) from exc
    in_s = seconds(doc.get("in_s", default_in_s), "in_s", MAX_DRILL_S, NoticeError)
    severity = None
    if doc.get("severity") is not None:
        try:
            severity = Severity(doc["severity"])
        except ValueError as exc:
            raise NoticeError(
                f"field 'severity' must be info, warning or critical, got {brief(doc['severity'])}"
            ) from exc
    reason = doc.get("reason", f"drill: {kind.value}")
    if not isinstance(reason, str) or not reason or len(reason) > 512:
        raise NoticeError("field 'reason' must be a non-empty string of at most 512 characters")
    return kind, float(in_s), severity, reason


def _error(status: int, message: str, **extra: Any) -> web.Response:
    return web.json_response({"error": message, **extra}, status=status)


class BodyCutShort(Exception):
    """The connection ended (closed, reset, or half-closed by the client) before the request's body had
    arrived whole: a client's mistake like any malformed request, not an error of the agent."""

    def __init__(self, received: int, declared: int | None, peer: Mapping[str, Any]) -> None:
        of = f" of {declared}" if declared is not None else ""
        super().__init__(f"the connection ended after {received}{of} body bytes")
        self.peer = peer


def _cut_short(request: web.Request, exc: BodyCutShort) -> None:
    request.app[MISTAKES_KEY].warning(
        "bad_request", path=request.path, status=400, error=str(exc), peer=exc.peer
    )


async def _read_json(request: web.Request) -> Any:
    agent = request.app[AGENT_KEY]
    limit = agent.config.api.max_body_bytes
    if request.content_length is not None and request.content_length > limit:
        raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=request.content_length)
    # One read() returns what has arrived so far, not the whole body: read to the end, bounded in size
    # and in time (a body sent a byte at a time must not hold the connection).
    timeout = agent.config.api.idle_timeout_s
    peer = peer_doc(request)  # while the connection is there to ask
    body = _read_body(request, limit)
    try:
        # A body that came whole with its request (a drill's, a report's) is read at once, without the
        # timeout's own task and the loop turns it takes: on a drill, those come before the fan-out.
        raw = await (body if request.content.is_eof() else asyncio.wait_for(body, timeout))
    except asyncio.TimeoutError as exc:
        raise web.HTTPRequestTimeout(reason=f"the body did not arrive within {timeout:g}s") from exc
    except ConnectionError:
        # aiohttp ends the body with ConnectionResetError("Connection lost") when the connection goes.
        raise BodyCutShort(request.content.total_bytes, request.content_length, peer) from None
    except asyncio.CancelledError:
        # The same, seen from the other side: aiohttp also cancels the handler of a connection that is
        # gone, and which of the two arrives first is up to the event loop. A cancellation with the
        # connection still there is someone else's (the agent stopping): not the client's mistake.
        if request.transport is None:
            _cut_short(request, BodyCutShort(request.content.total_bytes, request.content_length, peer))
        raise
    if not raw.strip():
        return None
    try:
        return json.loads(raw)
    except UnicodeDecodeError as exc:
        raise ReportError(f"body is not UTF-8: {exc}") from exc
    except ValueError as exc:
        raise ReportError(f"body is not valid JSON: {str(exc)[:200]}") from exc
    except RecursionError as exc:
        # The decoder guards its own recursion; no request body of this API nests more than a few levels.
        raise ReportError("body is not valid JSON: arrays or objects nested too deeply") from exc


async def _read_body(request: web.Request, limit: int) -> bytes:
    raw = b""
    while chunk := await request.content.read(limit + 1 - len(raw)):
        raw += chunk
        if len(raw) > limit:
            raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=len(raw))
    return raw


@web.middleware
async def error_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    agent = request.app[AGENT_KEY]
    try:
        return await handler(request)
    except web.HTTPRequestEntityTooLarge as exc:
        request.app[MISTAKES_KEY].warning(
            "bad_request", path=request.path, status=413, error="body too large", peer=peer_doc(request)
        )
        return _error(
            413, f"body too large: the limit is {agent.config.api.max_body_bytes} bytes", limit=exc.text
        )
    except web.HTTPNotFound:
        return _error(
            404,
            f"no endpoint {request.method} {request.path}; the API is under /v1 (status, events, reports, drills, advice) and /metrics",
        )
    except web.HTTPMethodNotAllowed as exc:
        allowed = ", ".join(sorted(exc.allowed_methods))
        return _error(405, f"{request.method} is not allowed on {request.path}; use {allowed}")
    except web.HTTPRequestTimeout as exc:
        request.app[MISTAKES_KEY].warning(
            "bad_request", path=request.path, status=408, error=exc.reason, peer=peer_doc(request)
        )
        answer = _error(408, exc.reason)
        answer.force_close()  # the rest of the body is not waited for
        return answer
    except BodyCutShort as exc:
        _cut_short(request, exc)
        # Nobody is left to read it: aiohttp's attempt to send it ends the connection quietly.
        answer = _error(400, str(exc))
        answer.force_close()
        return answer
    except web.HTTPException as exc:
        if exc.status >= 400:
            return _error(exc.status, exc.reason)
        raise


async def status(request: web.Request) -> web.Response:
    return web.json_response(request.app[AGENT_KEY].status(), dumps=_dumps)


def _dumps(value: Any) -> str:
    return json.dumps(value, default=str)


_STREAM_HEADERS = {
    "Content-Type": "text/event-stream; charset=utf-8",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}


async def events(request: web.Request) -> web.StreamResponse:
    agent = request.app[AGENT_KEY]
    peer = peer_doc(request)
    try:
        sub = agent.hub.subscribe(peer)
    except HubFull as exc:
        request.app[MISTAKES_KEY].warning("subscriber_refused", error=str(exc), peer=peer)
        return _error(503, str(exc))
    agent.hooks.subscriber_connected(peer)
    last_event_id = request.headers.get("Last-Event-ID")
    resume = agent.hub.resume_from(last_event_id)
    transport = request.transport

    def abort(reason: str) -> None:
        if transport is not None:
            transport.abort()

    sub.on_kick = abort
    response = web.StreamResponse(headers=_STREAM_HEADERS)
    streams = request.app[STREAMS_KEY]
    streams.connected(
        subscriber=sub.id,
        peer=peer,
        last_event_id=last_event_id,
        snapshot=resume.snapshot,
        replay=len(resume.frames),
    )
    reason = "client closed the stream"
    try:
        await response.prepare(request)
        first = (
            [agent.hub.snapshot_frame(agent.board.active(), agent.now())]
            if resume.snapshot
            else list(resume.frames)
        )
        if first:
            await response.write(b"".join(first))
        reason = await _stream(response, sub, transport, wrote=bool(first))
    except (ConnectionResetError, ConnectionError, asyncio.CancelledError) as exc:
        reason = sub.closed_reason or (
            "cancelled" if isinstance(exc, asyncio.CancelledError) else "client went away"
        )
        if isinstance(exc, asyncio.CancelledError):
            raise
    finally:
        agent.hub.unsubscribe(sub)
        streams.disconnected(
            sub.closed_reason or reason, subscriber=sub.id, peer=peer, delivered=sub.delivered
        )
    with contextlib.suppress(ConnectionError):
        await response.write_eof()
    return response


async def _stream(
    response: web.StreamResponse, sub: Subscriber, transport: asyncio.Transport | None, wrote: bool
) -> str:
    """Write the subscriber's frames until the agent closes the stream, and say so; ``wrote``: the head is
    on the wire already, so direct writes may follow it."""
    chunked = response.headers.get("Transfer-Encoding", "").lower() == "chunked"

    def direct(frame: bytes) -> bool:
        # Only when everything written before has left for the kernel: order and memory bounds stay
        # those of the queue path, and a client that stops reading still ends up with a full queue.
        if transport is None or transport.is_closing() or transport.get_write_buffer_size():
            return False
        transport.write(_chunk(frame) if chunked else frame)
        sub.delivered += 1
        return True

    while True:
        if wrote and sub.queue.empty():
            sub.direct = direct
        try:
            frame = await sub.queue.get()
        finally:
            sub.direct = None
        if frame is CLOSE or frame == CLOSE:
            return "agent shutting down"
        await response.write(frame)
        wrote = True
        sub.delivered += 1


@functools.lru_cache(maxsize=16)
def _chunk(frame: bytes) -> bytes:
    """``frame`` as one HTTP/1.1 chunk, as aiohttp frames a ``write``; cached, so a fan-out builds it once."""
    return b"%x\r\n%s\r\n" % (len(frame), frame)


async def reports(request: web.Request) -> web.Response:
    agent = request.app[AGENT_KEY]
    creds = peer_credentials(request)
    try:
        doc = await _read_json(request)
        report = parse_report(
            doc, agent.now(), peer_pid=creds[0] if creds else None, peer_uid=creds[1] if creds else None
        )
    except ReportError as exc:
        agent.reports_rejected += 1
        request.app[MISTAKES_KEY].warning("report_rejected", error=str(exc), peer=peer_doc(request))
        return _error(400, str(exc))
    refusal = agent.hooks.check_report(report, is_admin(creds, agent.config.admin_group)[0])
    if refusal is not None:
        agent.reports_rejected += 1
        request.app[MISTAKES_KEY].warning(
            "report_refused", status=refusal[0], error=refusal[1], peer=peer_doc(request)
        )
        return _error(*refusal)
    agent.hooks.accept_report(report)
    # Any socket user may report in a loop: at info, counts per interval (each report is a debug line).
    job = report.client.get("job") or report.client.get("name") or "unnamed"
    request.app[REPORTS_KEY].count({"kinds": f"{report.kind} {report.phase}", "jobs": str(job)})
    return web.json_response({"accepted": True, "report": report.to_json()}, status=202)


async def drills(request: web.Request) -> web.Response:
    agent = request.app[AGENT_KEY]
    creds = peer_credentials(request)
    allowed, why = is_admin(creds, agent.config.admin_group)
    peer = creds_doc(creds)
    if not allowed:
        request.app[MISTAKES_KEY].warning("drill_refused", why=why, peer=peer)
        return _error(403, f"drills need an administrator: {why}")
    try:
        doc = await _read_json(request)
        kind, in_s, severity, reason = parse_drill(doc)
    except (NoticeError, ReportError) as exc:
        request.app[MISTAKES_KEY].warning("drill_rejected", error=str(exc), peer=peer)
        return _error(400, str(exc))
    notice = agent.drills.drill(kind, in_s, severity, reason, peer)
    # Published at once (no disk write on the way to the subscribers), answered once on disk: a drill that
    # was answered survives a crash of the agent.
    await agent.keeper.flush()
    return web.json_response({"notice": notice.to_json(agent.now())}, status=201)


async def clear_drill(request: web.Request) -> web.Response:
    agent = request.app[AGENT_KEY]
    allowed, why = is_admin(peer_credentials(request), agent.config.admin_group)
    if not allowed:
        return _error(403, f"drills need an administrator: {why}")
    notice_id = request.match_info["notice_id"]
    notice = agent.board.get(notice_id)
    if notice is None or not notice.drill:
        return _error(404, f"no active drill with id {notice_id!r}")
    cleared = agent.retract(notice.source, notice.key, "drill cleared by request")
    assert cleared is not None
    await agent.keeper.flush()
    return web.json_response({"notice": cleared.to_json(agent.now())})


class AgentCollector:
    """Prometheus metrics read from the agent at scrape time."""

    def __init__(self, agent: MetricsView) -> None:
        self.agent = agent

    def collect(self) -> list[Metric]:
        agent = self.agent
        now = agent.now()
        info = InfoMetricFamily("preemptd_build", "Agent version", labels=["version"])
        info.add_metric([__version__], {"version": __version__})
        families = [
            info,
            *_notice_families(agent, now),
            *_stream_families(agent),
            *_report_families(agent),
            *_source_families(agent),
        ]
        return [*_connection_families(agent.server.connections()), *families]


def _notice_families(agent: MetricsView, now: datetime) -> list[Metric]:
    """The active notices by kind and severity, and each one's seconds to its deadline."""
    active = GaugeMetricFamily("preemptd_notices_active", "Active notices", labels=["kind", "severity"])
    counts: dict[tuple[str, str], int] = {}
    seconds = GaugeMetricFamily(
        "preemptd_notice_seconds_left",
        "Seconds to each active notice's deadline",
        labels=["id", "kind", "source"],
    )
    for notice in agent.board.active():
        slot = (notice.kind.value, notice.severity.value)
        counts[slot] = counts.get(slot, 0) + 1
        left = notice.seconds_left(now)
        if left is not None:
            seconds.add_metric([notice.id, notice.kind.value, notice.source], left)
    for kind in Kind:
        for severity in Severity:
            active.add_metric([kind.value, severity.value], counts.get((kind.value, severity.value), 0))
    return [active, seconds]


def _stream_families(agent: MetricsView) -> list[Metric]:
    """The events published and the event-stream clients."""
    events_metric = CounterMetricFamily("preemptd_events", "Events published", labels=["type"])
    for event_type, count in sorted(agent.hub.published_total.items()):
        events_metric.add_metric([event_type], count)
    subs = GaugeMetricFamily("preemptd_subscribers", "Connected event-stream clients")
    subs.add_metric([], len(agent.hub))
    kicked = CounterMetricFamily("preemptd_subscribers_disconnected_slow", "Clients dropped for not reading")
    kicked.add_metric([], agent.hub.kicked_total)
    return [events_metric, subs, kicked]


def _report_families(agent: MetricsView) -> list[Metric]:
    """The client reports accepted, by phase, and rejected."""
    reports_metric = CounterMetricFamily("preemptd_reports", "Client reports accepted", labels=["phase"])
    # Every phase from the start, so that a rate() or an alert on failed reports has a series at 0.
    for phase in sorted({"started", "finished", "failed"} | set(agent.hooks.reports_total)):
        reports_metric.add_metric([phase], agent.hooks.reports_total.get(phase, 0))
    rejected = CounterMetricFamily("preemptd_reports_rejected", "Client reports rejected")
    rejected.add_metric([], agent.reports_rejected)
    return [reports_metric, rejected]


def _source_families(agent: MetricsView) -> list[Metric]:
    """Each source's health and failed reads, and whether the state directory is usable."""
    source_up = GaugeMetricFamily(
        "preemptd_source_up", "1 when the source is healthy", labels=["source", "state"]
    )
    source_errors = CounterMetricFamily("preemptd_source_errors", "Failed source reads", labels=["source"])
    for name, health in sorted(agent.health.items()):
        source_up.add_metric([name, health.state.value], 1 if health.state.value == "ok" else 0)
        source_errors.add_metric([name], health.errors)
    state_ok = GaugeMetricFamily("preemptd_state_ok", "1 when the state directory is usable")
    state_ok.add_metric([], 1 if agent.keeper.ok else 0)
    return [source_up, source_errors, state_ok]


def _connection_families(conn: Mapping[str, Any]) -> list[Metric]:
    """The API socket's connections and the agent's descriptors, from ``MetricsView.connections()``."""
    connections = GaugeMetricFamily("preemptd_connections", "Connections open on the API socket")
    connections.add_metric([], conn["open"])
    connections_max = GaugeMetricFamily("preemptd_connections_max", "Connections served at once")
    connections_max.add_metric([], conn["max"])
    refused = CounterMetricFamily("preemptd_connections_refused", "Connections answered 503: cap reached")
    refused.add_metric([], conn["refused"])
    accept_failed = CounterMetricFamily("preemptd_accept_failures", "Failed accepts (out of descriptors)")
    accept_failed.add_metric([], conn["accept_failures"])
    fds = GaugeMetricFamily("preemptd_open_fds", "Descriptors the agent has open")
    fds.add_metric([], conn["descriptors"]["open"] or 0)
    fds_max = GaugeMetricFamily("preemptd_max_fds", "The agent's descriptor limit (soft RLIMIT_NOFILE)")
    fds_max.add_metric([], conn["descriptors"]["limit"])
    return [connections, connections_max, refused, accept_failed, fds, fds_max]


async def metrics(request: web.Request) -> web.Response:
    registry = request.app[REGISTRY_KEY]
    body = generate_latest(registry)
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


REGISTRY_KEY: web.AppKey[CollectorRegistry] = web.AppKey("registry")


async def _quiet_bad_requests(app: web.Application) -> AsyncIterator[None]:
    """While the app serves, requests aiohttp cannot parse are logged as bounded, rate-limited warnings;
    when it stops, the last counts of event streams and of reports are written."""
    server_log = logging.getLogger("aiohttp.server")
    quiet = BadRequestFilter(app[MISTAKES_KEY])
    server_log.addFilter(quiet)
    try:
        yield
    finally:
        server_log.removeFilter(quiet)
        app[STREAMS_KEY].close()
        app[REPORTS_KEY].close()


def build_registry(agent: MetricsView) -> CollectorRegistry:
    """Every metric the agent exports: its own and its components' collectors (the Unix socket's /metrics and
    the TCP metrics listener read the same)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(AgentCollector(agent))
    for collector in agent.hooks.collectors:
        registry.register(collector)
    return registry


def build_app(
    agent: ApiHost,
    extra_routes: list[tuple[str, str, Callable[[web.Request], Awaitable[web.StreamResponse]]]],
) -> web.Application:
    app = web.Application(middlewares=[error_middleware], client_max_size=agent.config.api.max_body_bytes)
    app[AGENT_KEY] = agent
    app[MISTAKES_KEY] = ClientMistakes(agent.log)
    app[STREAMS_KEY] = StreamTally(agent.log, lambda: len(agent.hub))
    app[REPORTS_KEY] = Tally(agent.log, "reports_received")
    app.cleanup_ctx.append(_quiet_bad_requests)
    app[REGISTRY_KEY] = build_registry(agent)
    app.router.add_get("/v1/status", status)
    app.router.add_get("/v1/events", events)
    app.router.add_post("/v1/reports", reports)
    app.router.add_post("/v1/drills", drills)
    app.router.add_delete("/v1/drills/{notice_id}", clear_drill)
    app.router.add_get("/metrics", metrics)
    for method, path, handler in extra_routes:
        app.router.add_route(method, path, handler)
    return app
