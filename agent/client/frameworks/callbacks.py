"""What the framework callbacks (Lightning's and the Hugging Face Trainer's) share: the options that say how
they follow notices, and the watcher each runs from the start of training to its end unless given one.
"""

from __future__ import annotations

from pathlib import Path
from typing import TypedDict

from agent.client.events import TriggerPolicy
from agent.client.reporting import CheckpointSchedule
from agent.client.watcher import Watcher, WatcherBase


class WatchOptions(TypedDict, total=False):
    """Keyword options of both callbacks.

    ``every``: check (and agree across ranks) every this many optimizer steps. ``interval_s``: a fixed
    periodic checkpoint interval used until the agent advises one; None leaves periodic checkpoints off (the
    Trainer's own ``save_steps`` still apply). ``stop_on_notice``: stop training after the emergency
    checkpoint. ``socket_path``: the agent's socket. ``watcher``: share an existing watcher; otherwise the
    callback runs its own while training. ``policy``: which notices trigger an emergency checkpoint."""

    every: int
    interval_s: float | None
    stop_on_notice: bool
    socket_path: str | Path | None
    watcher: WatcherBase | None
    policy: TriggerPolicy | None


class FollowsNotices:
    """The state both callbacks keep from :class:`WatchOptions`, and their watcher's lifetime."""

    def __init__(
        self,
        *,
        every: int = 1,
        interval_s: float | None = None,
        stop_on_notice: bool = True,
        socket_path: str | Path | None = None,
        watcher: WatcherBase | None = None,
        policy: TriggerPolicy | None = None,
    ) -> None:
        if every < 1:
            raise ValueError(f"every must be at least 1, got {every}")
        self.every = every
        self.stop_on_notice = stop_on_notice
        self.socket_path = socket_path
        self.policy = policy
        self.schedule = CheckpointSchedule(interval_s, socket_path) if interval_s is not None else None
        self.watcher = watcher
        self._own_watcher = watcher is None
        self.preempted = False

    def start_watching(self) -> WatcherBase:
        """The watcher given, or a new one started now (stopped by :meth:`stop_watching`)."""
        if self.watcher is None:
            self.watcher = Watcher(self.socket_path, policy=self.policy).start()
        return self.watcher

    def stop_watching(self) -> None:
        if self._own_watcher and isinstance(self.watcher, Watcher):
            self.watcher.stop()
            self.watcher = None
