"""The agent: owns the notice board, the hub, the sources, the components, the API server and every task,
and runs them through one fixed start-up and shutdown order.

Start: logging → state directory and state file → socket bound (or taken from systemd) → server → sources
and components → ``READY=1``. Stop (SIGTERM/SIGINT): ``STOPPING=1`` → stop accepting → sources →
components → end the event streams → server cleanup (bounded) → final state save.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import grp
import json
import os
import random
import secrets
import signal
import socket
import stat
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, Protocol

import structlog
from aiohttp import web

from agent import __version__
from agent.clientlog import ClientMistakes
from agent.config import Config, load_config
from agent.connections import (
    RESERVED_FDS,
    AcceptFailures,
    CappedSockSite,
    descriptor_limit,
    open_descriptors,
    raise_descriptor_limit,
)
from agent.errors import AlreadyRunningError, ConfigError, StateError
from agent.fanout import Fanout
from agent.hub import Hub, Subscriber
from agent.notice import Change, Event, EventType, Kind, Notice, NoticeBoard, Observation, Severity, utcnow
from agent.reports import Report
from agent.sdnotify import Notifier, listen_fds
from agent.sources import build_sources
from agent.sources.base import HealthState, Source, SourceHealth
from agent.state import History, LoadedState, load_state, prepare_dir, save_state, state_document
from agent.tasks import TaskSet

DRILL_SOURCE = "drill"
# Sequence numbers are leased ahead of use: the state file holds a mark above every number handed out, and a
# new lease is written, off the event path, when half of the current one is used. After a crash the agent
# starts numbering at the mark, so no number is used twice (a clean stop saves the exact last number).
SEQ_LEASE = 1 << 16
ERROR_LOG_INTERVAL_S = 60.0
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class Component(Protocol):
    """A part of the agent that lives as long as it does (actions, advisor); see docs/internals.md."""

    name: str

    def setup(self, agent: Agent) -> None: ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


def build_components(config: Config) -> list[Component]:
    """The components a configuration runs, in start order (they stop in reverse)."""
    from agent.actions import ActionsComponent
    from agent.metrics_export import MetricsComponent

    components: list[Component] = [ActionsComponent(config)]
    if config.advisor.enabled:
        from agent.advisor.component import AdvisorComponent

        components.append(AdvisorComponent())
    components.append(MetricsComponent(config.metrics.listen))
    return components


class _SourceSink:
    """The Sink handed to one source (see agent.sources.base.Sink)."""

    def __init__(self, agent: Agent, name: str) -> None:
        self._agent = agent
        self._name = name
        self.log = agent.log.bind(source=name)
        self._last_error: str | None = None
        self._last_logged = 0.0
        self._suppressed = 0

    def replace(self, observations: Iterable[Observation]) -> None:
        self._agent._apply(self._agent.board.replace_source(self._name, observations, self._agent.now()))

    def observe(self, obs: Observation) -> None:
        change = self._agent.board.observe(self._name, obs, self._agent.now())
        self._agent._apply([change] if change else [])

    def clear(self, key: str, reason: str | None = None) -> None:
        change = self._agent.board.clear(self._name, key, self._agent.now(), reason)
        self._agent._apply([change] if change else [])

    def ok(self, **detail: Any) -> None:
        self._last_error = None
        self._agent._set_health(self._name, HealthState.OK, detail=detail)

    def error(self, message: str, **fields: Any) -> None:
        # A hung or broken metadata server fails every poll: log the first failure, each new kind of
        # failure, and then at most once a minute, with a count of what was not logged.
        now = time.monotonic()
        if message != self._last_error or now - self._last_logged >= ERROR_LOG_INTERVAL_S:
            self.log.warning("source_error", error=message, repeats=self._suppressed, **fields)
            self._last_error, self._last_logged, self._suppressed = message, now, 0
        else:
            self._suppressed += 1
        self._agent._set_health(self._name, HealthState.DEGRADED, error=message)

    def identify(self, cloud: str, instance: Mapping[str, Any]) -> None:
        self._agent.cloud = cloud
        self._agent.instance = dict(instance)
        self.log.info("cloud_identified", cloud=cloud, instance=dict(instance))

    def disable(self, why: str) -> None:
        self.log.info("source_disabled", why=why)
        self._agent._set_health(self._name, HealthState.DISABLED, detail={"why": why})


class Agent:
    def __init__(
        self,
        config: Config,
        sources: list[Source] | None = None,
        components: list[Component] | None = None,
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
        self._own_sources = sources is None
        self.sources: dict[str, Source] = {s.name: s for s in (sources if sources is not None else [])}
        self.components: list[Component] = list(components) if components is not None else []
        self._build_components = components is None
        self.health: dict[str, SourceHealth] = {}
        self.cloud: str | None = None if config.cloud in ("auto",) else config.cloud
        self.instance: dict[str, Any] = {}
        self.tasks = TaskSet("agent", failure_event="task_failed")
        self.history = History(config.state_dir, config.history_max_bytes)
        self.state_ok = True
        self.state_error: str | None = None
        self.shutdown_event = asyncio.Event()
        self.notifier = Notifier()
        self.reports_total: dict[str, int] = {}
        self.reports_rejected = 0
        self.socket_path: Path | None = None
        self.activated = False
        self._reload_config = reload_config
        self._routes: list[tuple[str, str, Handler]] = []
        self._status_sections: dict[str, Callable[[], Any]] = {}
        self._collectors: list[Any] = []
        self.fanout = Fanout(self.hub, self._record, self._listener_failed)
        self._capabilities: dict[str, Any] = {}
        self._report_listeners: list[Callable[[Report], None]] = []
        self._report_checks: list[Callable[[Report, bool], tuple[int, str] | None]] = []
        self._source_tasks: dict[str, asyncio.Task[Any]] = {}
        self._runner: web.AppRunner | None = None
        self._site: CappedSockSite | None = None
        self._mistakes = ClientMistakes(self.log)
        self._accept_failures = AcceptFailures(self._mistakes)
        self._max_connections = config.api.max_connections
        self._lock_fd: int | None = None
        self._created_socket = False
        self._save_wanted = asyncio.Event()
        self._board_changed = asyncio.Event()
        self._history_pending: list[str] = []
        self._drills = 0
        self._stopping = False
        self._state_loaded = False
        self._listen_sock: socket.socket | None = None
        self._inflight: asyncio.Task[None] | None = None
        self._seq_lease = 0  # every number up to it may have been handed out
        self._seq_durable = 0  # the lease the state file holds
        self._lease_overrun = False
        self.fanout.add(self._lease_sequence)

    # ----- extension points (docs/internals.md) -----

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
        for source in self.sources.values():
            offered = source.capabilities().get(name)
            if offered is not None:
                return offered
        return None

    def provide(self, name: str, fn: Any) -> None:
        self._capabilities[name] = fn

    @property
    def events_total(self) -> dict[str, int]:
        return self.fanout.events_total

    def add_report_check(self, fn: Callable[[Report, bool], tuple[int, str] | None]) -> None:
        """``fn(report, privileged)`` may refuse a report before anyone hears of it: it returns an HTTP
        status and the reason, or None. ``privileged``: the sender is root or in the admin group."""
        self._report_checks.append(fn)

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

    # ----- notices -----

    def _apply(self, changes: list[Change]) -> None:
        for change in changes:
            event = self.fanout.emit(change.type, self.now(), notice=change.notice)
            notice = change.notice
            fields = {
                "notice_id": notice.id,
                "kind": notice.kind.value,
                "severity": notice.severity.value,
                "source": notice.source,
                "reason": notice.reason,
                "deadline": _iso(notice.deadline),
                "seconds_left": notice.seconds_left(event.time),
                "drill": notice.drill,
                "seq": event.seq,
                "subscribers": len(self.hub),
            }
            name = {EventType.NOTICE: "notice_raised", EventType.UPDATE: "notice_updated"}.get(
                change.type, "notice_cleared"
            )
            level = (
                "warning"
                if change.type is not EventType.CLEARED and notice.severity is Severity.CRITICAL
                else "info"
            )
            getattr(self.log, level)(name, **fields)
        if changes:
            self._save_wanted.set()
            self._board_changed.set()
            self._notify_status()

    def _lease_sequence(self, event: Event) -> None:
        """The first listener of every event: keep the leased sequence numbers ahead of the hub's."""
        if event.seq > self._seq_lease - SEQ_LEASE // 2:
            self._seq_lease = event.seq + SEQ_LEASE
            self._save_wanted.set()
        if event.seq > self._seq_durable and self.state_ok and not self._lease_overrun:
            # Only a burst of tens of thousands of events within one state write gets here.
            self._lease_overrun = True
            self.log.error("sequence_lease_overrun", seq=event.seq, durable=self._seq_durable)

    def _listener_failed(self, listener: Callable[[Event], None], exc: Exception) -> None:
        self.log.error("event_listener_failed", listener=repr(listener), error=repr(exc))

    def record(self, record: Mapping[str, Any]) -> None:
        """Append a record (a dict with ``type``) to the history log; ``time`` is added. Never blocks."""
        self._record(dict(record))

    def _record(self, record: dict[str, Any]) -> None:
        record = {"time": self.now().isoformat(timespec="milliseconds").replace("+00:00", "Z"), **record}
        self._history_pending.append(json.dumps(record, separators=(",", ":"), default=str))
        self._save_wanted.set()

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
        self._record({"type": "report", "report": report.to_json()})
        for source in self.sources.values():
            try:
                source.on_report(report)
            except Exception as exc:
                self.log.error("report_listener_failed", source=source.name, error=repr(exc))
        for listener in self._report_listeners:
            try:
                listener(report)
            except Exception as exc:
                self.log.error("report_listener_failed", listener=repr(listener), error=repr(exc))

    async def persist(self) -> None:
        """Write the state and the pending history now; returns once they are on disk (or the state
        directory is known to be unusable). For changes that must be durable before they are answered."""
        await self._flush(clean=False)

    def drill(
        self, kind: Kind, in_s: float, severity: Severity | None, reason: str, peer: Mapping[str, Any]
    ) -> Notice:
        self._drills += 1
        key = f"drill-{self.boot_id}-{self._drills}"
        obs = Observation(
            key=key,
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
        if notice.drill:
            return timedelta(seconds=self.config.drill_linger_s)
        if notice.source in self.sources and self.health.get(notice.source, None) is not None:
            state = self.health[notice.source].state
            if state is not HealthState.DISABLED:
                return None
        return timedelta(seconds=self.config.expire_grace_s)

    async def _expire_loop(self) -> None:
        while True:
            changes = self.board.expire(self.now(), self._grace_for)
            self._apply(changes)
            next_at = self.board.next_expiry(self._grace_for)
            wait = None if next_at is None else max(0.05, (next_at - self.now()).total_seconds())
            self._board_changed.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._board_changed.wait(), timeout=wait)

    # ----- health and status -----

    def _set_health(
        self, name: str, state: HealthState, error: str | None = None, detail: Mapping[str, Any] | None = None
    ) -> None:
        now = self.now()
        old = self.health.get(name)
        since = old.since if old is not None and old.state is state else now
        errors = (old.errors if old else 0) + (1 if error else 0)
        health = SourceHealth(
            state=state,
            since=since,
            last_error=error if error else (old.last_error if old else None),
            last_error_at=now if error else (old.last_error_at if old else None),
            last_ok_at=now if state is HealthState.OK else (old.last_ok_at if old else None),
            errors=errors,
            detail=dict(detail) if detail is not None else (dict(old.detail) if old else {}),
        )
        self.health[name] = health
        if old is not None and old.state is HealthState.DEGRADED and state is HealthState.OK:
            # Only after a failure: a source's first good read at start is not a recovery.
            self.log.info("source_recovered", source=name, after_errors=old.errors)

    def overall(self) -> str:
        notices = self.board.active()
        if any(n.severity is Severity.CRITICAL for n in notices):
            return "critical"
        if notices or not self.state_ok or any(h.state is HealthState.DEGRADED for h in self.health.values()):
            return "warning"
        return "ok"

    def status(self) -> dict[str, Any]:
        now = self.now()
        sources: dict[str, Any] = {}
        gpus: list[Any] = []
        for name, source in self.sources.items():
            health = self.health.get(name) or SourceHealth(HealthState.STARTING, self.started_at)
            extra: Mapping[str, Any] = {}
            try:
                extra = source.status()
            except Exception as exc:
                extra = {"status_error": repr(exc)}
            # The health fields (state, since, last_error, …) are reserved: a source's extras never hide them.
            sources[name] = {**extra, **health.to_json()}
            gpus.extend(extra.get("gpus", []) or [])
        doc: dict[str, Any] = {
            "schema": 1,
            "agent": {
                "version": __version__,
                "boot_id": self.boot_id,
                "pid": os.getpid(),
                "started_at": self.started_at.isoformat(timespec="seconds").replace("+00:00", "Z"),
                "uptime_s": round(time.monotonic() - self._started_mono, 3),
                "cloud": self.cloud,
                "instance": self.instance,
                "socket": str(self.socket_path) if self.socket_path else None,
                "socket_activated": self.activated,
                "state_dir": str(self.config.state_dir),
                "config_file": str(self.config.config_file) if self.config.config_file else None,
            },
            "overall": self.overall(),
            "notices": [n.to_json(now) for n in self.board.active()],
            "sources": sources,
            "gpus": gpus,
            "subscribers": {
                "connected": len(self.hub),
                "max": self.hub.max_subscribers,
                "disconnected_slow": self.hub.kicked_total,
            },
            "events": {"seq": self.hub.seq, "published": dict(self.hub.published_total)},
            "connections": self.connections(),
            "state": {"ok": self.state_ok, "error": self.state_error},
            "advice": None,
        }
        for name, fn in self._status_sections.items():
            try:
                doc[name] = fn()
            except Exception as exc:
                doc[name] = {"error": repr(exc)}
        return doc

    def connections(self) -> dict[str, Any]:
        """Connections served and refused, and the process's descriptors (status and metrics)."""
        site = self._site
        return {
            "open": site.open_connections if site is not None else 0,
            "max": self._max_connections,
            "refused": site.refused_total if site is not None else 0,
            "accept_failures": self._accept_failures.total,
            "idle_timeout_s": self.config.api.idle_timeout_s,
            "descriptors": {"open": open_descriptors(), "limit": descriptor_limit()[0]},
        }

    def _on_refused(self, open_now: int) -> None:
        self._mistakes.warning("connection_refused", open=open_now, max=self._max_connections)

    def _notify_status(self) -> None:
        notices = self.board.active()
        if notices:
            first = notices[0]
            left = first.seconds_left(self.now())
            text = f"{len(notices)} active notice(s): {first.kind.value}" + (
                f", {left:.0f}s left" if left is not None else ""
            )
        else:
            text = "no active notices"
        self.notifier.notify(status=f"{text}; {len(self.hub)} subscriber(s)")

    def _on_overflow(self, sub: Subscriber) -> None:
        self.log.warning(
            "subscriber_disconnected_slow", subscriber=sub.id, peer=dict(sub.peer), queued=sub.queue.qsize()
        )

    # ----- state -----

    def _load_state(self) -> LoadedState:
        try:
            prepare_dir(self.config.state_dir)
            loaded = load_state(self.config.state_dir, self.now())
        except StateError as exc:
            self.state_ok = False
            self.state_error = str(exc)
            self.log.error(
                "state_dir_unusable",
                error=str(exc),
                state_dir=str(self.config.state_dir),
                effect="running without persistence",
            )
            return LoadedState()
        if loaded.moved_aside is not None:
            self.log.error(
                "state_file_corrupt",
                problem=loaded.problem,
                moved_to=str(loaded.moved_aside),
                effect="starting with no notices",
            )
        return loaded

    def _state_snapshot(self, clean: bool) -> dict[str, Any]:
        return state_document(
            self.hub.seq if clean else max(self._seq_lease, self.hub.seq),
            self.board.active(),
            self.boot_id,
            clean,
            self.now(),
            {"notice_occurrences": self.board.occurrences()},
        )

    def _flush_sync(self, document: dict[str, Any] | None, lines: list[str]) -> None:
        if lines:
            self.history.write(lines)
        if document is not None:
            save_state(self.config.state_dir, document)

    async def _flush(self, clean: bool) -> None:
        """Write pending history records and the state file. A write already handed to a worker thread
        always completes, even when the task awaiting it is cancelled (shutdown), and writes never overlap:
        each flush first waits for the one before it."""
        if self._inflight is not None:
            await asyncio.shield(self._inflight)
        if not self.state_ok:
            self._history_pending.clear()
            return
        lines, self._history_pending = self._history_pending, []
        document = self._state_snapshot(clean)
        self._inflight = asyncio.get_running_loop().create_task(
            self._write(document, lines), name="state-write"
        )
        await asyncio.shield(self._inflight)

    async def _write(self, document: dict[str, Any], lines: list[str]) -> None:
        try:
            await asyncio.to_thread(self._flush_sync, document, lines)
            if document is not None:
                self._seq_durable = max(self._seq_durable, document["seq"])
        except OSError as exc:
            self.state_ok = False
            self.state_error = f"cannot write state in {self.config.state_dir}: {exc.strerror or exc}"
            self.log.error("state_write_failed", error=self.state_error)

    async def _state_writer(self) -> None:
        while True:
            await self._save_wanted.wait()
            self._save_wanted.clear()
            await self._flush(clean=False)

    # ----- socket -----

    def _take_lock(self, path: Path) -> None:
        lock_path = path.with_name(path.name + ".lock")
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise AlreadyRunningError(
                    f"another preemptd (pid {holder}) is serving {path}; stop it first"
                ) from exc
            raise
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self._lock_fd = fd

    def _bind_socket(self) -> socket.socket:
        path = self.config.socket
        path.parent.mkdir(mode=0o755 if os.geteuid() == 0 else 0o700, parents=True, exist_ok=True)
        self._take_lock(path)
        if path.exists() or path.is_symlink():
            if not stat.S_ISSOCK(path.lstat().st_mode):
                raise AlreadyRunningError(f"{path} exists and is not a socket; refusing to replace it")
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            probe.settimeout(1.0)
            try:
                probe.connect(str(path))
            except OSError:
                path.unlink()
                self.log.warning("stale_socket_replaced", socket=str(path))
            else:
                raise AlreadyRunningError(f"an agent is answering on {path}; refusing to start a second one")
            finally:
                probe.close()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(str(path))
        self._created_socket = True
        os.chmod(path, self.config.socket_mode)
        if self.config.socket_group:
            try:
                gid = grp.getgrnam(self.config.socket_group).gr_gid
            except KeyError as exc:
                sock.close()
                raise ConfigError(
                    f"key 'socket_group': no group named {self.config.socket_group!r} on this host"
                ) from exc
            os.chown(path, -1, gid)
        sock.listen(self.config.api.backlog)
        sock.setblocking(False)
        return sock

    # ----- lifecycle -----

    async def start(self) -> None:
        from agent.api import (
            build_app,
        )  # the API module imports aiohttp web handlers; keep the order explicit

        fd_limit = raise_descriptor_limit()
        wanted = self.config.api.max_connections
        self._max_connections = max(1, min(wanted, fd_limit - RESERVED_FDS))
        if self._max_connections < wanted:
            self.log.warning(
                "connection_cap_lowered",
                wanted=wanted,
                max_connections=self._max_connections,
                descriptor_limit=fd_limit,
                fix="raise LimitNOFILE= in the unit (or ulimit -n)",
            )
        activated = listen_fds()
        if activated:
            sock = activated[0]
            sock.setblocking(False)
            self.activated = True
            with contextlib.suppress(OSError):
                name = sock.getsockname()
                self.socket_path = Path(name) if isinstance(name, str) and name else self.config.socket
        else:
            # Bound (and locked) before the state is touched: a second agent must leave the first one's
            # state alone.
            sock = self._bind_socket()
            self.socket_path = self.config.socket
        self._listen_sock = sock
        loaded = self._load_state()
        self._state_loaded = True
        self.hub.seq = loaded.seq
        # Leased before the first write below, which lands before the socket serves anyone.
        self._seq_lease = loaded.seq + SEQ_LEASE
        self.board.restore(loaded.notices, loaded.extra.get("notice_occurrences"))
        if loaded.notices:
            self.log.warning(
                "notices_restored",
                count=len(loaded.notices),
                notices=[
                    {"id": n.id, "kind": n.kind.value, "deadline": _iso(n.deadline)} for n in loaded.notices
                ],
            )
        self._record(
            {
                "type": "agent_start",
                "boot_id": self.boot_id,
                "version": __version__,
                "previous_clean": loaded.previous_clean,
                "previous_boot_id": loaded.previous_boot_id,
            }
        )
        # Written before the components are set up, so what they read from the history includes this start.
        await self._flush(clean=False)
        if self._own_sources:
            self.sources = {s.name: s for s in build_sources(self.config)}
        if self._build_components:
            self.components = build_components(self.config)
        for component in self.components:
            component.setup(self)
        app = build_app(self, self._routes)
        self._runner = web.AppRunner(
            app,
            handle_signals=False,
            access_log=None,
            shutdown_timeout=self.config.api.shutdown_timeout_s,
            # A client that hangs up cancels its handler at once, so its stream is dropped without waiting
            # for the next event to fail to write.
            handler_cancellation=True,
            # Also closes a connection that never completes a request head (idle or slowloris).
            keepalive_timeout=self.config.api.idle_timeout_s,
            # How long the unread rest of a refused body is drained before the connection is closed.
            lingering_time=self.config.api.idle_timeout_s,
        )
        await self._runner.setup()
        self._accept_failures.install(asyncio.get_running_loop())
        # asyncio's create_server calls listen() again with the site's backlog (aiohttp's default: 128),
        # also on a socket from systemd: pass ours, or clients connecting at once get EAGAIN. No longer than
        # the connection cap: what waits beyond it would only be refused.
        self._site = CappedSockSite(
            self._runner,
            sock,
            backlog=min(self.config.api.backlog, self._max_connections),
            max_connections=self._max_connections,
            on_refuse=self._on_refused,
        )
        await self._site.start()
        self.tasks.spawn(self._state_writer(), "state-writer")
        self.tasks.spawn(self._expire_loop(), "expiry")
        self.tasks.spawn(self._heartbeat_loop(), "heartbeat")
        if self.notifier.watchdog_s:
            self.tasks.spawn(self._watchdog_loop(self.notifier.watchdog_s), "watchdog")
        for source in self.sources.values():
            self._start_source(source)
        for component in self.components:
            await component.start()
        await self._flush(clean=False)
        self.notifier.notify(ready=1, mainpid=os.getpid())
        self._notify_status()
        self.log.info(
            "agent_started",
            version=__version__,
            socket=str(self.socket_path),
            socket_activated=self.activated,
            state_dir=str(self.config.state_dir),
            cloud=self.config.cloud,
            sources=sorted(self.sources),
            restored=len(loaded.notices),
            previous_clean=loaded.previous_clean,
        )

    def _start_source(self, source: Source) -> None:
        self._set_health(source.name, HealthState.STARTING)
        task = self.tasks.spawn(self._run_source(source), f"source:{source.name}")
        if task is not None:
            self._source_tasks[source.name] = task

    async def _run_source(self, source: Source) -> None:
        sink = _SourceSink(self, source.name)
        delay = 1.0
        structlog.contextvars.bind_contextvars(source=source.name)
        while True:
            try:
                await source.run(sink)
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                sink.log.error("source_crashed", error=repr(exc), restart_in_s=round(delay, 2), exc_info=True)
                self._set_health(source.name, HealthState.DEGRADED, error=f"crashed: {exc!r}")
                await asyncio.sleep(delay * random.uniform(0.8, 1.2))
                delay = min(delay * 2, 30.0)

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.api.heartbeat_s)
            self.hub.heartbeat()

    async def _watchdog_loop(self, interval_s: float) -> None:
        # Pinged from the event loop itself: a wedged loop misses the pings and systemd restarts the agent.
        while True:
            self.notifier.notify(watchdog=1)
            await asyncio.sleep(interval_s / 2)

    async def reload(self) -> None:
        """SIGHUP: re-read the configuration; apply what can change live, keep the old one on error."""
        if self._reload_config is None:
            self.log.info("reload_ignored", why="the agent was not started from a configuration file")
            return
        self.notifier.notify(reloading=1, monotonic_usec=int(time.monotonic() * 1_000_000))
        try:
            new = self._reload_config()
        except ConfigError as exc:
            self.log.error("reload_failed", error=str(exc), effect="keeping the running configuration")
            self.notifier.notify(ready=1)
            return
        from agent.logs import configure_logging

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
            for name, task in list(self._source_tasks.items()):
                await self.tasks.cancel(task, timeout=2.0)
                self._source_tasks.pop(name, None)
            self.sources = {s.name: s for s in build_sources(new)}
            self.health = {k: v for k, v in self.health.items() if k in self.sources}
            for source in self.sources.values():
                self._start_source(source)
        for component in self.components:
            reload = getattr(component, "reload", None)
            if reload is not None:
                await reload(new)
        self.log.info("config_reloaded", file=str(new.config_file) if new.config_file else None)
        self.notifier.notify(ready=1)

    async def stop(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        if not self._state_loaded:  # start-up failed before anything ran: touch nothing
            self._release_socket()
            return
        timeout = self.config.api.shutdown_timeout_s
        self.notifier.notify(stopping=1)
        self.log.info("agent_stopping", active_notices=len(self.board), subscribers=len(self.hub))
        if self._site is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._site.stop(), timeout)
        for _name, task in list(self._source_tasks.items()):
            await self.tasks.cancel(task, timeout=timeout)
        for component in reversed(self.components):
            try:
                await asyncio.wait_for(component.stop(), timeout)
            except (Exception, asyncio.TimeoutError) as exc:
                self.log.warning("component_stop_failed", component=component.name, error=repr(exc))
        self.hub.close_all()
        if self._runner is not None:
            await self._runner.cleanup()
        await self.tasks.close(timeout, grace=0)  # the agent's loops never end by themselves
        self._record({"type": "agent_stop", "boot_id": self.boot_id})
        await self._flush(clean=True)
        self._release_socket()
        self._accept_failures.uninstall(asyncio.get_running_loop())
        self.notifier.close()
        self.log.info("agent_stopped")

    def _release_socket(self) -> None:
        if self._listen_sock is not None:
            self._listen_sock.close()
            self._listen_sock = None
        if self._created_socket and self.socket_path is not None:
            with contextlib.suppress(FileNotFoundError):
                self.socket_path.unlink()
            self._created_socket = False
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def request_shutdown(self) -> None:
        self.shutdown_event.set()

    async def run(self) -> None:
        """Start, serve until SIGTERM/SIGINT, stop. SIGHUP reloads the configuration."""
        loop = asyncio.get_running_loop()
        reloads: set[asyncio.Task[Any]] = set()

        def on_hup() -> None:
            if self.shutdown_event.is_set():
                self.log.info("reload_ignored", why="the agent is stopping")
                return
            task = loop.create_task(self.reload(), name="reload")
            reloads.add(task)
            task.add_done_callback(reloads.discard)

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_shutdown)
        loop.add_signal_handler(signal.SIGHUP, on_hup)
        try:
            await self.start()
            await self.shutdown_event.wait()
        finally:
            # The handlers stay until stop() returns: a second SIGTERM (or a `systemctl reload`) during the
            # bounded shutdown must not kill the agent before its final state save.
            self.shutdown_event.set()
            try:
                for task in list(reloads):
                    await self.tasks.cancel(task, timeout=2.0)
                await self.stop()
            finally:
                for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                    loop.remove_signal_handler(sig)


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


def _iso(value: datetime | None) -> str | None:
    return value.isoformat(timespec="milliseconds").replace("+00:00", "Z") if value is not None else None


__all__ = ["Agent", "Component", "build_components", "load_config", "run_agent"]
