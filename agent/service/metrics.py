"""Metrics where Prometheus can reach them: an opt-in TCP listener that serves ``GET /metrics`` (and the
probes ``/healthz`` and ``/readyz``, agent/service/health.py) and nothing else (``[metrics] listen``), and the
series an operator alerts on: the soonest deadline, and what became of each notice (told, flushed with what
margin, lost).

The Unix socket keeps serving ``/metrics`` as before; the TCP listener reads the same collectors.
"""

from __future__ import annotations

import ipaddress
from collections import Counter
from collections.abc import Iterator
from typing import Any

import structlog
from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from agent.config import MetricsConfig
from agent.core.errors import ConfigError
from agent.core.notice import Event, EventType
from agent.core.ports import MetricsHost, MetricsView
from agent.service.clientlog import ClientMistakes
from agent.service.connections import CappedTCPSite, ConnectionCap, open_connections
from agent.service.health import LoopWatch, Probes

log = structlog.get_logger("preemptd.metrics")

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Seconds of margin left before the deadline when a notice's participants had all saved.
MARGIN_BUCKETS = (1.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 900.0, 3600.0)


def parse_listen(text: str) -> tuple[str, int] | None:
    """``metrics.listen``: ``""`` (off), ``HOST:PORT`` or ``[IPV6]:PORT`` (port 0: any free port, logged as
    ``metrics_listening``); raises ConfigError otherwise."""
    value = text.strip()
    if not value:
        return None
    host, sep, port_text = value.rpartition(":")
    if not sep or not port_text.isdigit() or not 0 <= int(port_text) < 65536:
        raise ConfigError(
            f'metrics.listen: {text!r} is not HOST:PORT (e.g. the node\'s "10.0.0.5:9464", "127.0.0.1:9464", '
            '"[::1]:9464")'
        )
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        try:
            ipaddress.IPv6Address(host)
        except ValueError as exc:
            raise ConfigError(f"metrics.listen: {host!r} in brackets is not an IPv6 address") from exc
    if not host:
        raise ConfigError(
            f"metrics.listen: {text!r} has no host; use the node's address (0.0.0.0 would open the port on "
            "every interface)"
        )
    return host, int(port_text)


class MetricsListener:
    """A TCP server for ``GET /metrics`` (and ``/healthz``, ``/readyz`` when given ``probes``) only: every
    other path is 404 and every other method 405, so opening the port exposes no part of the API. It has the socket's limits (agent/service/connections.py): at
    most ``max_connections`` at once (503 past it), and a connection idle for ``idle_timeout_s`` (before
    its request head, or after its answer) is closed."""

    def __init__(
        self,
        host: str,
        port: int,
        registry: CollectorRegistry,
        *,
        max_connections: int,
        idle_timeout_s: float,
        mistakes: ClientMistakes | None = None,
        probes: Probes | None = None,
    ) -> None:
        self.host = host
        self.probes = probes
        self.port = port
        self._registry = registry
        self._idle_timeout_s = idle_timeout_s
        self._mistakes = mistakes or ClientMistakes(log)
        self.cap = ConnectionCap(max_connections, "metrics.max_connections", self._on_refused)
        self._runner: web.AppRunner | None = None
        self.bound: list[tuple[str, int]] = []

    def _on_refused(self, open_now: int) -> None:
        self._mistakes.warning("metrics_connection_refused", open=open_now, max=self.cap.limit)

    @property
    def open_connections(self) -> int:
        return open_connections(self._runner) if self._runner is not None else 0

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self._registry), headers={"Content-Type": CONTENT_TYPE})

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        if self.probes is not None:
            self.probes.add_routes(app)
        self._runner = web.AppRunner(
            app,
            handle_signals=False,
            access_log=None,
            # As on the socket: closes a connection that never completes a request head, or idles after.
            keepalive_timeout=self._idle_timeout_s,
            lingering_time=self._idle_timeout_s,
        )
        await self._runner.setup()
        site = CappedTCPSite(self._runner, self.host, self.port, cap=self.cap)
        try:
            await site.start()
        except OSError as exc:
            await self.stop()
            raise ConfigError(
                f"metrics.listen: cannot listen on {self.host}:{self.port}: {exc.strerror or exc}"
            ) from exc
        self.bound = [(str(a[0]), int(a[1])) for a in self._runner.addresses]
        log.info("metrics_listening", address=[f"{h}:{p}" for h, p in self.bound])

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


