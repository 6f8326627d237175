"""The cloud registry: each cloud is one :class:`CloudSpec` (its name, table, DMI match, probe, source factory
and simulator), declared as ``CLOUD`` in its source module. Detection (agent/sources/detect.py) iterates the
registry, so adding a cloud is its source module, its simulator and their tests.

Clouds are found without editing anything else, in this order (a later one with a name already taken is
skipped with a warning):

1. every module of the :mod:`agent.sources` package that defines ``CLOUD``;
2. the ``preemptd.clouds`` entry-point group (third-party packages: ``oracle = "module:SPEC"``);
3. :func:`register_cloud` (an embedding program, tests).

A cloud whose table is not a built-in section declares it (``register_table(name, schema, cloud=True)``) as it
is found, so ``cloud = "<name>"`` is accepted and its table checked when the file is loaded.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import structlog

from agent.config import Config, Discovered, add_discovery, register_table, unregister_table
from agent.config.loader import field_names
from agent.core.entry_points import entry_points
from agent.sources.base import Source

ENTRY_POINT_GROUP = "preemptd.clouds"
SOURCES_PACKAGE = "agent.sources"
SPEC_NAME = "CLOUD"

if TYPE_CHECKING:
    from agent.simulate.base import Simulator

log = structlog.get_logger("preemptd.sources.clouds")


@dataclass(frozen=True)
class CloudSpec:
    """One cloud. ``name`` is the value of ``cloud =``, the source's name and the table (``[aws]``) read
    against the frozen dataclass ``schema``. ``dmi`` is pure: whether the DMI strings name this cloud.
    ``probe(table, timeout_s)`` is one cheap request that only this cloud's metadata service answers so.
    ``factory(table)`` builds the source. ``simulator`` is the ``module:Class`` of its simulator
    (agent/simulate), ``""`` for none. Lower ``rank`` is tried first (DMI, then probes)."""

    name: str
    schema: type[Any]
    dmi: Callable[[Mapping[str, str]], bool]
    probe: Callable[[Any, float], Awaitable[bool]]
    factory: Callable[[Any], Source]
    simulator: str = ""
    rank: int = 100

    def table(self, config: Config) -> Any:
        """This cloud's table in ``config`` (checked when the file was loaded)."""
        return config.table(self.name, self.schema)

    def source(self, config: Config) -> Source:
        return self.factory(self.table(config))

    def simulator_class(self) -> type[Simulator] | None:
        """The simulator named by ``simulator`` (imported now: simulators are for tests and rehearsals)."""
        if not self.simulator:
            return None
        module, _, name = self.simulator.partition(":")
        found: type[Simulator] = getattr(importlib.import_module(module), name)
        return found


_registered: dict[str, CloudSpec] = {}


def register_cloud(spec: CloudSpec) -> None:
    """Add ``spec`` (for the configurations loaded after this call)."""
    _registered[spec.name] = spec


def unregister_cloud(name: str) -> None:
    _registered.pop(name, None)


def _in_tree() -> list[tuple[str, CloudSpec | None, str]]:
    package = importlib.import_module(SOURCES_PACKAGE)
    found: list[tuple[str, CloudSpec | None, str]] = []
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        module_name = f"{SOURCES_PACKAGE}.{info.name}"
        try:
            module = importlib.import_module(module_name)
        except Exception as exc:  # a broken module must not take the other clouds with it
            found.append((f"module {module_name}", None, f"{type(exc).__name__}: {exc}"))
            continue
        spec = getattr(module, SPEC_NAME, None)
        if isinstance(spec, CloudSpec):
            found.append((f"module {module_name}", spec, ""))
    return found


def _entry_points() -> list[tuple[str, CloudSpec | None, str]]:
    found: list[tuple[str, CloudSpec | None, str]] = []
    for point in entry_points(ENTRY_POINT_GROUP):
        origin = f"entry point {point.value}"
        try:
            spec = point.load()
        except Exception as exc:
            found.append((origin, None, f"{type(exc).__name__}: {exc}"))
            continue
        if not isinstance(spec, CloudSpec):
            found.append((origin, None, f"{point.value} is a {type(spec).__name__}, not a CloudSpec"))
            continue
        found.append((origin, spec, ""))
    return found


def clouds() -> dict[str, CloudSpec]:
    """Every cloud available now, by name, in detection order (rank, then name)."""
    candidates = _in_tree() + _entry_points() + [("registered", s, "") for s in _registered.values()]
    kept: dict[str, tuple[str, CloudSpec]] = {}
    for origin, spec, error in candidates:
        if spec is None:
            log.error("cloud_unavailable", origin=origin, error=error)
        elif spec.name in kept:
            log.warning("cloud_name_taken", cloud=spec.name, skipped=origin, kept=kept[spec.name][0])
        else:
            kept[spec.name] = (origin, spec)
    ordered = sorted((spec for _, spec in kept.values()), key=lambda s: (s.rank, s.name))
    return {spec.name: spec for spec in ordered}


def get(name: str) -> CloudSpec:
    try:
        return clouds()[name]
    except KeyError:
        raise ValueError(f"unknown cloud {name!r}") from None


# The tables this registry declared, so that a cloud that is gone (unregistered) takes its table with it.
_declared: set[str] = set()


def _tables() -> Discovered:
    """For the loader: the clouds that are not built-in sections declare their tables."""
    builtin = field_names(Config)
    found = {name: spec for name, spec in clouds().items() if name not in builtin}
    for name in _declared - set(found):
        unregister_table(name)
    for name, spec in found.items():
        register_table(name, spec.schema, cloud=True)
    _declared.clear()
    _declared.update(found)
    return Discovered(None)


add_discovery(_tables)
