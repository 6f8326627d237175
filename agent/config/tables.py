"""The registry of configuration tables: every part that reads a table of its own (a scheduler bridge's
``[actions.slurm]``, a cloud's ``[aws]``, a component's ``[ram_tier]``) declares it here with
:func:`register_table`, and :func:`agent.config.load_config` checks each declared table when the file is
loaded, so ``preemptd run --print-config``, start-up and a reload refuse a bad value before anything binds.

Before a file is checked, the built-in components' table modules listed in agent/config/catalog.py are
imported, whoever loads the file. The plug-in registries that find parts (the reactor registry, the cloud
registry) join with :func:`add_discovery`: each then imports the parts it finds (which declare their tables
as they are imported) and says which table family it knows completely (``"actions"``). A table in such a
family that nobody declared is refused with a "did you mean"; so is an unknown top-level table.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from agent.config.catalog import declare_builtin_tables
from agent.core.errors import ConfigError

T = TypeVar("T")


@dataclass(frozen=True)
class Declared:
    """One declared table: its dotted name, the frozen dataclass it is checked against, and whether it is a
    cloud's (then ``cloud = "<name>"`` chooses that cloud)."""

    name: str
    schema: type[Any]
    cloud: bool = False


@dataclass(frozen=True)
class Discovered:
    """What one registry found: the family of tables it knows completely (``"actions"``: a table
    ``[actions.x]`` that is not declared is an error; None: no family), and the names of tables whose owner reads them
    unchecked (a third-party reactor that declares no schema; it checks its table when it is built)."""

    family: str | None
    unchecked: Collection[str] = ()


_declared: dict[str, Declared] = {}
_discoveries: list[Callable[[], Discovered]] = []


def register_table(name: str, schema: type[T], *, cloud: bool = False) -> type[T]:
    """Declare the table ``name`` (dotted: ``"actions.slurm"``, or top-level: ``"ram_tier"``) as checked
    against the frozen dataclass ``schema``; returns ``schema``. Call it where the schema is defined, at
    import. Declaring the same name again replaces it (a module reloaded in tests)."""
    if not name or any(not part.isidentifier() for part in name.split(".")):
        raise ValueError(f"a table name is dotted identifiers (actions.slurm, ram_tier), got {name!r}")
    _declared[name] = Declared(name, schema, cloud)
    return schema


def unregister_table(name: str) -> None:
    _declared.pop(name, None)


def add_discovery(discover: Callable[[], Discovered]) -> None:
    """Run ``discover`` before every load (it imports its plug-ins, which declare their tables). Added once
    per registry, when the registry is imported."""
    if discover not in _discoveries:
        _discoveries.append(discover)


@dataclass(frozen=True)
class Known:
    """Everything the loader checks a file against, gathered when the file is loaded."""

    declared: Mapping[str, Declared]
    # Families whose every table is known (an undeclared one is an error), and the tables read unchecked.
    closed: frozenset[str]
    unchecked: frozenset[str]

    def clouds(self) -> tuple[str, ...]:
        return tuple(name for name, item in self.declared.items() if item.cloud)


def known() -> Known:
    """Declare the built-in components' tables (agent/config/catalog.py), run the registries' discoveries,
    then return the declared tables."""
    declare_builtin_tables()
    closed: set[str] = set()
    unchecked: set[str] = set()
    for discover in list(_discoveries):
        found = discover()
        if found.family is not None:
            closed.add(found.family)
        unchecked.update(found.unchecked)
    return Known(dict(_declared), frozenset(closed), frozenset(unchecked))


def take_tables(
    merged: dict[str, Any],
    known: Known,
    core: Mapping[str, bool],
    extensible: Mapping[str, Collection[str]],
    where: Callable[[str], str],
) -> dict[str, dict[str, Any]]:
    """Take the declared tables, and every other table under an ``extensible`` section (mapped to the keys
    of its own), out of ``merged`` (by dotted name). ``core`` maps the top-level keys to whether each is a
    table. A top-level table that is neither ``core`` nor declared, and a table under a closed family that is
    neither declared nor read unchecked, is a ConfigError with a "did you mean"."""
    tables: dict[str, dict[str, Any]] = {}
    for name in sorted(known.declared, key=lambda n: -n.count(".")):  # the deepest first
        *path, last = name.split(".")
        node: Any = merged
        for part in path:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and last in node:
            value = node.pop(last)
            if not isinstance(value, Mapping):
                raise ConfigError(f"{where(name)}: key {name!r}: expected a table, got {value!r}")
            tables[name] = dict(value)
    for key in [k for k, v in merged.items() if isinstance(v, Mapping) and k not in core]:
        sections = [name for name, is_table in core.items() if is_table]
        raise ConfigError(_unknown(key, [*sections, *(n for n in known.declared if "." not in n)], where))
    for section, own in extensible.items():
        node = merged.get(section)
        if not isinstance(node, dict):
            continue
        for key in [k for k, v in node.items() if isinstance(v, Mapping) and k not in own]:
            name = f"{section}.{key}"
            if section in known.closed and name not in known.unchecked:
                siblings = [
                    n
                    for n in [*known.declared, *known.unchecked]
                    if n.startswith(section + ".") and n.split(".")[1] not in own
                ]
                raise ConfigError(_unknown(name, siblings, where))
            tables[name] = dict(node.pop(key))
    return tables


def _unknown(name: str, candidates: Iterable[str], where: Callable[[str], str]) -> str:
    family, _, last = name.rpartition(".")
    listed = sorted({n for n in candidates if n.rpartition(".")[0] == family})
    # Compared on the last part: the shared "actions." would make every name look close.
    close = difflib.get_close_matches(last, [n.rpartition(".")[2] for n in listed], n=1)
    hint = f" (did you mean {(family + '.' if family else '') + close[0]!r}?)" if close else ""
    known_here = f"; the tables {'under ' + repr(family) if family else 'known'} are: {', '.join(listed)}"
    advice = "; install the part that reads it, or remove the table"
    return f"{where(name)}: unknown table {name!r}{hint}{known_here if listed else ''}{advice}"
