"""The Slurm bridge (``[actions.slurm]``): on a notice it drains this host's Slurm node, and once the training
processes on the host have flushed (the ``ready`` event) or the deadline minus a margin comes, requeues the
node's requeueable jobs and optionally signals their steps; when the notice clears it resumes the node, but
only a drain that is still the agent's own. docs/slurm.md has the timeline and the configuration.

This module is the reactor: it records each event and starts the steps in tasks it owns, so a slow or missing
controller never delays an event on its way to clients. The steps and their retries are in
:mod:`agent.bridges.slurm_steps`, what they keep in :mod:`agent.bridges.slurm_work`, the table in
:mod:`agent.bridges.slurm_config`, and Slurm's tools in :mod:`agent.bridges.slurm_commands`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from datetime import datetime
from typing import Any

import structlog

from agent.actions.common import applies
from agent.bridges.common import register_metrics
from agent.bridges.slurm_commands import SlurmCommands, SlurmError, host_names, parse_signal
from agent.bridges.slurm_config import SlurmConfig
from agent.bridges.slurm_steps import SlurmSteps
from agent.bridges.slurm_window import offer as offer_window_limit
from agent.bridges.slurm_work import Work
from agent.core.notice import Event, EventType, utcnow
from agent.core.plugins import Part, Table
from agent.core.ports import Host, ReactorFactory
from agent.core.reports import Report
from agent.core.tasks import TaskSet
from agent.window.limits import withdraw_limits

log = structlog.get_logger("preemptd.slurm")

__all__ = ["REACTOR", "SlurmBridge", "SlurmConfig", "build_reactor"]


class SlurmBridge:
    """A reactor: ``handle(event)`` never blocks; the work runs in tasks the bridge owns."""

    name = "slurm"

    def __init__(
        self,
        config: SlurmConfig,
        *,
        commands: SlurmCommands | None = None,
        names: Callable[[], list[str]] = host_names,
        clock: Callable[[], datetime] = utcnow,
    ) -> None:
        self.config = config
        self.signal = parse_signal(config.signal)
        self.commands = commands or SlurmCommands(
            bin_dir=config.bin_dir,
            slurm_conf=config.slurm_conf,
            timeout_s=config.timeout_s,
            retries=config.retries,
        )
        self._clock = clock
        self.tasks = TaskSet("slurm")
        self.steps = SlurmSteps(config, self.commands, self.signal, names, clock)

    @property
    def node(self) -> str | None:
        """This host's Slurm node, once configured or found."""
        return self.steps.node

    @property
    def counts(self) -> Counter[tuple[str, str]]:
        return self.steps.outcomes.counts

    @property
    def degraded(self) -> str | None:
        return self.steps.outcomes.degraded

    # --- reactor --------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Check the tools and find the node in the background: start never waits on the controller."""
        self.tasks.spawn(self._probe(), "probe")

    async def stop(self, timeout: float) -> None:
        await self.tasks.close(timeout)

    def handle(self, event: Event) -> None:
        if event.type is EventType.READY:
            notice_id = str(event.data.get("notice_id") or (event.notice.id if event.notice else ""))
            work = self.steps.work.get(notice_id)
            if work is not None:
                work.ready.set()
            return
        notice = event.notice
        if notice is None:
            return
        work = self.steps.work.get(notice.id)
        if event.type is EventType.CLEARED:
            if work is not None and not work.cleared:
                work.cleared_at = self._clock()
                work.clear.set()
                work.changed.set()
                self.tasks.spawn(self.steps.on_cleared(work), f"clear:{notice.id}")
            return
        if event.type not in (EventType.NOTICE, EventType.UPDATE):
            return
        if work is not None:
            work.notice = notice  # a moved deadline moves the latest moment to act
            work.changed.set()
            return
        cfg = self.config
        if not applies(notice, cfg.kinds, cfg.min_severity, cfg.drills):
            return
        work = Work(notice)
        self.steps.work[notice.id] = work
        self._trim()
        work.run = self.tasks.spawn(self.steps.on_notice(work), f"notice:{notice.id}")

    def on_report(self, report: Report) -> None:
        """What a rank here says about its Slurm job: elastic (its MIN), and whether it shrank without us."""
        self.steps.elastic.note(report)

    def status(self) -> dict[str, Any]:
        return {
            "state": "degraded" if self.degraded else "ok",
            "degraded_reason": self.degraded,
            "node": self.node,
            "requeue": self.config.requeue,
            "signal": self.signal or None,
            "notices": {notice_id: work.to_json() for notice_id, work in self.steps.work.items()},
            "actions": self.steps.outcomes.recent.to_json(),
        }

    def carry_over(self, previous: object) -> None:
        """After a reload: keep what the previous instance drained and is waiting for (its tasks finish under
        the old settings, woken by the events this instance now receives), its counts and its node."""
        if isinstance(previous, SlurmBridge):
            self.steps.carry_over(previous.steps)

    async def drain_tasks(self) -> None:
        """Wait until everything started so far has finished (tests)."""
        await self.tasks.drain()

    # --- helpers ---------------------------------------------------------------------------------------

    async def _probe(self) -> None:
        try:
            for tool in ("sinfo", "squeue", "scontrol", "scancel"):
                self.commands.tool(tool)
            node = await self.steps.resolve()
        except SlurmError as exc:
            self.steps.outcomes.degrade(str(exc))
            return
        log.info("slurm_ready", node=node)

    def _trim(self) -> None:
        size = max(1, self.config.history_size)
        for notice_id in list(self.steps.work):
            if len(self.steps.work) <= size:
                break
            work = self.steps.work[notice_id]
            if work.cleared and (work.run is None or work.run.done()):
                del self.steps.work[notice_id]


def build_reactor(host: Host) -> SlurmBridge | None:
    """The bridge for ``[actions.slurm]``, or None when it is not enabled."""
    config = host.config.table("actions.slurm", SlurmConfig)
    if not config.enabled:
        withdraw_limits(host.hooks, "slurm")  # a reload that turns the bridge off takes its KillWait back
        return None
    bridge = SlurmBridge(config)
    register_metrics(host, "slurm", "Slurm", bridge)
    offer_window_limit(host.hooks, bridge.commands)  # KillWait, for the window (agent/window/)
    return bridge


# The entry of the reactor registry (agent/actions/registry.py).
REACTOR: Part[ReactorFactory] = Part("slurm", build_reactor, (Table("actions.slurm", SlurmConfig),))
