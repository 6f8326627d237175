"""The capabilities the agent hands on to the programs it starts.

Under the packaged unit the agent runs as its own user with ambient capabilities (systemd/preemptd.service):
``CAP_KILL`` and ``CAP_SYSLOG`` for the signal actions and the kernel log, and, for the RAM tier,
``CAP_CHOWN``, ``CAP_DAC_OVERRIDE``, ``CAP_SETUID`` and ``CAP_SETGID``. Ambient capabilities pass to every
program it executes; the RAM tier's four together amount to root, and no hook needs them. :func:`shed_argv`
is the prefix that starts a program without them: util-linux's ``setpriv`` lowering them from the ambient and
inheritable sets (it needs no privilege to lower). A root agent, or one that holds none of them, needs no
prefix.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

# The RAM tier's capabilities (linux/capability.h), by setpriv's names.
TIER = {"chown": 0, "dac_override": 1, "setgid": 6, "setuid": 7}


def ambient(status: Path = Path("/proc/self/status")) -> int:
    """This process's ambient set (bit N: capability N); 0 when the kernel does not say."""
    try:
        for line in status.read_text().splitlines():
            if line.startswith("CapAmb:"):
                return int(line.split()[1], 16)
    except (OSError, ValueError, IndexError):
        pass
    return 0


def shed_argv(held: int | None = None) -> list[str]:
    """The prefix that runs a program without the RAM tier's ambient capabilities (empty when there are none
    to shed); ``held``: the ambient set, read from this process when None. OSError when they are held and
    ``setpriv`` is not installed: a program must not start with them."""
    if os.geteuid() == 0:
        return []  # root's programs are root's: nothing ambient makes them more
    held = ambient() if held is None else held
    names = [name for name, bit in TIER.items() if held >> bit & 1]
    if not names:
        return []
    setpriv = shutil.which("setpriv", path="/usr/bin:/bin:/usr/sbin:/sbin")
    if setpriv is None:
        raise OSError(
            f"the agent holds {', '.join('CAP_' + n.upper() for n in names)} and cannot start a program without "
            "them: install util-linux's setpriv"
        )
    lowered = ",".join("-" + name for name in names)
    return [setpriv, f"--inh-caps={lowered}", f"--ambient-caps={lowered}", "--"]
