"""The RAM tier: a directory on tmpfs, owned by the agent, where jobs keep checkpoint steps in this host's
memory (issue 24); see docs/ram-tier.md."""

from agent.ramtier.component import RamTierComponent
from agent.ramtier.config import RamTierConfig

__all__ = ["RamTierComponent", "RamTierConfig"]
