"""Acting on notices for programs that never connect: signals, hooks, webhooks, and the ``ready`` step
(participants saved, cloud acknowledged). :class:`ActionsComponent` wires them into the agent."""

from __future__ import annotations

from agent.actions.component import ActionsComponent

__all__ = ["ActionsComponent"]
