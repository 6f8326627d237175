"""The Slurm bridge's limit on the notice window (agent/core/window.py): a job that Slurm stops (the bridge's
requeue, a cancel, the end of its time) gets SIGTERM and, ``KillWait`` seconds later, SIGKILL. Read from
``scontrol show config`` with the bridge's own tools (SLURM_CONF, timeouts, bin_dir)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from agent.bridges.slurm_commands import SlurmCommands
from agent.core.window import Limit, limit_registry

# "KillWait                = 30 sec"; a controller that says "UNLIMITED" gives no limit.
_KILL_WAIT = re.compile(r"^\s*KillWait\s*=\s*(\d+)\s*(?:sec)?", re.MULTILINE)


def parse_kill_wait(text: str) -> float | None:
    """KillWait in seconds from ``scontrol show config``'s text, or None when it is not there."""
    found = _KILL_WAIT.search(text)
    return float(found.group(1)) if found else None


async def kill_wait_limits(commands: SlurmCommands) -> Sequence[Limit]:
    result = await commands.run("scontrol", "show", "config", retry=False)
    seconds = parse_kill_wait(result.stdout)
    if seconds is None:
        return [Limit("slurm_kill_wait", None, "scontrol show config", detail="no KillWait in its output")]
    return [
        Limit(
            "slurm_kill_wait",
            seconds,
            "Slurm KillWait (scontrol show config): SIGKILL this long after a stopped job's SIGTERM",
            lengthen="raise KillWait in slurm.conf (scontrol reconfigure); the bridge requeues only after the "
            "notice's ready or at the deadline minus actions.slurm.margin_s",
        )
    ]


def offer(host: Any, commands: SlurmCommands) -> None:
    """Offer KillWait to the window (``host``: its ``capability`` and ``provide``)."""
    limit_registry(host).add("slurm", lambda: kill_wait_limits(commands))
