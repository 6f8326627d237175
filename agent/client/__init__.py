"""Training-side client for preemptd: standard library only, cheap to import in every training process.

- :class:`Watcher` (a thread) and :class:`~agent.client.aio.AsyncWatcher` (asyncio) follow the agent's
  event stream and answer ``should_checkpoint()``, ``notice``, ``deadline`` and ``time_left()``;
- :class:`CheckpointStore` writes atomic, durable, verifiable checkpoint directories and reports each save;
- :class:`CheckpointSchedule` says when a periodic checkpoint is due (the agent's advised interval, or a
  fixed one until the agent has advice);
- ``agent.client.torch``, ``agent.client.lightning`` and ``agent.client.hf`` (optional dependencies) add
  torch state-dict helpers, cross-rank agreement, and Lightning and Hugging Face ``Trainer`` callbacks.

The public names are loaded on first use (PEP 562), so ``preemptd exec`` and the CLI's client verbs, which
import ``agent.client.transport`` or ``agent.client.preempted``, do not pay for the store and the watcher.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agent.client.events import Notice, Trigger, TriggerPolicy
    from agent.client.reporting import (
        CheckpointSchedule,
        Reporter,
        advised_interval,
        client_info,
        fetch_advice,
    )
    from agent.client.store import Checkpoint, CheckpointError, CheckpointStore, CheckpointWarning
    from agent.client.transport import AgentHTTPError, AgentUnavailable
    from agent.client.watcher import DEFAULT_SIGNALS, Backoff, Watcher

# Exit status of a training process that stopped early because its host is going away: EX_TEMPFAIL from
# sysexits.h ("try again later"), distinct from success and from crashes, for a scheduler to requeue on.
EXIT_PREEMPTED = 75

# Public name → the submodule that defines it.
_LAZY = {
    "Notice": "events",
    "Trigger": "events",
    "TriggerPolicy": "events",
    "CheckpointSchedule": "reporting",
    "Reporter": "reporting",
    "advised_interval": "reporting",
    "client_info": "reporting",
    "fetch_advice": "reporting",
    "Checkpoint": "store",
    "CheckpointError": "store",
    "CheckpointStore": "store",
    "CheckpointWarning": "store",
    "AgentHTTPError": "transport",
    "AgentUnavailable": "transport",
    "DEFAULT_SIGNALS": "watcher",
    "Backoff": "watcher",
    "Watcher": "watcher",
}

__all__ = [
    "DEFAULT_SIGNALS",
    "EXIT_PREEMPTED",
    "AgentHTTPError",
    "AgentUnavailable",
    "Backoff",
    "Checkpoint",
    "CheckpointError",
    "CheckpointSchedule",
    "CheckpointStore",
    "CheckpointWarning",
    "Notice",
    "Reporter",
    "Trigger",
    "TriggerPolicy",
    "Watcher",
    "advised_interval",
    "client_info",
    "fetch_advice",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
