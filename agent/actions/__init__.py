"""Acting on notices for programs that never connect: signals, hooks, webhooks, and the ``ready`` step
(participants saved, cloud acknowledged). :class:`ActionsComponent` wires them into the agent.

The component (aiohttp, psutil, prometheus-client) is imported on first use, so that importing one module
of the package (the bridges import :mod:`agent.actions.common`) stays cheap. The checks of the actions'
values live with the configuration (:mod:`agent.config.validate`), which loads them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agent.actions.component import ActionsComponent

__all__ = ["ActionsComponent"]


def __getattr__(name: str) -> Any:
    if name == "ActionsComponent":
        from agent.actions.component import ActionsComponent

        return ActionsComponent
    raise AttributeError(f"module 'agent.actions' has no attribute {name!r}")
