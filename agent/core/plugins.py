"""One shape for every kind of plug-in (clouds, reactors, components, simulators): a :class:`Registry` finds
its entries in a fixed order — its explicit built-in tuple of ``"module:NAME"`` strings (imported when first
asked for), then its entry-point group, then :meth:`Registry.register` — keeps the first entry of each name,
and is frozen when the agent starts. Each entry may declare the configuration tables it reads
(:class:`Table`), and :func:`agent.config.load_config` asks every registry for them (agent/config/catalog.py),
so a table is known to every entry point whatever it imported before.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any, Generic, TypeVar

from agent.core.entry_points import entry_points

T = TypeVar("T")
F = TypeVar("F")


@dataclass(frozen=True)
class Table:
    """A configuration table an entry reads: its dotted name (``"actions.slurm"``, ``"ram_tier"``), the frozen
    dataclass it is checked against when the file is loaded (None: the entry reads it unchecked), and whether
    it is a cloud's (then ``cloud = "<name>"`` chooses that cloud)."""

    name: str
    schema: type[Any] | None
    cloud: bool = False

    def __post_init__(self) -> None:
        if not self.name or any(not part.isidentifier() for part in self.name.split(".")):
            raise ValueError(
                f"a table name is dotted identifiers (actions.slurm, ram_tier), got {self.name!r}"
            )


@dataclass(frozen=True)
class Part(Generic[F]):
    """A named factory and the tables it reads: a reactor (``build(host)``) or a component (``build(config)``)."""

    name: str
    build: F
    tables: tuple[Table, ...] = ()


@dataclass(frozen=True)
class Entry(Generic[T]):
    """One entry found: its name, where it came from (``builtin agent.sources.aws:CLOUD``, ``entry point
    x:y``, ``registered``), and its value, or why it could not be loaded (then ``value`` is None)."""

    name: str
    origin: str
    value: T | None
    error: str = ""


class FrozenRegistryError(RuntimeError):
    """A registration after the agent started: its registries are frozen, so what it runs stays what it
    checked the configuration against."""


def load_ref(ref: str) -> Any:
    """The object a ``"module:NAME"`` string names (the module imported now)."""
    module, sep, name = ref.partition(":")
    if not sep or not module or not name:
        raise ValueError(f"expected 'module:NAME', got {ref!r}")
    found = importlib.import_module(module)
    for part in name.split("."):
        found = getattr(found, part)
    return found


def _no_tables(_: Any) -> Iterable[Table]:
    return ()


