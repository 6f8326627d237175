"""The ports: what the parts built on the agent core may use of it, as Protocols.

A source, a component (advisor, actions), a reactor (an action or a scheduler bridge) and the HTTP API are
typed against these, never against :class:`agent.service.daemon.Agent`, so each can be built and tested with any
object that offers the same few methods. This module is a leaf: it imports the standard library and the
pure value types of :mod:`agent.core.notice` and :mod:`agent.core.reports` only (and, for type checking only, the
event hub that the API serves from, :mod:`agent.core.subscribers`). docs/internals.md says who provides each port and how
to add a reactor or a bridge.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

from agent.core.notice import Event, Kind, Notice, Observation, Severity
from agent.core.reports import Report

if TYPE_CHECKING:
    from agent.core.subscribers import Hub

T = TypeVar("T")
H_contra = TypeVar("H_contra", contravariant=True)

# An aiohttp request handler (web.Request -> web.StreamResponse); typed loosely so this module does not
# import aiohttp.
Handler = Callable[[Any], Awaitable[Any]]

# Capabilities that sources offer to reactors (see Host.capability and Source.capabilities).
# "gpu_pids": () -> Mapping[str, list[int]], GPU UUID -> PIDs of its compute processes (the NVML source;
# synchronous and cheap, safe from the loop or a worker thread).
GPU_PIDS = "gpu_pids"
# "azure_ack": async (event_id: str) -> None, Azure's StartRequests for one scheduled event (the Azure
# source, or the probing "cloud" source once it found Azure); raises on refusal.
AZURE_ACK = "azure_ack"


class ConfigView(Protocol):
    """The configuration as a part sees it (``agent.config.Config`` implements it)."""

    @property
    def socket(self) -> Path: ...

    @property
    def state_dir(self) -> Path: ...

    def table(self, name: str, schema: type[T]) -> T:
        """The table ``name`` (dotted, e.g. ``"actions.slurm"``) checked against the dataclass ``schema``,
        with the loader's errors (file, dotted key, what was expected); the schema's defaults when the
        table is absent. A built-in section (``"actions"``, ``"aws"``) returns the loaded section."""
        ...

    def has_table(self, name: str) -> bool:
        """Whether the file, the environment or the command line set anything under ``name``."""
        ...

    def extension_tables(self) -> tuple[str, ...]:
        """The dotted names of the plug-in tables that were set (``("actions.slurm",)``)."""
        ...


class Board(Protocol):
    """The notice board, read-only: parts never change notices except through Host.inject/retract."""

    def get(self, notice_id: str) -> Notice | None: ...

    def active(self) -> tuple[Notice, ...]: ...

    def __len__(self) -> int: ...


@runtime_checkable
class Reactor(Protocol):
    """Anything that acts on the agent's events: a built-in action (signals, hooks, webhooks, ready, the
    Azure acknowledgement) or a scheduler bridge.

    ``handle`` is called on the event loop for every event (``notice``, ``update``, ``cleared``, ``ready``)
    after the event went to the SSE subscribers; it must return at once and hand slow work to tasks that the
    reactor owns. An exception is logged and does not stop the event reaching the other reactors.
    ``status()`` is shown in ``/v1/status`` under ``actions.reactors.<name>``. ``start()`` runs once the
    socket serves; ``stop(timeout)`` must return within ``timeout`` seconds (cancel what is still running).
    Optional: ``on_report(report)`` for every accepted client report, ``on_subscriber(peer)`` for every
    event-stream client as its stream opens (see Host.on_subscriber), ``refusal(report, privileged)`` to
    refuse a report before anyone hears of it (returns an HTTP status and the reason, or None), and
    ``carry_over(previous)`` to take over the state of the instance it replaces when the configuration is
    reloaded.
    """

    name: str

    def handle(self, event: Event) -> None: ...

    def status(self) -> Mapping[str, Any]: ...

    async def start(self) -> None: ...

    async def stop(self, timeout: float) -> None: ...


# ----- the host's roles: each part's host port is composed of the few it uses (as structlog composes its
# processors). A role names either a part the agent hands out (``hooks``, ``fanout``, ``keeper``, ``drills``,
# ``server``, ``board``) or one of the few calls that take more than one part (``inject``, ``now``).


class Tasks(Protocol):
    """The agent's task owner (``agent.core.tasks.TaskSet``): a spawned task is logged when it fails."""

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any] | None: ...

    async def cancel(self, task: asyncio.Task[Any], timeout: float) -> None: ...


class HistoryFile(Protocol):
    """Where the history log lives (``agent.service.state_files.History``)."""

    @property
    def path(self) -> Path: ...


class Configured(Protocol):
    @property
    def config(self) -> ConfigView: ...


class Clocked(Protocol):
    def now(self) -> datetime:
        """The agent's clock (UTC, aware); tests give the agent their own."""
        ...


