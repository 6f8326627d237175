"""SIGHUP, the reading half: the configuration file read again, off the loop and bounded, with a warning for
what only a restart changes. The agent (agent/service/daemon.py) hands what was read to its parts.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from agent.config import Config
from agent.core.errors import ConfigError
from agent.core.threads import call_bounded
from agent.service.sdnotify import Notifier

RELOAD_READ_S = 10.0  # the longest wait for the configuration file on SIGHUP
# Settings the bound socket and the open state directory were made with: a reload cannot change them.
RESTART_ONLY = ("socket", "state_dir", "socket_group", "socket_mode")


async def read_config(
    read: Callable[[], Config] | None, running: Config, notifier: Notifier, log: Any
) -> Config | None:
    """The configuration to run from now on, its logging already applied; None when there is none to read
    again or it is bad (logged; systemd is told the agent is ready again, with the running one kept)."""
    if read is None:
        log.info("reload_ignored", why="the agent was not started from a configuration file")
        return None
    notifier.notify(reloading=1, monotonic_usec=int(time.monotonic() * 1_000_000))
    try:
        # Off the loop and bounded: a file on a hung mount must not stop it (FIFOs are refused unread).
        new = await call_bounded(read, RELOAD_READ_S, "reading the configuration")
    except (ConfigError, TimeoutError) as exc:
        log.error("reload_failed", error=str(exc), effect="keeping the running configuration")
        notifier.notify(ready=1)
        return None
    from agent.service.logs import configure_logging

    restart_needed = [k for k in RESTART_ONLY if getattr(new, k) != getattr(running, k)]
    configure_logging(new.log_format, new.log_level)
    if restart_needed:
        log.warning("reload_partial", keys=restart_needed, effect="these take effect at the next restart")
    return new