class Registry(Generic[T]):
    """The entries of one kind of plug-in. ``accept(name, loaded)`` turns what a built-in string or an entry
    point names into an entry value (or raises TypeError saying why not); ``name_of`` and ``tables_of`` read
    an entry's name and tables; ``order``, when given, sorts the entries (clouds by rank). ``family`` is the
    table family this registry knows completely (``"actions"``: a table ``[actions.x]`` no entry reads is an
    error)."""

    def __init__(
        self,
        kind: str,
        builtins: tuple[str, ...],
        *,
        group: str | None,
        accept: Callable[[str, object], T],
        name_of: Callable[[T], str],
        tables_of: Callable[[T], Iterable[Table]] = _no_tables,
        order: Callable[[T], Any] | None = None,
        family: str | None = None,
    ) -> None:
        self.kind = kind
        self.builtins = builtins
        self.group = group
        self.family = family
        self._accept = accept
        self._name_of = name_of
        self._tables_of = tables_of
        self._order = order
        self._registered: dict[str, T] = {}
        self._frozen: tuple[Entry[T], ...] | None = None

    def __repr__(self) -> str:
        return f"<Registry {self.kind} ({'frozen' if self.frozen else 'open'})>"

    # ----- adding -------------------------------------------------------------------------------------------

    def register(self, value: T) -> T:
        """Add ``value`` after the built-ins and the entry points (a later one of the same name replaces an
        earlier registration); returns it. Refused once the registry is frozen."""
        if self._frozen is not None:
            raise FrozenRegistryError(
                f"cannot register the {self.kind} {self._name_of(value)!r}: the agent has started and its "
                f"{self.kind} registry is frozen; register it before the agent starts"
            )
        self._registered[self._name_of(value)] = value
        return value

    @contextmanager
    def registered(self, value: T) -> Iterator[T]:
        """``value`` registered for the ``with`` block only (tests, a rehearsal): what was registered under
        its name before is back afterwards."""
        name = self._name_of(value)
        before = self._registered.get(name)
        self.register(value)
        try:
            yield value
        finally:
            if before is None:
                self._registered.pop(name, None)
            else:
                self._registered[name] = before

    def freeze(self) -> None:
        """Find every entry once more and keep that list: later registrations are refused, and what is
        installed later is not seen (the agent runs what it checked at start)."""
        if self._frozen is None:
            self._frozen = self._find()

    @property
    def frozen(self) -> bool:
        return self._frozen is not None

    # ----- reading ------------------------------------------------------------------------------------------

    def entries(self) -> tuple[Entry[T], ...]:
        """Every entry found, names unique, including those that could not be loaded (``value`` None)."""
        return self._frozen if self._frozen is not None else self._find()

    def available(self) -> dict[str, T]:
        """The entries that loaded, by name, in order."""
        return {entry.name: entry.value for entry in self.entries() if entry.value is not None}

    def get(self, name: str) -> T:
        """The entry ``name``; a KeyError names the ones there are."""
        found = self.available()
        if name not in found:
            raise KeyError(
                f"no {self.kind} {name!r}; the {self.kind}s known are: {', '.join(found) or 'none'}"
            )
        return found[name]

    def names(self) -> tuple[str, ...]:
        return tuple(self.available())

    def tables(self) -> tuple[Table, ...]:
        """The tables the loaded entries read; in a ``family``, an entry that could not be loaded keeps the
        table of its name, unchecked (its failure is logged when the agent builds it, not as a bad file)."""
        found: list[Table] = []
        for entry in self.entries():
            if entry.value is not None:
                found.extend(self._tables_of(entry.value))
            elif self.family is not None:
                found.append(Table(f"{self.family}.{entry.name}", None))
        return tuple(found)

    # ----- finding ------------------------------------------------------------------------------------------

    def _find(self) -> tuple[Entry[T], ...]:
        kept: dict[str, Entry[T]] = {}
        for entry in [*self._builtin(), *self._entry_points(), *self._registrations()]:
            if entry.name in kept:
                _warn(f"{self.kind}_name_taken", self.kind, entry.name, entry.origin, kept[entry.name].origin)
                continue
            kept[entry.name] = entry
        found = list(kept.values())
        order = self._order
        if order is not None:
            loaded = sorted(
                ((e, e.value) for e in found if e.value is not None), key=lambda pair: order(pair[1])
            )
            found = [*(e for e, _ in loaded), *(e for e in found if e.value is None)]
        return tuple(found)

    def _builtin(self) -> list[Entry[T]]:
        found: list[Entry[T]] = []
        for ref in self.builtins:
            module, _, attr = ref.partition(":")
            found.append(
                self._load(module.rpartition(".")[2], f"builtin {ref}", attr, partial(load_ref, ref))
            )
        return found

    def _entry_points(self) -> list[Entry[T]]:
        if self.group is None:
            return []
        return [
            self._load(point.name, f"entry point {point.value}", point.name, point.load)
            for point in entry_points(self.group)
        ]

    def _registrations(self) -> list[Entry[T]]:
        return [Entry(name, "registered", value) for name, value in self._registered.items()]

    def _load(self, fallback: str, origin: str, hint: str, load: Callable[[], object]) -> Entry[T]:
        """One entry: ``load()`` checked by ``accept``; a failure (a broken plug-in must not stop the agent
        or the others) is an entry named ``fallback`` with its error."""
        try:
            value = self._accept(hint, load())
        except Exception as exc:
            return Entry(fallback, origin, None, f"{type(exc).__name__}: {exc}")
        return Entry(self._name_of(value), origin, value)


def _warn(event: str, kind: str, name: str, skipped: str, kept: str) -> None:
    import structlog  # not at import: the client verbs load the configuration without the daemon's logging

    structlog.get_logger("preemptd.plugins").warning(
        event, plugin=kind, name=name, skipped=skipped, kept=kept, effect="rename one of them"
    )