class Logged(Protocol):
    @property
    def log(self) -> Any:
        """The agent's structlog logger."""
        ...


class Tasked(Protocol):
    @property
    def tasks(self) -> Tasks: ...


class Keeper(Protocol):
    """The state keeper (``agent.service.state_keeper.StateKeeper``): the history log and the state file."""

    @property
    def ok(self) -> bool:
        """Whether the last write of the state directory succeeded."""
        ...

    def record(self, record: Mapping[str, Any]) -> None:
        """Append a record (a mapping with ``type``) to the history log; ``time`` is added. Never blocks."""
        ...

    async def flush(self) -> None:
        """Write what is pending (state and history) now."""
        ...


class HasKeeper(Protocol):
    @property
    def keeper(self) -> Keeper: ...


class HasHistory(Protocol):
    @property
    def history(self) -> HistoryFile: ...


class Notices(Protocol):
    """The notice board, and the only ways a part changes it."""

    @property
    def board(self) -> Board: ...

    def publish_ready(self, notice_id: str, data: Mapping[str, Any] | None = None) -> Event:
        """Emit a ``ready`` event for a notice (to clients, reactors and the history)."""
        ...

    def inject(self, source: str, obs: Observation) -> Notice | None:
        """Raise or update a notice as if ``source`` had observed it (drills, tests, bridges' own
        findings)."""
        ...

    def retract(self, source: str, key: str, reason: str | None = None) -> Notice | None:
        """Clear what :meth:`inject` raised."""
        ...


class Routes(Protocol):
    def add_route(self, method: str, path: str, handler: Handler) -> None:
        """Serve ``handler`` on the agent's socket (during setup only, before the socket serves)."""
        ...


class StatusSections(Protocol):
    def add_status_section(self, name: str, fn: Callable[[], Any]) -> None:
        """A top-level key of ``/v1/status``, computed on each request."""
        ...


class Collectors(Protocol):
    def add_metrics_collector(self, collector: Any) -> None:
        """A ``prometheus_client`` collector for ``GET /v1/metrics``."""
        ...


class ReportListeners(Protocol):
    def on_report(self, fn: Callable[[Report], None]) -> None:
        """Call ``fn`` on the loop for every accepted client report; must not block."""
        ...


class ReportChecks(Protocol):
    def add_report_check(self, fn: Callable[[Report, bool], tuple[int, str] | None]) -> None:
        """``fn(report, privileged)`` may refuse a client report before anyone hears of it: it returns an
        HTTP status and the reason, or None. ``privileged``: the sender is root, the agent's user or in the
        admin group."""
        ...


class SubscriberListeners(Protocol):
    def on_subscriber(self, fn: Callable[[Mapping[str, Any]], None]) -> None:
        """Call ``fn(peer)`` on the loop when an event-stream client's stream opens; ``peer`` holds its
        ``pid``, ``uid`` and ``gid`` from SO_PEERCRED (empty when unknown). Must not block."""
        ...


class Offers(Protocol):
    def capability(self, name: str) -> Any | None:
        """A named capability (``GPU_PIDS``, ``AZURE_ACK``, or one a component provided), or None when no
        running part offers it now. Look it up when it is needed, not once: sources come and go."""
        ...

    def provide(self, name: str, fn: Any) -> None:
        """Offer a capability under ``name`` to the other parts."""
        ...


class HookPoints(
    Routes,
    StatusSections,
    Collectors,
    ReportListeners,
    ReportChecks,
    SubscriberListeners,
    Offers,
    Protocol,
):
    """What the parts register with the agent while they are set up, and the calls that reach what they
    registered (``agent.core.hooks.Hooks``)."""

    @property
    def collectors(self) -> Sequence[Any]:
        """The collectors added with ``add_metrics_collector``."""
        ...

    @property
    def reports_total(self) -> Mapping[str, int]:
        """Accepted client reports by phase."""
        ...

    def check_report(self, report: Report, privileged: bool) -> tuple[int, str] | None:
        """The first report check's refusal (HTTP status, reason), or None."""
        ...

    def accept_report(self, report: Report) -> None:
        """Count an accepted report and tell the ``on_report`` listeners."""
        ...

    def subscriber_connected(self, peer: Mapping[str, Any]) -> None:
        """An event stream opened for ``peer`` (pid, uid, gid): tell the ``on_subscriber`` listeners."""
        ...


class HasHooks(Protocol):
    @property
    def hooks(self) -> HookPoints: ...


class EventFanout(Protocol):
    """Where events go after the SSE subscribers (``agent.core.fanout.Fanout``)."""

    def on_event(self, fn: Callable[[Event], None]) -> None:
        """Call ``fn`` on the loop for every event, after the SSE subscribers; must not block."""
        ...


