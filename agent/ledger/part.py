"""The ledger's entry in the component registry (agent/service/components.py); its tables are checked when the
configuration is loaded: a bad value stops the start-up, named."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from agent.config.factory import ComponentFactory
from agent.core.plugins import Part, Table
from agent.ledger.config import CostConfig, LedgerConfig

if TYPE_CHECKING:
    from agent.config import Config
    from agent.core.ports import Component


def build_ledger(config: Config) -> Component[Any] | None:
    """The ledger, when ``[ledger] enabled``."""
    if not config.table("ledger", LedgerConfig).enabled:
        return None
    from agent.ledger.component import LedgerComponent  # the daemon's part: `report` loads no more of it

    return LedgerComponent()


COMPONENT: Part[ComponentFactory] = Part(
    "ledger", build_ledger, (Table("ledger", LedgerConfig), Table("cost", CostConfig))
)
