"""The agent's components — parts that live as long as it does (the actions runner, the advisor, the metrics
listener): which ones a configuration runs, and how they start, stop and reload as a group.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from agent.config import Config
from agent.core.ports import Component


def build_components(config: Config) -> list[Component[Any]]:
    """The components a configuration runs, in start order (they stop in reverse)."""
    from agent.actions import ActionsComponent
    from agent.ledger.component import LedgerComponent
    from agent.ledger.config import LedgerConfig
    from agent.ramtier import RamTierComponent
    from agent.service.metrics import MetricsComponent
    from agent.window.component import WindowComponent

    components: list[Component[Any]] = [ActionsComponent(config)]
    if config.advisor.enabled:
        from agent.advisor.component import AdvisorComponent

        components.append(AdvisorComponent())
    if config.table("ledger", LedgerConfig).enabled:
        components.append(LedgerComponent())
    components.append(RamTierComponent())  # always: answers "off" on its routes when disabled
    components.append(WindowComponent())
    components.append(MetricsComponent(config.metrics, config.api.idle_timeout_s))
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