class HasFanout(Protocol):
    @property
    def fanout(self) -> EventFanout: ...


class DrillMaker(Protocol):
    """Drills (``agent.core.expiry.Drills``): notices raised on request, which end by themselves."""

    def drill(
        self, kind: Kind, in_s: float, severity: Severity | None, reason: str, peer: Mapping[str, Any]
    ) -> Notice: ...


class HasDrills(Protocol):
    @property
    def drills(self) -> DrillMaker: ...


class Connections(Protocol):
    """The socket server (``agent.service.server.Server``), as the metrics and the status read it."""

    def connections(self) -> dict[str, Any]:
        """Open connections and event streams, counted."""
        ...


class HasServer(Protocol):
    @property
    def server(self) -> Connections: ...


class Host(Configured, Clocked, HasKeeper, Notices, HasHooks, HasFanout, Protocol):
    """What a reactor (an action or a bridge) and a component typed against the whole host may use of the
    running agent: every role."""


class Component(Protocol[H_contra]):
    """A part that lives as long as the agent (the actions runner, the advisor, the metrics), set up with
    the port it is typed against (``Host``, ``AdvisorHost``, ``MetricsHost``)."""

    name: str

    def setup(self, host: H_contra) -> None:
        """Synchronous, before the socket serves: routes, status sections, metrics, listeners."""
        ...

    async def start(self) -> None: ...

    async def stop(self) -> None:
        """Bounded: the agent waits ``api.shutdown_timeout_s`` at most."""
        ...


class AdvisorHost(Configured, Logged, Tasked, HasHistory, Clocked, HasKeeper, HasHooks, HasFanout, Protocol):
    """What the advisor component uses of the agent (``agent.advisor.component``)."""


class HealthView(Protocol):
    """A source's health as the metrics read it (``agent.core.source_health.SourceHealth``)."""

    @property
    def state(self) -> enum.Enum: ...

    @property
    def errors(self) -> int: ...


class MetricsView(Clocked, HasHooks, HasKeeper, HasServer, Protocol):
    """What the agent's own metrics read at scrape time (``agent.service.api.build_registry``): the board, the
    hub's counters, reports (``hooks.reports_total``), source health, the state directory (``keeper.ok``),
    connections, and the components' collectors (``hooks.collectors``)."""

    @property
    def board(self) -> Board: ...

    @property
    def hub(self) -> Hub: ...

    @property
    def reports_rejected(self) -> int: ...

    @property
    def health(self) -> Mapping[str, HealthView]: ...


class MetricsHost(MetricsView, HasFanout, Protocol):
    """What the metrics component uses of the agent (``agent.service.metrics``)."""

    def readiness(self) -> Mapping[str, str | None]:
        """Each readiness check (configuration, sources, socket, started): None when it passes, else why
        not (``GET /readyz`` on the metrics listener)."""
        ...


class ApiSettings(Protocol):
    """The ``[api]`` settings the HTTP handlers read."""

    @property
    def max_body_bytes(self) -> int: ...

    @property
    def idle_timeout_s(self) -> float: ...


class ApiConfig(Protocol):
    """The configuration as the HTTP API reads it."""

    @property
    def api(self) -> ApiSettings: ...

    @property
    def admin_group(self) -> str | None: ...


class ApiHost(MetricsView, Logged, HasDrills, Protocol):
    """What the HTTP API (``agent.service.api``) uses of the agent: its metrics, the event stream, client reports
    (``hooks``), drills, the state's flush (``keeper``) and the status document."""

    reports_rejected: int  # counted by the API's handlers

    @property
    def config(self) -> ApiConfig: ...

    def status(self) -> dict[str, Any]: ...

    def retract(self, source: str, key: str, reason: str | None = None) -> Notice | None: ...


ReactorFactory = Callable[[Host], "Reactor | None"]
"""Builds one reactor from the configuration (``host.config.table(...)``), or None when it is not wanted."""

__all__ = [
    "AZURE_ACK",
    "GPU_PIDS",
    "AdvisorHost",
    "ApiConfig",
    "ApiHost",
    "ApiSettings",
    "Board",
    "Clocked",
    "Collectors",
    "Component",
    "ConfigView",
    "Configured",
    "Connections",
    "DrillMaker",
    "EventFanout",
    "Handler",
    "HasDrills",
    "HasFanout",
    "HasHistory",
    "HasHooks",
    "HasKeeper",
    "HasServer",
    "HealthView",
    "HistoryFile",
    "HookPoints",
    "Host",
    "Keeper",
    "Logged",
    "MetricsHost",
    "MetricsView",
    "Notices",
    "Offers",
    "Reactor",
    "ReactorFactory",
    "ReportChecks",
    "ReportListeners",
    "Routes",
    "StatusSections",
    "SubscriberListeners",
    "Tasked",
    "Tasks",
]