class NoticeOutcomes:
    """What became of each notice, from the event stream: told to clients, flushed (every participant saved
    before ready, with the margin left), or lost (a participant failed or never reported)."""

    def __init__(self) -> None:
        self.told: Counter[tuple[str, str]] = Counter()
        self.flushed: Counter[tuple[str, str]] = Counter()
        self.lost: Counter[tuple[str, str]] = Counter()
        self.margins: list[float] = []

    def on_event(self, event: Event, subscribers: int) -> None:
        notice = event.notice
        if notice is None:
            return
        labels = (notice.kind.value, "true" if notice.drill else "false")
        if event.type is EventType.NOTICE and subscribers > 0:
            self.told[labels] += 1
        elif event.type is EventType.READY:
            data = event.data
            if data.get("failed") or data.get("missing"):
                self.lost[labels] += 1
            elif data.get("finished"):
                self.flushed[labels] += 1
                margin = data.get("margin_s")
                if isinstance(margin, (int, float)):
                    self.margins.append(float(margin))

    def collect(self) -> Iterator[Metric]:
        for name, help_text, counts in (
            ("preemptd_notices_told", "Notices announced while at least one client was connected", self.told),
            ("preemptd_notices_flushed", "Notices whose participants all saved before ready", self.flushed),
            ("preemptd_notices_lost", "Notices where a participant failed or never reported", self.lost),
        ):
            family = CounterMetricFamily(name, help_text, labels=["kind", "drill"])
            for (kind, drill), value in sorted(counts.items()):
                family.add_metric([kind, drill], value)
            yield family
        buckets = [
            (str(bound), float(sum(1 for m in self.margins if m <= bound))) for bound in MARGIN_BUCKETS
        ]
        buckets.append(("+Inf", float(len(self.margins))))
        histogram = HistogramMetricFamily(
            "preemptd_notice_flush_margin_seconds",
            "Seconds left before the deadline when a notice's participants had all saved",
        )
        histogram.add_metric([], buckets, sum_value=sum(self.margins))
        yield histogram


class DeadlineCollector:
    """The soonest deadline among active notices, as a Unix timestamp and as seconds left (absent when no
    active notice has a deadline)."""

    def __init__(self, agent: MetricsView) -> None:
        self._agent = agent

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        now = self._agent.now()
        deadlines = [n.deadline for n in self._agent.board.active() if n.deadline is not None]
        at = GaugeMetricFamily(
            "preemptd_next_deadline_timestamp_seconds", "Soonest deadline of an active notice (Unix time)"
        )
        left = GaugeMetricFamily("preemptd_next_deadline_seconds", "Seconds to the soonest active deadline")
        if deadlines:
            soonest = min(deadlines)
            at.add_metric([], soonest.timestamp())
            left.add_metric([], (soonest - now).total_seconds())
        yield at
        yield left


class _OutcomeCollector:
    def __init__(self, outcomes: NoticeOutcomes) -> None:
        self._outcomes = outcomes

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        return self._outcomes.collect()


class MetricsComponent:
    """Adds the deadline and outcome series, and runs the TCP listener when ``metrics.listen`` is set."""

    name = "metrics"

    def __init__(self, config: MetricsConfig, idle_timeout_s: float) -> None:
        self._address = parse_listen(config.listen)
        self.watch = LoopWatch(config.stall_s)
        self._max_connections = config.max_connections
        self._idle_timeout_s = idle_timeout_s
        self.outcomes = NoticeOutcomes()
        self.listener: MetricsListener | None = None
        self._agent: MetricsHost | None = None

    def setup(self, agent: MetricsHost) -> None:
        self._agent = agent
        agent.hooks.add_metrics_collector(DeadlineCollector(agent))
        agent.hooks.add_metrics_collector(_OutcomeCollector(self.outcomes))
        agent.fanout.on_event(self._on_event)
        agent.hooks.add_status_section("metrics", self.status)

    def _on_event(self, event: Event) -> None:
        assert self._agent is not None
        self.outcomes.on_event(event, len(self._agent.hub))

    async def start(self) -> None:
        if self._address is None or self._agent is None:
            return
        from agent.service.api import build_registry

        self.watch.start()
        self.listener = MetricsListener(
            *self._address,
            build_registry(self._agent),
            max_connections=self._max_connections,
            idle_timeout_s=self._idle_timeout_s,
            probes=Probes(self.watch, self._agent.readiness),
        )
        try:
            await self.listener.start()
        except BaseException:
            await self.watch.stop()
            raise

    async def stop(self) -> None:
        if self.listener is not None:
            await self.listener.stop()
        await self.watch.stop()

    def status(self) -> dict[str, Any]:
        listener = self.listener
        if listener is None:
            return {"listen": []}
        return {
            "listen": [f"{h}:{p}" for h, p in listener.bound],
            "loop": self.watch.to_json(),
            "connections": {
                "open": listener.open_connections,
                "max": listener.cap.limit,
                "refused": listener.cap.refused_total,
            },
        }
