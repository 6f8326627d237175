"""The agent as a composition root: it builds the parts (notice board, event hub and fan-out, state keeper,
health book, sources, components, HTTP API, server) and wires them together, and it is the host that
components, reactors and the API are given (the ports in agent/core/ports.py). The lifecycle — socket,
lock, start/stop order, signals — is agent/service/server.py's; persistence, agent/service/state_keeper.py's;
running the sources, agent/sources/runner.py's. docs/internals.md draws the data flow.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import time
from collections.abc import Callable, Mapping
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import structlog
from aiohttp import web

from agent import __version__
from agent.config import Config, load_config
from agent.core import status
from agent.core.board import Change, NoticeBoard
from agent.core.errors import AlreadyRunningError, ConfigError
from agent.core.fanout import Fanout
from agent.core.notice import Event, EventType, Kind, Notice, Observation, Severity, utcnow
from agent.core.ports import Component, Handler
from agent.core.reports import Report
from agent.core.source_health import HealthBook
from agent.core.subscribers import Hub, Subscriber
from agent.core.tasks import TaskSet
from agent.core.threads import call_bounded
from agent.service.clientlog import ClientMistakes
from agent.service.components import build_components, reload_all, start_all, stop_all
from agent.service.sdnotify import Notifier
from agent.service.server import Server
from agent.service.state_files import History
from agent.service.state_keeper import StateKeeper
from agent.sources import build_sources
from agent.sources.base import Source
from agent.sources.runner import SourceRunner

DRILL_SOURCE = "drill"
RELOAD_READ_S = 10.0  # the longest wait for the configuration file on SIGHUP


class Agent:
    def __init__(
        self,
        config: Config,
        sources: list[Source] | None = None,
        components: list[Component[Any]] | None = None,
        clock: Callable[[], datetime] = utcnow,
        reload_config: Callable[[], Config] | None = None,
    ) -> None:
        self.config = config
        self.now = clock
        self.log = structlog.get_logger("preemptd")
        self.boot_id = secrets.token_hex(8)
        self.started_at = clock()
        self._started_mono = time.monotonic()
        self.board = NoticeBoard(scope=host_boot_id())
        self.hub = Hub(
            queue_size=config.api.queue_size,
            ring_size=config.api.ring_size,
            max_subscribers=config.api.max_subscribers,
            on_overflow=self._on_overflow,
        )
        self.tasks = TaskSet("agent", failure_event="task_failed")
        self.keeper = StateKeeper(config.state_dir, config.history_max_bytes, self.boot_id, clock, self.log)
        self.keeper.bind(
            lambda: (self.hub.seq, self.board.active(), {"notice_occurrences": self.board.occurrences()})
        )
        self.fanout = Fanout(self.hub, self.keeper.record, self._listener_failed, self.log)
        self.fanout.add(self.keeper.lease_sequence)
        self.health = HealthBook(clock, self.log)
        self.runner = SourceRunner(
            self.board, self._apply, clock, self.health, self.tasks, self.log, self._identify
        )
        self._own_sources = sources is None
        self.runner.sources = {s.name: s for s in (sources if sources is not None else [])}
        self.components: list[Component[Any]] = list(components) if components is not None else []
        self._build_components = components is None
        self.cloud: str | None = None if config.cloud == "auto" else config.cloud
        self.instance: dict[str, Any] = {}
        self.notifier = Notifier()
        self.server = Server(self, self.notifier, self.tasks, ClientMistakes(self.log), self.log)
        self.reports_total: dict[str, int] = {}
        self.reports_rejected = 0
        self._reload_config = reload_config
        self._routes: list[tuple[str, str, Handler]] = []
        self._status_sections: dict[str, Callable[[], Any]] = {}
        self._collectors: list[Any] = []
        self._capabilities: dict[str, Any] = {}
        self._report_listeners: list[Callable[[Report], None]] = []
        self._report_checks: list[Callable[[Report, bool], tuple[int, str] | None]] = []
        self._subscriber_listeners: list[Callable[[Mapping[str, Any]], None]] = []
        self._board_changed = asyncio.Event()
        self._drills = 0
        self._restored = 0
        self._previous_clean: bool | None = None

    # ----- the parts, as the rest of the code and the tests read them -----

    @property
    def sources(self) -> dict[str, Source]:
        return self.runner.sources

    @property
    def history(self) -> History:
        return self.keeper.history

    @property
    def state_ok(self) -> bool:
        return self.keeper.ok

    @property
    def socket_path(self) -> Path | None:
        return self.server.socket_path

    @property
    def opened(self) -> bool:
        return self.keeper.loaded

    def connections(self) -> dict[str, Any]:
        return self.server.connections()

    # ----- the host port (agent/core/ports.py; docs/internals.md) -----

    def add_route(self, method: str, path: str, handler: Handler) -> None:
        self._routes.append((method, path, handler))

    def add_status_section(self, name: str, fn: Callable[[], Any]) -> None:
        self._status_sections[name] = fn

    def add_metrics_collector(self, collector: Any) -> None:
        self._collectors.append(collector)

    def metrics_collectors(self) -> tuple[Any, ...]:
        return tuple(self._collectors)

    def on_event(self, fn: Callable[[Event], None]) -> None:
        self.fanout.add(fn)

    def on_report(self, fn: Callable[[Report], None]) -> None:
        self._report_listeners.append(fn)

    def capability(self, name: str) -> Any | None:
        if name in self._capabilities:
            return self._capabilities[name]
        return self.runner.capability(name)

    def provide(self, name: str, fn: Any) -> None:
        self._capabilities[name] = fn

    def add_report_check(self, fn: Callable[[Report, bool], tuple[int, str] | None]) -> None:
        self._report_checks.append(fn)

    def on_subscriber(self, fn: Callable[[Mapping[str, Any]], None]) -> None:
        self._subscriber_listeners.append(fn)

    def subscriber_connected(self, peer: Mapping[str, Any]) -> None:
        for listener in self._subscriber_listeners:
            try:
                listener(peer)
            except Exception as exc:
                self.log.error("subscriber_listener_failed", listener=repr(listener), error=repr(exc))

    def check_report(self, report: Report, privileged: bool) -> tuple[int, str] | None:
        for check in self._report_checks:
            refusal = check(report, privileged)
            if refusal is not None:
                return refusal
        return None

    def publish_ready(self, notice_id: str, data: Mapping[str, Any] | None = None) -> Event:
        notice = self.board.get(notice_id)
        event = self.fanout.emit(
            EventType.READY, self.now(), notice=notice, data={"notice_id": notice_id, **(data or {})}
        )
        self.log.info("notice_ready", notice_id=notice_id, **dict(data or {}))
        return event

    def inject(self, source: str, obs: Observation) -> Notice | None:
        change = self.board.observe(source, obs, self.now())
        self._apply([change] if change else [])
        return self.board.get(change.notice.id) if change else None

    def retract(self, source: str, key: str, reason: str | None = None) -> Notice | None:
        change = self.board.clear(source, key, self.now(), reason)
        self._apply([change] if change else [])
        return change.notice if change else None

    def record(self, record: Mapping[str, Any]) -> None:
        """Append a record (a dict with ``type``) to the history log; ``time`` is added. Never blocks."""
        self.keeper.record(record)

    async def persist(self) -> None:
        """Write the state and the pending history now; returns once they are on disk (or the state
        directory is known to be unusable). For changes that must be durable before they are answered."""
        await self.keeper.flush()

    # ----- notices, reports, drills -----

    def _apply(self, changes: list[Change]) -> None:
        self.fanout.apply(changes, self.now())
        if changes:
            self.keeper.changed()
            self._board_changed.set()
            self._notify_status()

    def _listener_failed(self, listener: Callable[[Event], None], exc: Exception) -> None:
        self.log.error("event_listener_failed", listener=repr(listener), error=repr(exc))

    def _identify(self, cloud: str, instance: Mapping[str, Any]) -> None:
        self.cloud, self.instance = cloud, dict(instance)

    def accept_report(self, report: Report) -> None:
        self.reports_total[report.phase] = self.reports_total.get(report.phase, 0) + 1
        self.log.info(
            "report_received",
            phase=report.phase,
            step=report.step,
            duration_s=report.duration_s,
            bytes=report.bytes,
            emergency=report.emergency,
            notice_id=report.notice_id,
            client=dict(report.client),
            peer_pid=report.peer_pid,
        )
        self.keeper.record({"type": "report", "report": report.to_json()})
        self.runner.on_report(report)
        for listener in self._report_listeners:
            try:
                listener(report)
            except Exception as exc:
                self.log.error("report_listener_failed", listener=repr(listener), error=repr(exc))

    def drill(
        self, kind: Kind, in_s: float, severity: Severity | None, reason: str, peer: Mapping[str, Any]
    ) -> Notice:
        self._drills += 1
        obs = Observation(
            key=f"drill-{self.boot_id}-{self._drills}",
            kind=kind,
            reason=reason,
            deadline=self.now() + timedelta(seconds=in_s),
            severity=severity,
            detail={"requested_by": dict(peer), "in_s": in_s},
            drill=True,
        )
        notice = self.inject(DRILL_SOURCE, obs)
        assert notice is not None
        self.log.info("drill_injected", notice_id=notice.id, kind=kind.value, in_s=in_s, peer=dict(peer))
        return notice

    def _grace_for(self, notice: Notice) -> timedelta | None:
        """How long a notice outlives its deadline: none while its source still speaks for it."""
        if notice.drill:
            return timedelta(seconds=self.config.drill_linger_s)
        if notice.source in self.sources and self.health.running(notice.source):
            return None
        return timedelta(seconds=self.config.expire_grace_s)

    async def _expire_loop(self) -> None:
        while True:
            self._apply(self.board.expire(self.now(), self._grace_for))
            next_at = self.board.next_expiry(self._grace_for)
            wait = None if next_at is None else max(0.05, (next_at - self.now()).total_seconds())
            self._board_changed.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._board_changed.wait(), timeout=wait)

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.api.heartbeat_s)
            self.hub.heartbeat()

    # ----- status -----

    def overall(self) -> str:
        return status.overall(self.board.active(), self.keeper.ok, self.health)

    def status(self) -> dict[str, Any]:
        identity = {
            "version": __version__,
            "boot_id": self.boot_id,
            "pid": os.getpid(),
            "started_at": self.started_at.isoformat(timespec="seconds").replace("+00:00", "Z"),
            "uptime_s": round(time.monotonic() - self._started_mono, 3),
            "cloud": self.cloud,
            "instance": self.instance,
            "socket": str(self.socket_path) if self.socket_path else None,
            "socket_activated": self.server.activated,
            "state_dir": str(self.config.state_dir),
            "config_file": str(self.config.config_file) if self.config.config_file else None,
        }
        return status.document(
            self.now(),
            identity,
            self.board.active(),
            self.health,
            self.runner.status(self.started_at),
            self.hub,
            self.connections(),
            (self.keeper.ok, self.keeper.error),
            self._status_sections,
        )

    def _notify_status(self) -> None:
        self.notifier.notify(status=status.systemd_line(self.board.active(), len(self.hub), self.now()))

    def _on_overflow(self, sub: Subscriber) -> None:
        self.log.warning(
            "subscriber_disconnected_slow", subscriber=sub.id, peer=dict(sub.peer), queued=sub.queue.qsize()
        )

    # ----- the parts' start and stop, in the server's order (agent/service/server.py) -----

    async def open(self) -> web.Application:
        """After the socket is bound: restore the state, build the parts, set them up; returns the app."""
        from agent.service.api import build_app  # the handlers are typed against the ports, not Agent

        # Event streams leave room for requests answered at once (status, reports, drills).
        self.hub.max_subscribers = min(self.config.api.max_subscribers, self.server.budget.streams)
        loaded = self.keeper.load()
        self.hub.seq = loaded.seq
        self.board.restore(loaded.notices, loaded.extra.get("notice_occurrences"))
        self.keeper.started(loaded, __version__)
        # Written before the components are set up, so what they read from the history includes this start.
        await self.keeper.flush()
        self._restored = len(loaded.notices)
        self._previous_clean = loaded.previous_clean
        if self._own_sources:
            self.runner.sources = {s.name: s for s in build_sources(self.config)}
        if self._build_components:
            self.components = build_components(self.config)
        for component in self.components:
            component.setup(self)
        return build_app(self, self._routes)

    async def start_parts(self) -> None:
        self.tasks.spawn(self.keeper.writer(), "state-writer")
        self.tasks.spawn(self._expire_loop(), "expiry")
        self.tasks.spawn(self._heartbeat_loop(), "heartbeat")
        self.runner.start()
        await start_all(self.components)
        await self.keeper.flush()
        self._notify_status()
        self.log.info(
            "agent_started",
            version=__version__,
            socket=str(self.socket_path),
            socket_activated=self.server.activated,
            state_dir=str(self.config.state_dir),
            cloud=self.config.cloud,
            sources=sorted(self.sources),
            restored=self._restored,
            previous_clean=self._previous_clean,
        )

    async def stop_parts(self, timeout: float) -> None:
        """Sources, then components in reverse, then the event streams; each bounded by ``timeout``."""
        self.log.info("agent_stopping", active_notices=len(self.board), subscribers=len(self.hub))
        await self.runner.stop(timeout)
        await stop_all(self.components, timeout, self.log)
        self.hub.close_all()

    async def close(self, timeout: float) -> None:
        await self.tasks.close(timeout, grace=0)  # the agent's loops never end by themselves
        self.keeper.record({"type": "agent_stop", "boot_id": self.boot_id})
        await self.keeper.flush(clean=True)
        self.log.info("agent_stopped")

    async def reload(self) -> None:
        """SIGHUP: re-read the configuration; apply what can change live, keep the old one on error."""
        if self._reload_config is None:
            self.log.info("reload_ignored", why="the agent was not started from a configuration file")
            return
        self.notifier.notify(reloading=1, monotonic_usec=int(time.monotonic() * 1_000_000))
        try:
            # Off the loop and bounded: a file on a hung mount must not stop it (FIFOs are refused unread).
            new = await call_bounded(self._reload_config, RELOAD_READ_S, "reading the configuration")
        except (ConfigError, TimeoutError) as exc:
            self.log.error("reload_failed", error=str(exc), effect="keeping the running configuration")
            self.notifier.notify(ready=1)
            return
        from agent.service.logs import configure_logging

        restart_needed = [
            k
            for k in ("socket", "state_dir", "socket_group", "socket_mode")
            if getattr(new, k) != getattr(self.config, k)
        ]
        old, self.config = self.config, new
        configure_logging(new.log_format, new.log_level)
        if restart_needed:
            self.log.warning(
                "reload_partial", keys=restart_needed, effect="these take effect at the next restart"
            )
        if self._own_sources and new != old:
            await self.runner.replace(build_sources(new))
        await reload_all(self.components, new)
        self.log.info("config_reloaded", file=str(new.config_file) if new.config_file else None)
        self.notifier.notify(ready=1)

    # ----- the lifecycle, for callers that hold the agent (tests, the demo, benchmarks) -----

    async def start(self) -> None:
        await self.server.startup()

    async def stop(self) -> None:
        await self.server.shutdown()

    async def run(self) -> None:
        """Start, serve until SIGTERM/SIGINT, stop. SIGHUP reloads the configuration."""
        await self.server.run()

    def request_shutdown(self) -> None:
        self.server.shutdown_event.set()


def run_agent(config: Config, reload_config: Callable[[], Config] | None = None) -> int:
    """Entry point of ``preemptd run``: returns the process exit status."""
    agent = Agent(config, reload_config=reload_config)
    try:
        asyncio.run(agent.run())
    except AlreadyRunningError as exc:
        agent.log.error("already_running", error=str(exc))
        return 3
    except ConfigError as exc:
        agent.log.error("config_invalid", error=str(exc))
        return 2
    return 0


def host_boot_id() -> str:
    """This boot of the host (the kernel's random boot id): notices without an identity of their own are
    told apart by it across agent restarts."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as handle:
            return handle.read().strip()
    except OSError:
        return ""


__all__ = ["Agent", "Component", "build_components", "load_config", "run_agent"]
