"""The RAM tier's entry in the component registry (agent/service/components.py), with its table."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from agent.config.factory import ComponentFactory
from agent.core.plugins import Part, Table
from agent.ramtier.config import RamTierConfig

if TYPE_CHECKING:
    from agent.config import Config
    from agent.core.ports import Component


def build_ram_tier(config: Config) -> Component[Any]:
    """Always: the RAM tier answers "off" on its routes when it is disabled."""
    from agent.ramtier.component import RamTierComponent  # the daemon's part: `report` loads no more of it

    return RamTierComponent()


COMPONENT: Part[ComponentFactory] = Part("ram_tier", build_ram_tier, (Table("ram_tier", RamTierConfig),))
