"""What a part offers the window (docs/window.md, "For a part that knows a limit"): :class:`Limit`, one limit
on the time a job gets once it is told to stop, and the ``window_limits`` capability, a :class:`LimitRegistry`
of limit sources that whichever comes first (the part or the window component) provides:
``limit_registry(host).add(name, source)``, where ``source`` is an async callable returning :class:`Limit`
values. The window never imports the part, and the order the parts are built in does not matter.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from agent.core.offers import Capabilities, SourceRegistry, provided, withdraw

# The capability under which the LimitRegistry is shared.
WINDOW_LIMITS = "window_limits"


@dataclass(frozen=True)
class Limit:
    """One limit on the time a job gets once it is told to stop. ``seconds`` None: unknown (``detail`` says
    why). ``kinds`` empty: every kind with a deadline. ``lengthen``: what would make it longer."""

    name: str
    seconds: float | None
    source: str
    lengthen: str = ""
    detail: str = ""
    kinds: tuple[str, ...] = ()
    held: bool = False  # something holds the SIGTERM that starts it until the save is recorded

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "name": self.name,
            "seconds": self.seconds,
            "state": "unknown" if self.seconds is None else "held" if self.held else "known",
            "source": self.source,
        }
        if self.detail:
            doc["detail"] = self.detail
        if self.lengthen:
            doc["lengthen"] = self.lengthen
        return doc


LimitSource = Callable[[], Awaitable[Sequence[Limit]]]


class LimitRegistry(SourceRegistry[LimitSource]):
    """The limit sources parts offer, by name; ``changed`` (each addition or removal) makes the window
    component read the limits again."""


def withdraw_limits(host: Capabilities, name: str) -> None:
    """Take back the limit source ``name`` offered (a bridge a reload turned off)."""
    withdraw(host, WINDOW_LIMITS, name)


def limit_registry(host: Capabilities) -> LimitRegistry:
    """The host's registry of limit sources, provided now if nobody did yet."""
    return provided(host, WINDOW_LIMITS, LimitRegistry)
