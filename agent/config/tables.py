"""The configuration tables that plug-ins read, gathered when a file is loaded: every registry of
agent/config/catalog.py (clouds, reactors, components) says which tables its entries read
(:class:`agent.core.plugins.Table`), and :func:`agent.config.load_config` checks each declared table, so
``preemptd run --print-config``, ``report``, start-up and a reload refuse a bad value before anything binds.
A registry may know a table family completely (the reactors, ``"actions"``): a table in it that no entry reads
is refused with a "did you mean"; so is an unknown top-level table.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from agent.config.catalog import registries
from agent.core.errors import ConfigError


@dataclass(frozen=True)
class Declared:
    """One declared table: its dotted name, the frozen dataclass it is checked against, and whether it is a
    cloud's (then ``cloud = "<name>"`` chooses that cloud)."""

    name: str
    schema: type[Any]
    cloud: bool = False


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
    """The tables the entries of every registry of the catalog read, now (the first to declare a name keeps
    it)."""
    declared: dict[str, Declared] = {}
    closed: set[str] = set()
    unchecked: set[str] = set()
    for registry in registries():
        if registry.family is not None:
            closed.add(registry.family)
        for table in registry.tables():
            if table.schema is None:
                unchecked.add(table.name)
            else:
                declared.setdefault(table.name, Declared(table.name, table.schema, table.cloud))
    return Known(declared, frozenset(closed), frozenset(unchecked))


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
