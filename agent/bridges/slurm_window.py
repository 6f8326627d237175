"""The Slurm bridge's limit on the notice window (agent/window/): a job that Slurm stops (the bridge's
requeue, a cancel, the end of its time) gets SIGTERM and, ``KillWait`` seconds later, SIGKILL. Read from
``scontrol show config`` with the bridge's own tools (SLURM_CONF, timeouts, bin_dir), at most every
``READ_S``: every node's agent asks the one controller."""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence

from agent.bridges.slurm_commands import SlurmCommands
from agent.core.offers import Capabilities
from agent.window.limits import Limit, limit_registry

READ_S = 300.0
# "KillWait                = 30 sec"; a controller that says "UNLIMITED" gives no limit.
_KILL_WAIT = re.compile(r"^\s*KillWait\s*=\s*(\d+)\s*(?:sec)?", re.MULTILINE)


def parse_kill_wait(text: str) -> float | None:
    """KillWait in seconds from ``scontrol show config``'s text, or None when it is not there."""
    found = _KILL_WAIT.search(text)
    return float(found.group(1)) if found else None


class KillWait:
    """The limit source: KillWait, read again at most every ``READ_S`` (each read asks the controller; a
    failed read is not kept, so the next round asks again)."""

    def __init__(self, commands: SlurmCommands, clock: Callable[[], float] = time.monotonic) -> None:
        self.commands = commands
        self._clock = clock
        self._read: tuple[float, list[Limit]] | None = None

    async def __call__(self) -> Sequence[Limit]:
        if self._read is not None and self._clock() - self._read[0] < READ_S:
            return self._read[1]
        result = await self.commands.run("scontrol", "show", "config", retry=False)
        seconds = parse_kill_wait(result.stdout)
        if seconds is None:
            found = [
                Limit("slurm_kill_wait", None, "scontrol show config", detail="no KillWait in its output")
            ]
        else:
            found = [
                Limit(
                    "slurm_kill_wait",
                    seconds,
                    "Slurm KillWait (scontrol show config): SIGKILL this long after a stopped job's SIGTERM",
                    lengthen="raise KillWait in slurm.conf (scontrol reconfigure); the bridge requeues only after "
                    "the notice's ready or at the deadline minus actions.slurm.margin_s",
                )
            ]
        self._read = (self._clock(), found)
        return found


def offer(hooks: Capabilities, commands: SlurmCommands) -> None:
    """Offer KillWait to the window (``hooks``: the host's, with ``capability`` and ``provide``)."""
    limit_registry(hooks).add("slurm", KillWait(commands))
