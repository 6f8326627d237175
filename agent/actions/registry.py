"""The reactor registry and runner: which reactors a configuration runs, and one list that every event goes
through after the SSE subscribers.

Reactors are found without editing a core module, in this order (a later one with a name already taken is
skipped with a warning):

1. the built-in actions (:data:`agent.actions.builtins.BUILTINS`);
2. every module in the :mod:`agent.bridges` package that defines ``build_reactor(host)``, named after the
   module (``agent/bridges/slurm.py`` → ``slurm``);
3. the ``preemptd.reactors`` entry-point group (third-party packages: ``name = "module:factory"``);
4. :func:`register` (an embedding program, tests).

A factory takes the :class:`agent.core.ports.Host` and returns a :class:`agent.core.ports.Reactor`, or None when its
configuration does not ask for it. A reactor with a table declares it where its schema is defined
(``register_table("actions.slurm", SlurmConfig)``, agent/config/tables.py): the loader then checks it when the
file is loaded, and a table under ``[actions]`` that no reactor is named after is an error. See
docs/internals.md, "How to add a bridge".
"""

from __future__ import annotations

import asyncio
import importlib
import pkgutil
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import structlog

from agent.config.tables import Discovered, add_discovery
from agent.core.entry_points import entry_points
from agent.core.errors import ConfigError
from agent.core.notice import Event
from agent.core.ports import Host, Reactor, ReactorFactory
from agent.core.reports import Report

ENTRY_POINT_GROUP = "preemptd.reactors"
BRIDGES_PACKAGE = "agent.bridges"
BRIDGE_FACTORY = "build_reactor"

# What a reactor's stop may take beyond its timeout (its own clean-up after cancelling) before the runner
# cancels the stop itself.
STOP_GRACE_S = 0.5

log = structlog.get_logger("preemptd.reactors")

_registered: dict[str, ReactorFactory] = {}


def register(name: str, factory: ReactorFactory) -> None:
    """Add a reactor factory under ``name`` (for the agents started after this call)."""
    _registered[name] = factory


def unregister(name: str) -> None:
    _registered.pop(name, None)


@dataclass(frozen=True)
class Found:
    """One reactor factory and where it came from (``builtin``, ``module agent.bridges.x``, ``entry point``,
    ``registered``); ``error`` says why a bridge could not be loaded (then ``factory`` is None)."""

    name: str
    origin: str
    factory: ReactorFactory | None
    error: str | None = None


def _bridge_modules() -> list[Found]:
    try:
        package = importlib.import_module(BRIDGES_PACKAGE)
    except ImportError:
        return []
    found: list[Found] = []
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        module_name = f"{BRIDGES_PACKAGE}.{info.name}"
        try:
            module = importlib.import_module(module_name)
        except Exception as exc:  # a broken bridge must not stop the agent or the other bridges
            found.append(Found(info.name, f"module {module_name}", None, f"{type(exc).__name__}: {exc}"))
            continue
        factory = getattr(module, BRIDGE_FACTORY, None)
        if callable(factory):  # modules without a factory are a bridge's helpers
            found.append(Found(info.name, f"module {module_name}", factory))
    return found


def _entry_points() -> list[Found]:
    found: list[Found] = []
    for point in entry_points(ENTRY_POINT_GROUP):
        origin = f"entry point {point.value}"
        try:
            factory = point.load()
        except Exception as exc:
            found.append(Found(point.name, origin, None, f"{type(exc).__name__}: {exc}"))
            continue
        found.append(Found(point.name, origin, factory))
    return found


def discover() -> list[Found]:
    """Every reactor factory available now, built-ins first; names are unique."""
    from agent.actions.builtins import BUILTINS

    candidates = [Found(name, "builtin", factory) for name, factory in BUILTINS]
    candidates += _bridge_modules()
    candidates += _entry_points()
    candidates += [Found(name, "registered", factory) for name, factory in _registered.items()]
    result: list[Found] = []
    seen: dict[str, Found] = {}
    for item in candidates:
        if item.name in seen:
            log.warning(
                "reactor_name_taken",
                reactor=item.name,
                skipped=item.origin,
                kept=seen[item.name].origin,
                effect="rename one of them",
            )
            continue
        seen[item.name] = item
        result.append(item)
    return result


def _tables() -> Discovered:
    """For the loader: every reactor is found (so the bridges' modules have declared their tables), and a
    reactor that declared no table may still read ``[actions.<its name>]`` itself."""
    return Discovered("actions", frozenset(f"actions.{item.name}" for item in discover()))


add_discovery(_tables)


def build_reactors(host: Host, found: Iterable[Found] | None = None) -> list[Reactor]:
    """Build the reactors the configuration asks for. A ConfigError (a bad ``[actions.<name>]`` table)
    propagates: the agent does not start, a reload keeps what runs. A bridge that cannot be loaded, or
    whose factory fails otherwise, is logged and left out."""
    reactors: list[Reactor] = []
    for item in discover() if found is None else found:
        if item.factory is None:
            log.error("reactor_unavailable", reactor=item.name, origin=item.origin, error=item.error)
            continue
        try:
            reactor = item.factory(host)
        except ConfigError:
            raise
        except Exception as exc:
            log.error(
                "reactor_build_failed",
                reactor=item.name,
                origin=item.origin,
                error=f"{type(exc).__name__}: {exc}",
            )
            continue
        if reactor is not None:
            reactors.append(reactor)
    return reactors


