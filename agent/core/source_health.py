"""The health book: each source's health (starting, ok, degraded, disabled), with when it last changed, its
last error and how many errors it has had. Sources report through their sink; status, metrics and the
notice expiry read it.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from agent.core.notice import format_time


class HealthState(str, enum.Enum):
    STARTING = "starting"
    OK = "ok"
    DEGRADED = "degraded"
    DISABLED = "disabled"


@dataclass(frozen=True)
class SourceHealth:
    """A source's health as shown in ``/v1/status`` and in metrics."""

    state: HealthState
    since: datetime
    last_error: str | None = None
    last_error_at: datetime | None = None
    last_ok_at: datetime | None = None
    errors: int = 0
    detail: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "state": self.state.value,
            "since": format_time(self.since),
            "last_error": self.last_error,
            "last_error_at": format_time(self.last_error_at) if self.last_error_at else None,
            "last_ok_at": format_time(self.last_ok_at) if self.last_ok_at else None,
            "errors": self.errors,
            "detail": dict(self.detail),
        }


class HealthBook(Mapping[str, SourceHealth]):
    def __init__(self, now: Callable[[], datetime], log: Any) -> None:
        self._now = now
        self._log = log
        self._book: dict[str, SourceHealth] = {}

    def __getitem__(self, name: str) -> SourceHealth:
        return self._book[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._book)

    def __len__(self) -> int:
        return len(self._book)

    def mark(
        self, name: str, state: HealthState, error: str | None = None, detail: Mapping[str, Any] | None = None
    ) -> None:
        now = self._now()
        old = self._book.get(name)
        self._book[name] = SourceHealth(
            state=state,
            since=old.since if old is not None and old.state is state else now,
            last_error=error if error else (old.last_error if old else None),
            last_error_at=now if error else (old.last_error_at if old else None),
            last_ok_at=now if state is HealthState.OK else (old.last_ok_at if old else None),
            errors=(old.errors if old else 0) + (1 if error else 0),
            detail=dict(detail) if detail is not None else (dict(old.detail) if old else {}),
        )
        if old is not None and old.state is HealthState.DEGRADED and state is HealthState.OK:
            # Only after a failure: a source's first good read at start is not a recovery.
            self._log.info("source_recovered", source=name, after_errors=old.errors)

    def keep_only(self, names: Collection[str]) -> None:
        """Forget the sources that are gone (a reload replaced them)."""
        self._book = {k: v for k, v in self._book.items() if k in names}

    def degraded(self) -> bool:
        return any(h.state is HealthState.DEGRADED for h in self._book.values())

    def running(self, name: str) -> bool:
        """Whether ``name`` is a source that still speaks for its notices (known and not disabled)."""
        health = self._book.get(name)
        return health is not None and health.state is not HealthState.DISABLED
