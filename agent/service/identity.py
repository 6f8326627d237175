"""Who the running agent is, as ``/v1/status`` shows it under ``agent``: the version, this start (boot id,
pid, start time, uptime), the cloud and instance its sources identified and the failure domain they give
(:mod:`agent.core.domain`), where it serves and keeps its state; and which boot of the host it runs in.
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

from agent import __version__
from agent.config import Config
from agent.core.domain import Domain, domain_of


class Identity:
    def __init__(self, started_at: datetime, cloud: str | None) -> None:
        self.boot_id = secrets.token_hex(8)
        self.started_at = started_at
        self.cloud = cloud  # the configured one; the detecting source names it when it finds it
        self.instance: dict[str, Any] = {}
        self._started_mono = time.monotonic()

    def identify(self, cloud: str, instance: Mapping[str, Any]) -> None:
        """A source found which cloud and instance this host is."""
        self.cloud, self.instance = cloud, dict(instance)

    def domain(self) -> Domain | None:
        """This host's failure domain, once a source identified the instance (offered as ``domain``)."""
        return domain_of(self.cloud, self.instance)

    def to_json(self, socket: Path | None, activated: bool, config: Config) -> dict[str, Any]:
        """``socket``: the path served (None before it is bound); ``activated``: handed over by systemd."""
        return {
            "version": __version__,
            "boot_id": self.boot_id,
            "pid": os.getpid(),
            "started_at": self.started_at.isoformat(timespec="seconds").replace("+00:00", "Z"),
            "uptime_s": round(time.monotonic() - self._started_mono, 3),
            "cloud": self.cloud,
            "instance": self.instance,
            "domain": None if (domain := self.domain()) is None else domain.to_json(),
            "socket": str(socket) if socket else None,
            "socket_activated": activated,
            "state_dir": str(config.state_dir),
            "config_file": str(config.config_file) if config.config_file else None,
        }


def host_boot_id() -> str:
    """This boot of the host (the kernel's random boot id): notices without an identity of their own are
    told apart by it across agent restarts."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as handle:
            return handle.read().strip()
    except OSError:
        return ""
