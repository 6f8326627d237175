"""Training-side client for preemptd: standard library only, cheap to import in every training process.

- :class:`Watcher` (a thread) and :class:`~agent.client.aio.AsyncWatcher` (asyncio) follow the agent's
  event stream and answer ``should_checkpoint()``, ``notice``, ``deadline`` and ``time_left()``;
- :class:`CheckpointStore` writes atomic, durable, verifiable checkpoint directories and reports each save;
- :class:`CheckpointSchedule` says when a periodic checkpoint is due (the agent's advised interval, or a
  fixed one until the agent has advice);
- ``agent.client.torch``, ``agent.client.lightning`` and ``agent.client.hf`` (optional dependencies) add
  torch state-dict helpers, cross-rank agreement, and Lightning and Hugging Face ``Trainer`` callbacks.
"""

from agent.client.events import Notice, Trigger, TriggerPolicy
from agent.client.reporting import CheckpointSchedule, Reporter, advised_interval, client_info, fetch_advice
from agent.client.store import Checkpoint, CheckpointError, CheckpointStore, CheckpointWarning
from agent.client.transport import AgentHTTPError, AgentUnavailable
from agent.client.watcher import DEFAULT_SIGNALS, Backoff, Watcher

# Exit status of a training process that stopped early because its host is going away: EX_TEMPFAIL from
# sysexits.h ("try again later"), distinct from success and from crashes, for a scheduler to requeue on.
EXIT_PREEMPTED = 75

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
