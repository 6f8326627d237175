"""The reactor registry and runner: which reactors a configuration runs, and one list that every event goes
through after the SSE subscribers.

:data:`REACTORS` (agent/core/plugins.py) finds them, in this order (a later one with a name already taken is
skipped with a warning):

1. the built-in actions and bridges, listed in :data:`BUILTIN` (each a :class:`agent.core.plugins.Part`);
2. the ``preemptd.reactors`` entry-point group (third-party packages: ``name = "module:factory"``, or a
   ``Part`` that declares its table);
3. ``REACTORS.register(Part(name, factory, tables))`` (an embedding program, tests).

A factory takes the :class:`agent.core.ports.Host` and returns a :class:`agent.core.ports.Reactor`, or None when its
configuration does not ask for it. A reactor with a table declares it in its ``Part``
(``Table("actions.slurm", SlurmConfig)``): the loader then checks it when the file is loaded; a reactor that
declares none may read ``[actions.<its name>]`` unchecked; a table under ``[actions]`` that no reactor is
named after is an error. See docs/internals.md, "How to add a bridge".
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import structlog

from agent.core.errors import ConfigError
from agent.core.notice import Event
from agent.core.plugins import Part, Registry, Table
from agent.core.ports import Host, Reactor, ReactorFactory
from agent.core.reports import Report

ENTRY_POINT_GROUP = "preemptd.reactors"

# In delivery order: a notice is signalled before the hooks for it are started; the bridges after them.
BUILTIN: tuple[str, ...] = (
    "agent.actions.builtins:SIGNALS",
    "agent.actions.builtins:READY",
    "agent.actions.builtins:AZURE_ACKNOWLEDGEMENT",
    "agent.actions.builtins:HOOKS",
    "agent.actions.builtins:WEBHOOKS",
    "agent.bridges.kubernetes:REACTOR",
    "agent.bridges.ray:REACTOR",
    "agent.bridges.slurm:REACTOR",
)

# What a reactor's stop may take beyond its timeout (its own clean-up after cancelling) before the runner
# cancels the stop itself.
STOP_GRACE_S = 0.5

log = structlog.get_logger("preemptd.reactors")


def _accept(name: str, loaded: object) -> Part[ReactorFactory]:
    """A ``Part``, or a bare factory (an entry point's, named after it)."""
    if isinstance(loaded, Part):
        return loaded
    if callable(loaded):
        return Part(name, loaded)
    raise TypeError(f"a {type(loaded).__name__}, neither a reactor factory nor a Part")


def _tables(part: Part[ReactorFactory]) -> tuple[Table, ...]:
    # A reactor that declares no table may still read [actions.<its name>] itself (it checks it when built).
    return part.tables or (Table(f"actions.{part.name}", None),)


REACTORS: Registry[Part[ReactorFactory]] = Registry(
    "reactor",
    BUILTIN,
    group=ENTRY_POINT_GROUP,
    accept=_accept,
    name_of=lambda part: part.name,
    tables_of=_tables,
    family="actions",
)


@dataclass(frozen=True)
class Found:
    """One reactor factory and where it came from (``builtin ...``, ``entry point ...``, ``registered``);
    ``error`` says why it could not be loaded (then ``factory`` is None)."""

    name: str
    origin: str
    factory: ReactorFactory | None
    error: str | None = None


def discover() -> list[Found]:
    """Every reactor factory available now, built-ins first; names are unique."""
    return [
        Found(e.name, e.origin, e.value.build if e.value is not None else None, e.error or None)
        for e in REACTORS.entries()
    ]


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
    """The tables under ``[actions]`` that no available reactor reads: neither one it declares nor the
    ``[actions.<name>]`` of a reactor found by that name. Tables outside ``[actions]`` (a component's,
    ``[ram_tier]``; a cloud's) are not the reactors' business: the loader checked them against their
    readers."""
    family = REACTORS.family or "actions"
    read = {table.name for table in REACTORS.tables()} | {f"{family}.{item.name}" for item in found}
    return [
        t
        for t in config_tables
        if t.split(".")[0] == family and not any(t == r or t.startswith(r + ".") for r in read)
    ]


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
