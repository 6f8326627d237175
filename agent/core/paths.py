"""Where the agent listens and keeps its state, found the same way by the agent, the CLI and clients.

Standard library only: training processes import this through ``agent.client``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

SYSTEM_SOCKET = Path("/run/preemptd/preemptd.sock")
SYSTEM_STATE_DIR = Path("/var/lib/preemptd")


def user_socket_path(env: Mapping[str, str] | None = None, uid: int | None = None) -> Path:
    """The per-user socket of an unprivileged agent: ``$XDG_RUNTIME_DIR/preemptd/preemptd.sock``, or a
    directory under /tmp named after the uid when there is no runtime directory."""
    environ = os.environ if env is None else env
    runtime = environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return Path(runtime) / "preemptd" / "preemptd.sock"
    return Path("/tmp") / f"preemptd-{os.getuid() if uid is None else uid}" / "preemptd.sock"


def default_socket_path(env: Mapping[str, str] | None = None) -> Path:
    """The agent's socket: ``PREEMPTD_SOCKET``, else the system path for root (or a systemd service with a
    runtime directory), else the per-user path."""
    environ = os.environ if env is None else env
    explicit = environ.get("PREEMPTD_SOCKET")
    if explicit:
        return Path(explicit)
    runtime_dir = environ.get("RUNTIME_DIRECTORY")  # set by systemd's RuntimeDirectory=
    if runtime_dir:
        return Path(runtime_dir.split(":")[0]) / "preemptd.sock"
    if os.geteuid() == 0:
        return SYSTEM_SOCKET
    return user_socket_path(environ)


def client_socket_path(env: Mapping[str, str] | None = None) -> Path:
    """The socket a client connects to: ``PREEMPTD_SOCKET``, else the system socket if it exists, else the
    per-user path."""
    environ = os.environ if env is None else env
    explicit = environ.get("PREEMPTD_SOCKET")
    if explicit:
        return Path(explicit)
    if SYSTEM_SOCKET.exists():
        return SYSTEM_SOCKET
    return user_socket_path(environ)


def default_state_dir(env: Mapping[str, str] | None = None) -> Path:
    """``STATE_DIRECTORY`` (systemd's StateDirectory=), else /var/lib/preemptd for root, else the user's
    ``$XDG_STATE_HOME/preemptd`` (``~/.local/state/preemptd``)."""
    environ = os.environ if env is None else env
    state_dir = environ.get("STATE_DIRECTORY")
    if state_dir:
        return Path(state_dir.split(":")[0])
    if os.geteuid() == 0:
        return SYSTEM_STATE_DIR
    base = environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "preemptd"