def unused_tables(config_tables: Iterable[str], found: Iterable[Found]) -> list[str]:
    """Plug-in tables (``actions.<name>``) that no available reactor is named after."""
    names = {item.name for item in found}
    return [t for t in config_tables if t.split(".", 1)[-1].split(".")[0] not in names]


class ReactorSet:
    """The runner: delivers each event and report to its reactors in order, shows their status, starts
    them, and stops them all at once within a bound. Reactors replaced by a reload are kept (their work in
    flight finishes) and stopped with the rest."""

    def __init__(self, reactors: Iterable[Reactor] = ()) -> None:
        self._active: list[Reactor] = list(reactors)
        self._retired: list[Reactor] = []

    def __iter__(self) -> Any:
        return iter(self._active)

    def __len__(self) -> int:
        return len(self._active)

    def by_name(self) -> dict[str, Reactor]:
        return {r.name: r for r in self._active}

    def handle(self, event: Event) -> None:
        for reactor in self._active:
            try:
                reactor.handle(event)
            except Exception as exc:  # one reactor's bug must not keep the event from the others
                log.error(
                    "reactor_failed", reactor=reactor.name, event_type=event.type.value, error=repr(exc)
                )

    def on_report(self, report: Report) -> None:
        self._each_optional("on_report", report, report=report.phase)

    def on_subscriber(self, peer: Mapping[str, Any]) -> None:
        self._each_optional("on_subscriber", peer, subscriber=dict(peer))

    def _each_optional(self, hook: str, arg: Any, **context: Any) -> None:
        """Call the optional ``hook(arg)`` of every reactor that has one; a failure is logged with
        ``context`` and the others are still called."""
        for reactor in self._active:
            method = getattr(reactor, hook, None)
            if method is None:
                continue
            try:
                method(arg)
            except Exception as exc:
                log.error("reactor_failed", reactor=reactor.name, **context, error=repr(exc))

    def refusal(self, report: Report, privileged: bool) -> tuple[int, str] | None:
        """The first reactor's reason to refuse ``report`` (its optional ``refusal(report, privileged)``),
        as (HTTP status, reason), or None."""
        for reactor in self._active:
            check = getattr(reactor, "refusal", None)
            if check is None:
                continue
            refused: tuple[int, str] | None = check(report, privileged)
            if refused is not None:
                return refused
        return None

    def status(self) -> dict[str, Mapping[str, Any]]:
        shown: dict[str, Mapping[str, Any]] = {}
        for reactor in self._active:
            try:
                shown[reactor.name] = dict(reactor.status())
            except Exception as exc:
                shown[reactor.name] = {"status_error": repr(exc)}
        return shown

    async def start(self) -> None:
        await self._start(self._active)

    async def _start(self, reactors: list[Reactor]) -> None:
        for reactor in list(reactors):
            try:
                await reactor.start()
            except Exception as exc:
                log.error("reactor_start_failed", reactor=reactor.name, error=f"{type(exc).__name__}: {exc}")
                reactors.remove(reactor)

    async def replace(self, reactors: Iterable[Reactor]) -> None:
        """Swap in a new list (a reload): each new reactor takes over from the old one of its name
        (``carry_over``), and the old ones are retired."""
        new = list(reactors)
        old = self.by_name()
        for reactor in new:
            carry_over = getattr(reactor, "carry_over", None)
            if reactor.name in old and carry_over is not None:
                carry_over(old[reactor.name])
        await self._start(new)
        self._retired.extend(self._active)
        self._active = new

    async def stop(self, timeout: float) -> None:
        """Stop every reactor concurrently; a stop still running after ``timeout`` plus STOP_GRACE_S is
        cancelled and logged."""
        everything = [*self._active, *self._retired]
        if not everything:
            return
        loop = asyncio.get_running_loop()
        stops = {loop.create_task(r.stop(timeout), name=f"stop:{r.name}"): r for r in everything}
        done, pending = await asyncio.wait(stops, timeout=timeout + STOP_GRACE_S)
        for task in pending:
            task.cancel()
            log.warning("reactor_stop_stuck", reactor=stops[task].name, waited_s=timeout + STOP_GRACE_S)
        for task in done:
            if not task.cancelled() and task.exception() is not None:
                log.error("reactor_stop_failed", reactor=stops[task].name, error=repr(task.exception()))
        if pending:
            await asyncio.wait(pending, timeout=STOP_GRACE_S)

    async def drain(self) -> None:
        """Wait until every action started so far has finished (tests)."""
        for reactor in [*self._active, *self._retired]:
            drain = getattr(reactor, "drain", None)
            if drain is not None:
                await drain()

    def running(self) -> int:
        """Actions in flight, over the reactors that report ``running`` in their status."""
        total = 0
        for shown in self.status().values():
            value = shown.get("running")
            if isinstance(value, int):
                total += value
        return total
