"""What the RAM tier's parts use of each other and of the agent, as Protocols: the component is set up with a
:class:`RamTierHost` (the agent), and the routes serve a :class:`TierView` (the component)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol, TypeVar

from agent.core.ports import Clocked, HasHooks, Logged, Tasked
from agent.core.ratelog import ClientMistakes, Tally
from agent.ramtier.config import RamTierConfig
from agent.ramtier.holdings import Holdings, Key
from agent.ramtier.inventory import Root

T = TypeVar("T")


class TierConfigView(Protocol):
    @property
    def admin_group(self) -> str | None: ...

    def table(self, name: str, schema: type[T]) -> T: ...


class RamTierHost(Logged, Tasked, Clocked, HasHooks, Protocol):
    """What the RAM tier uses of the agent."""

    @property
    def config(self) -> TierConfigView: ...


class TierView(Protocol):
    """What the routes use of the component."""

    @property
    def config(self) -> RamTierConfig: ...

    @property
    def host(self) -> RamTierHost: ...

    @property
    def holdings(self) -> Holdings: ...

    @property
    def mistakes(self) -> ClientMistakes:
        """Refusals a client causes, logged with a bounded rate."""
        ...

    @property
    def requests(self) -> Tally:
        """Reservations, commits and frees, counted: one info line per interval (each is a debug line)."""
        ...

    async def ready_root(self) -> Root: ...

    def summary(self, uid: int, every_uid: bool = False) -> dict[str, Any]: ...

    async def reserve(self, key: Key, nbytes: int, gid: int, durable_root: str | None) -> tuple[Path, str]:
        """Room for the step ``key`` (uid, job, step): its directory, made, and the reservation's id."""
        ...

    def drain(self, key: Key, durable_root: str, gid: int | None) -> None:
        """Queue the copy of a committed step into ``durable_root`` (docs/ram-tier.md, "Drain"), as the job's
        uid and ``gid`` (the uid's primary group when None)."""
        ...

    def forget_drains(self, uid: int, job: str, step: int | None) -> None: ...
