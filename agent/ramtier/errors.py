"""The RAM tier's refusal: one exception that carries the HTTP status saying why."""

from __future__ import annotations

from typing import Any

from agent.core.errors import PreemptdError


class TierError(PreemptdError):
    """A RAM-tier request that cannot be served; ``status`` is the HTTP status that says why (400 bad input,
    403 not the job's owner, 404 nothing held, 409 a step that does not check out, 429 too many reservations,
    503 the tier cannot be used, 507 full). ``extra`` goes into the JSON answer beside ``error``."""

    def __init__(self, status: int, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.status = status
        self.extra = extra
