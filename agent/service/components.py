"""The agent's components — parts that live as long as it does (the actions runner, the advisor, the ledger,
the RAM tier, the window, the metrics listener): :data:`COMPONENTS`, the component registry
(agent/core/plugins.py), says which ones there are and in which order they start (they stop in reverse); each
entry builds its component from the configuration (or None: not asked for) and declares the tables it reads.
Third-party components come through the ``preemptd.components`` entry-point group.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import structlog

from agent.config import Config
from agent.config.factory import ComponentFactory
from agent.core.plugins import Part, Registry
from agent.core.ports import Component

ENTRY_POINT_GROUP = "preemptd.components"

# In start order.
BUILTIN: tuple[str, ...] = (
    "agent.service.components:ACTIONS",
    "agent.service.components:ADVISOR",
    "agent.ledger.part:COMPONENT",
    "agent.ramtier.part:COMPONENT",
    "agent.service.components:WINDOW",
    "agent.service.components:METRICS",
    "agent.service.components:MEMBERSHIP",
)

log = structlog.get_logger("preemptd.components")


def _actions(config: Config) -> Component[Any]:
    from agent.actions import ActionsComponent

    return ActionsComponent(config)


def _advisor(config: Config) -> Component[Any] | None:
    if not config.advisor.enabled:
        return None
    from agent.advisor.component import AdvisorComponent

    return AdvisorComponent()


def _window(config: Config) -> Component[Any]:
    from agent.window.component import WindowComponent

    return WindowComponent()


def _metrics(config: Config) -> Component[Any]:
    from agent.service.metrics import MetricsComponent

    return MetricsComponent(config.metrics, config.api.idle_timeout_s)


def _membership(config: Config) -> Component[Any]:
    from agent.service.membership import MembershipComponent

    return MembershipComponent()


# The built-in components whose tables are core sections ([actions], [advisor], [metrics]).
ACTIONS: Part[ComponentFactory] = Part("actions", _actions)
ADVISOR: Part[ComponentFactory] = Part("advisor", _advisor)
WINDOW: Part[ComponentFactory] = Part("window", _window)
METRICS: Part[ComponentFactory] = Part("metrics", _metrics)
MEMBERSHIP: Part[ComponentFactory] = Part("membership", _membership)


def _accept(_name: str, loaded: object) -> Part[ComponentFactory]:
    if not isinstance(loaded, Part):
        raise TypeError(f"a {type(loaded).__name__}, not a Part")
    return loaded


COMPONENTS: Registry[Part[ComponentFactory]] = Registry(
    "component",
    BUILTIN,
    group=ENTRY_POINT_GROUP,
    accept=_accept,
    name_of=lambda part: part.name,
    tables_of=lambda part: part.tables,
)


def build_components(config: Config) -> list[Component[Any]]:
    """The components a configuration runs, in start order (they stop in reverse). A built-in that cannot be
    loaded is a bug and raises; a plug-in's is logged and left out."""
    components: list[Component[Any]] = []
    for entry in COMPONENTS.entries():
        if entry.value is None:
            if entry.origin.startswith("builtin"):
                raise RuntimeError(
                    f"the component {entry.name} ({entry.origin}) cannot be loaded: {entry.error}"
                )
            log.error("component_unavailable", component=entry.name, origin=entry.origin, error=entry.error)
            continue
        component = entry.value.build(config)
        if component is not None:
            components.append(component)
    return components


async def start_all(components: Sequence[Component[Any]]) -> None:
    for component in components:
        await component.start()


async def stop_all(components: Sequence[Component[Any]], timeout: float, log: Any) -> None:
    """In reverse order, each bounded by ``timeout``; one that fails or hangs is logged and left behind."""
    for component in reversed(components):
        try:
            await asyncio.wait_for(component.stop(), timeout)
        except (Exception, asyncio.TimeoutError) as exc:
            log.warning("component_stop_failed", component=component.name, error=repr(exc))


async def reload_all(components: Sequence[Component[Any]], config: Config) -> None:
    """Hand a reloaded configuration to the components that take one (``reload(config)``)."""
    for component in components:
        reload = getattr(component, "reload", None)
        if reload is not None:
            await reload(config)
