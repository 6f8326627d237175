"""What the ``ready`` step tracks for one notice: the participants it waits for, those that finished or
failed their emergency checkpoint, and when and why it was declared ready (shown under ``notices`` in the
step's status).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from agent.actions.participants import STATUS_SAMPLE, Owned, labels
from agent.core.notice import Notice, format_time


@dataclass
class Pending:
    notice: Notice
    expected: set[Owned]
    started: float
    cutoff_s: float
    done: dict[Owned, str] = field(default_factory=dict)
    ready_at: datetime | None = None
    data: dict[str, Any] = field(default_factory=dict)
    timer: asyncio.Task[Any] | None = None
    cleared: bool = False

    @property
    def waiting(self) -> bool:
        return self.ready_at is None and not self.cleared

    def outcome(self) -> dict[str, list[str]]:
        """The participants by name (the uid added where two hold one name): all, finished, failed,
        missing."""
        shown = labels(self.expected | set(self.done))

        def names(keys: Any) -> list[str]:
            return sorted(shown[k] for k in keys)

        return {
            "participants": names(self.expected),
            "finished": names(k for k, v in self.done.items() if v == "finished"),
            "failed": names(k for k, v in self.done.items() if v == "failed"),
            "missing": names(self.expected - set(self.done)),
        }

    def to_json(self) -> dict[str, Any]:
        outcome = self.outcome()
        doc: dict[str, Any] = {
            "kind": self.notice.kind.value,
            "state": "cleared"
            if self.cleared and self.ready_at is None
            else "ready"
            if self.ready_at
            else "waiting",
            **{key: names[:STATUS_SAMPLE] for key, names in outcome.items()},
            "counts": {
                "participants": len(self.expected),
                "finished": sum(1 for v in self.done.values() if v == "finished"),
                "failed": sum(1 for v in self.done.values() if v == "failed"),
                "missing": len(self.expected - set(self.done)),
            },
            "grace_s": round(self.cutoff_s, 3),
        }
        if self.ready_at is not None:
            doc["ready_at"] = format_time(self.ready_at)
            doc.update(
                {k: self.data[k] for k in ("reason", "notice_to_ready_s", "margin_s") if k in self.data}
            )
        return doc
