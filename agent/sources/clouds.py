"""The cloud registry, :data:`CLOUDS`: each cloud is one :class:`CloudSpec` — its name, table, DMI match,
probe, source factory, simulator, the notices it gives and how long ahead — declared as ``CLOUD`` in its source
module. Detection (agent/sources/detect.py), the configuration's ``cloud =`` and its table, the notice window
and ``preemptd simulate`` all read the spec, so a cloud is its source module and its simulator module
(docs/internals.md, "How to add a cloud").

The registry's order (agent/core/plugins.py): the built-in clouds below, then the ``preemptd.clouds``
entry-point group (third-party packages: ``oracle = "module:CLOUD"``), then ``CLOUDS.register(spec)``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import structlog

from agent.config import Config
from agent.core.plugins import Registry, Table, load_ref
from agent.sources.base import Source

ENTRY_POINT_GROUP = "preemptd.clouds"

# Detection order is by rank; these are imported the first time the registry is read.
BUILTIN: tuple[str, ...] = (
    "agent.sources.aws:CLOUD",
    "agent.sources.gcp:CLOUD",
    "agent.sources.azure:CLOUD",
    "agent.sources.alibaba:CLOUD",
    "agent.sources.tencent:CLOUD",
)

if TYPE_CHECKING:
    from agent.simulate.base import Simulator

log = structlog.get_logger("preemptd.sources.clouds")


@dataclass(frozen=True)
class Lead:
    """What a cloud says ahead of one kind of notice (``termination``, ``maintenance``, ``rebalance``): how
    many seconds (None: no figure), in words, whether the notice has a deadline at all (AWS's rebalance
    recommendation has none), and whether the peer tier is the way to a longer window (the cloud's lead is
    fixed)."""

    kind: str
    seconds: float | None
    source: str
    deadline: bool = True
    fixed: bool = False
    lengthen: str = ""


@dataclass(frozen=True)
class CloudSpec:
    """One cloud. ``name`` is the value of ``cloud =``, the source's name and the table (``[aws]``) read
    against the frozen dataclass ``schema``. ``dmi`` is pure: whether the DMI strings name this cloud.
    ``probe(table, timeout_s)`` is one cheap request that only this cloud's metadata service answers so.
    ``factory(table)`` builds the source. ``simulator`` is the ``module:Class`` of its simulator
    (agent/simulate), ``""`` for none. Lower ``rank`` is tried first (DMI, then probes). ``leads(table)``: the
    notices the cloud gives and how far ahead (the notice window, docs/window.md). ``about``: one line for
    people (the cloud and its metadata service)."""

    name: str
    schema: type[Any]
    dmi: Callable[[Mapping[str, str]], bool]
    probe: Callable[[Any, float], Awaitable[bool]]
    factory: Callable[[Any], Source]
    simulator: str = ""
    rank: int = 100
    leads: Callable[[Any], Sequence[Lead]] = lambda _table: ()
    about: str = ""

    def table(self, config: Config) -> Any:
        """This cloud's table in ``config`` (checked when the file was loaded)."""
        return config.table(self.name, self.schema)

    def source(self, config: Config) -> Source:
        return self.factory(self.table(config))

    def simulator_class(self) -> type[Simulator] | None:
        """The simulator named by ``simulator`` (imported now: simulators are for tests and rehearsals)."""
        if not self.simulator:
            return None
        found: type[Simulator] = load_ref(self.simulator)
        return found


def _accept(_name: str, loaded: object) -> CloudSpec:
    if not isinstance(loaded, CloudSpec):
        raise TypeError(f"a {type(loaded).__name__}, not a CloudSpec")
    return loaded


CLOUDS: Registry[CloudSpec] = Registry(
    "cloud",
    BUILTIN,
    group=ENTRY_POINT_GROUP,
    accept=_accept,
    name_of=lambda spec: spec.name,
    tables_of=lambda spec: (Table(spec.name, spec.schema, cloud=True),),
    order=lambda spec: (spec.rank, spec.name),
)


def clouds() -> dict[str, CloudSpec]:
    """Every cloud available now, by name, in detection order (rank, then name). One that cannot be loaded is
    logged and left out."""
    for entry in CLOUDS.entries():
        if entry.value is None:
            log.error("cloud_unavailable", origin=entry.origin, error=entry.error)
    return CLOUDS.available()


def get(name: str) -> CloudSpec:
    try:
        return CLOUDS.get(name)
    except KeyError:
        raise ValueError(f"unknown cloud {name!r}") from None
