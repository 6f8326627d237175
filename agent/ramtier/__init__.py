"""The RAM tier: a directory on tmpfs, owned by the agent, where jobs keep checkpoint steps in this host's
memory (issue 24); see docs/ram-tier.md.

Its names are imported when first used: the configuration catalog imports ``agent.ramtier.part`` and
``config`` for every file it checks, and the drain child (``python -m agent.ramtier.drain``) needs none of the component's web and
metrics libraries."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agent.ramtier.component import RamTierComponent
    from agent.ramtier.config import RamTierConfig

__all__ = ["RamTierComponent", "RamTierConfig"]
_WHERE = {"RamTierComponent": "agent.ramtier.component", "RamTierConfig": "agent.ramtier.config"}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'agent.ramtier' has no attribute {name!r}")
