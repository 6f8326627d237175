"""systemd integration without libsystemd: ``sd_notify`` datagrams (``NOTIFY_SOCKET``, abstract ``@``
addresses included), the watchdog interval, and sockets passed by socket activation (``LISTEN_FDS``)."""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping, MutableMapping

SD_LISTEN_FDS_START = 3


class Notifier:
    """Sends state changes to the service manager; a no-op when not started by systemd."""

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        environ = os.environ if env is None else env
        address = environ.get("NOTIFY_SOCKET") or ""
        if address.startswith("@"):
            address = "\0" + address[1:]
        self.address = address or None
        self._sock: socket.socket | None = None
        usec = environ.get("WATCHDOG_USEC")
        pid = environ.get("WATCHDOG_PID")
        self.watchdog_s: float | None = None
        if usec and usec.isdigit() and int(usec) > 0 and (not pid or pid == str(os.getpid())):
            self.watchdog_s = int(usec) / 1_000_000

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def notify(self, **fields: str | int) -> bool:
        """Send ``KEY=value`` lines (``ready=1`` becomes ``READY=1``); True if a datagram was sent."""
        if self.address is None:
            return False
        message = "\n".join(f"{key.upper()}={value}" for key, value in fields.items()).encode()
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.sendto(message, self.address)
        except OSError:
            return False
        return True

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def listen_fds(env: MutableMapping[str, str] | None = None, unset: bool = True) -> list[socket.socket]:
    """Sockets passed by systemd socket activation, as ``socket`` objects (fds 3 …)."""
    environ = os.environ if env is None else env
    pid = environ.get("LISTEN_PID")
    count = environ.get("LISTEN_FDS")
    if unset:
        for name in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
            environ.pop(name, None)
    if not pid or not count or pid != str(os.getpid()) or not count.isdigit():
        return []
    sockets = []
    for fd in range(SD_LISTEN_FDS_START, SD_LISTEN_FDS_START + int(count)):
        os.set_inheritable(fd, False)
        sockets.append(socket.socket(fileno=fd))
    return sockets
