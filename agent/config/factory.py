"""What a component entry of the registry builds its component with (agent/service/components.py): the
component the configuration asks for, or None. Apart from :mod:`agent.config.catalog`, which the loader imports,
so that naming the configuration's type here makes no import cycle.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeAlias

if TYPE_CHECKING:
    from agent.config import Config
    from agent.core.ports import Component

ComponentFactory: TypeAlias = "Callable[[Config], Component[Any] | None]"
