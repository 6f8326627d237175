"""The agent as a composition root: it builds the parts (notice board, event hub and fan-out, state keeper,
health book, sources, expiry and drills, the hooks components register, the HTTP API, server), wires them
together, and is the host that components, reactors and the API are given (the ports in
agent/core/ports.py), answering each port method from the part that owns it. The lifecycle — socket, lock,
start/stop order, signals — is agent/service/server.py's; persistence, agent/service/state_keeper.py's;
running the sources, agent/sources/runner.py's. docs/internals.md draws the data flow.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog
from aiohttp import web

from agent import __version__
from agent.config import Config, load_config
from agent.core import status
from agent.core.board import NoticeBoard
from agent.core.domain import DOMAIN
from agent.core.errors import AlreadyRunningError, ConfigError
from agent.core.expiry import Drills, Expiry
from agent.core.fanout import Fanout
from agent.core.hooks import Hooks
from agent.core.notice import Event, Notice, Observation, utcnow
from agent.core.ports import Component
from agent.core.source_health import HealthBook
from agent.core.subscribers import Hub
from agent.core.tasks import TaskSet
from agent.service import plugins
from agent.service.clientlog import ClientMistakes
from agent.service.components import build_components, reload_all, start_all, stop_all
from agent.service.identity import Identity, host_boot_id
from agent.service.reload import read_config
from agent.service.sdnotify import Notifier
from agent.service.server import Server
from agent.service.state_files import History, LoadedState
from agent.service.state_keeper import StateKeeper
from agent.sources import build_sources
from agent.sources.base import Source
from agent.sources.runner import SourceRunner


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
        identity = self.identity = Identity(clock(), None if config.cloud == "auto" else config.cloud)
        api = config.api
        self.hub = Hub(api.queue_size, api.ring_size, api.max_subscribers, log=self.log)
        self.tasks = TaskSet("agent", failure_event="task_failed")
        self.board = NoticeBoard(scope=host_boot_id())
        self.keeper = StateKeeper(
            config.state_dir, config.history_max_bytes, identity.boot_id, clock, self.log
        )
        self.keeper.bind(
            lambda: (self.hub.seq, self.board.active(), {"notice_occurrences": self.board.occurrences()})
        )
        self.history: History = self.keeper.history
        self.fanout = Fanout(self.hub, self.keeper.record, self.log)
        self.health = HealthBook(clock, self.log)
        self.runner = SourceRunner(self.board, clock, self.health, self.tasks, self.log, identity.identify)
        self.runner.sources = {s.name: s for s in sources or []}
        self.expiry = Expiry(self.board, clock, lambda: self.config, self._speaks_for)
        self.drills = Drills(identity.boot_id, self.inject, clock, self.log)
        self.hooks = Hooks(self.log, self.runner.capability)
        self.hooks.provide(DOMAIN, identity.domain)
        self.reports_rejected = 0  # counted by the API's handlers
        self.components: list[Component[Any]] = list(components or [])
        self.notifier = Notifier()
        self.server = Server(self, self.notifier, self.tasks, ClientMistakes(self.log), self.log)
        # Built from the configuration (and rebuilt on reload) unless the caller passed its own.
        self._own_sources, self._own_components = sources is None, components is None
        self._reload_config = reload_config
        self._loaded = LoadedState()
        self._started = False  # start_parts finished: every part runs (until stop_parts)
        # The wiring (docs/internals.md, "Data flow"). A board change: the fan-out (hub, then the event
        # listeners, then the history), the state writer, the expiry's clock, systemd's status line.
        self.board.on_change(self.fanout.changed)
        self.board.on_change(lambda changes, now: self.keeper.changed())
        self.board.on_change(self.expiry.wake)
        self.board.on_change(self._notify_status)
        # Event listeners: the sequence lease first; the components' follow as they are set up.
        self.fanout.on_event(self.keeper.lease_sequence)
        # Report listeners: the history and the sources first; the components' follow.
        self.hooks.on_report(
            lambda report: self.keeper.record({"type": "report", "report": report.to_json()})
        )
        self.hooks.on_report(self.runner.on_report)

    # ----- the parts, as the rest of the code and the tests read them -----

    @property
    def sources(self) -> dict[str, Source]:
        return self.runner.sources

    @property
    def socket_path(self) -> Path | None:
        return self.server.socket_path

    @property
    def opened(self) -> bool:
        return self.keeper.loaded

    def _speaks_for(self, source: str) -> bool:
        """Whether ``source`` runs, and so ends its own notices (they do not expire)."""
        return source in self.sources and self.health.running(source)

    # ----- the host ports (agent/core/ports.py; docs/internals.md): the parts are handed out (hooks, fanout,
    # keeper, drills, server, board); what needs more than one part is answered here -----

    def publish_ready(self, notice_id: str, data: Mapping[str, Any] | None = None) -> Event:
        return self.fanout.ready(notice_id, self.board.get(notice_id), data or {}, self.now())

    def inject(self, source: str, obs: Observation) -> Notice | None:
        change = self.board.observe(source, obs, self.now())
        return self.board.get(change.notice.id) if change else None

    def retract(self, source: str, key: str, reason: str | None = None) -> Notice | None:
        change = self.board.clear(source, key, self.now(), reason)
        return change.notice if change else None

    def status(self) -> dict[str, Any]:
        return status.document(
            self.now(),
            self.identity.to_json(self.socket_path, self.server.activated, self.config),
            self.board.active(),
            self.health,
            self.runner.status(self.identity.started_at),
            self.hub,
            self.server.connections(),
            (self.keeper.ok, self.keeper.error),
            self.hooks.status_sections,
        )

    def readiness(self) -> dict[str, str | None]:
        """Each readiness check: None when it passes, else why not (``GET /readyz``)."""
        stopping = self.server.stopping
        socket = "the API socket is not served " + ("(stopping)" if stopping else "yet")
        started = "the agent is stopping" if stopping else "the agent is starting"
        return {
            "config": None if self.opened else "the configuration and state are not loaded yet",
            "sources": None if self.runner.started else "the sources are not running",
            "socket": None if self.server.serving else socket,
            "started": None if self._started and not stopping else started,
        }

    def _notify_status(self, *_: object) -> None:
        self.notifier.notify(status=status.systemd_line(self.board.active(), len(self.hub), self.now()))

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
        self._loaded = loaded
        if self._own_sources:
            self.runner.sources = {s.name: s for s in build_sources(self.config)}
        if self._own_components:
            self.components = build_components(self.config)
        for component in self.components:
            component.setup(self)
        return build_app(self, self.hooks.routes)

    async def start_parts(self) -> None:
        self.tasks.spawn(self.keeper.writer(), "state-writer")
        self.tasks.spawn(self.expiry.run(), "expiry")
        self.tasks.spawn(self.hub.heartbeats(lambda: self.config.api.heartbeat_s), "heartbeat")
        self.runner.start()
        await start_all(self.components)
        await self.keeper.flush()
        self._notify_status()
        self._started = True
        self.log.info(
            "agent_started",
            version=__version__,
            socket=str(self.socket_path),
            socket_activated=self.server.activated,
            state_dir=str(self.config.state_dir),
            cloud=self.config.cloud,
            sources=sorted(self.sources),
            restored=len(self._loaded.notices),
            previous_clean=self._loaded.previous_clean,
        )

    async def stop_parts(self, timeout: float) -> None:
        """Sources, then components in reverse, then the event streams; each bounded by ``timeout``."""
        self._started = False
        self.log.info("agent_stopping", active_notices=len(self.board), subscribers=len(self.hub))
        await self.runner.stop(timeout)
        await stop_all(self.components, timeout, self.log)
        self.hub.close_all()

    async def close(self, timeout: float) -> None:
        await self.tasks.close(timeout, grace=0)  # the agent's loops never end by themselves
        self.keeper.record({"type": "agent_stop", "boot_id": self.identity.boot_id})
        await self.keeper.flush(clean=True)
        self.log.info("agent_stopped")

    async def reload(self) -> None:
        """SIGHUP: re-read the configuration; apply what can change live, keep the old one on error."""
        new = await read_config(self._reload_config, self.config, self.notifier, self.log)
        if new is None:
            return
        old, self.config = self.config, new
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


def run_agent(config: Config, reload_config: Callable[[], Config] | None = None) -> int:
    """Entry point of ``preemptd run``: returns the process exit status."""
    plugins.freeze()
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


if TYPE_CHECKING:
    from agent.core.ports import AdvisorHost, ApiHost, Host, MetricsHost
    from agent.ledger.component import LedgerHost
    from agent.ramtier.ports import RamTierHost
    from agent.service.membership import MembershipHost
    from agent.window.component import WindowHost

    def _answers_every_port(agent: Agent) -> tuple[object, ...]:
        """mypy's proof that the agent is every host port its parts are typed against (each composed of the
        roles in agent/core/ports.py)."""
        host: Host = agent
        advisor: AdvisorHost = agent
        metrics: MetricsHost = agent
        api: ApiHost = agent
        ledger: LedgerHost = agent
        tier: RamTierHost = agent
        window: WindowHost = agent
        membership: MembershipHost = agent
        return (host, advisor, metrics, api, ledger, tier, window, membership)


__all__ = ["Agent", "Component", "build_components", "load_config", "run_agent"]
