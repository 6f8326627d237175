"""What one part offers the others through a named host capability: a registry of sources by name (the
window's limits, agent/window/limits.py; the job names, agent/core/jobs.py). A later source of a name replaces
the earlier one (a reloaded bridge), and a part that a reload turned off withdraws its own."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar

S = TypeVar("S")
R = TypeVar("R", bound="SourceRegistry[Any]")


class SourceRegistry(Generic[S]):
    """Sources by name; ``changed`` is called when one is added or removed."""

    def __init__(self) -> None:
        self.sources: dict[str, S] = {}
        self.changed: Callable[[], None] = lambda: None

    def add(self, name: str, source: S) -> None:
        self.sources[name] = source
        self.changed()

    def remove(self, name: str) -> None:
        """Take a part's source back (a reload turned it off)."""
        if self.sources.pop(name, None) is not None:
            self.changed()


class Capabilities(Protocol):
    def capability(self, name: str) -> Any | None: ...

    def provide(self, name: str, fn: Any) -> None: ...


def provided(host: Capabilities, capability: str, kind: type[R]) -> R:
    """The host's registry under ``capability``, provided now if nobody did yet."""
    found = host.capability(capability)
    if isinstance(found, kind):
        return found
    registry = kind()
    host.provide(capability, registry)
    return registry


def withdraw(host: Capabilities, capability: str, name: str) -> None:
    """Take back the source ``name`` offered under ``capability``, if the host has that registry."""
    found = host.capability(capability)
    if isinstance(found, SourceRegistry):
        found.remove(name)
