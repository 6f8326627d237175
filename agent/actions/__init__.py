"""Acting on notices for programs that never connect: signals, hooks, webhooks, and the ``ready`` step
(participants saved, cloud acknowledged). :class:`ActionsComponent` wires them into the agent.

The component (aiohttp, psutil, prometheus-client) is imported on first use: the configuration loader
imports :mod:`agent.actions.validate` from here, and must stay cheap.
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
