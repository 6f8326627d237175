"""Who is on the other end of the API socket: the peer's credentials from the kernel (``SO_PEERCRED``) and
whether they may use the administrative endpoints. A client cannot choose what these say.

In the core so that a component's own routes (the RAM tier's per-job directories) can ask it too; the
``request`` is an aiohttp request, typed loosely so the core does not import aiohttp."""

from __future__ import annotations

import grp
import os
import socket
import struct
from typing import Any


def peer_credentials(request: Any) -> tuple[int, int, int] | None:
    """(pid, uid, gid) of the connected process, from SO_PEERCRED."""
    transport = request.transport
    sock = transport.get_extra_info("socket") if transport is not None else None
    if sock is None or sock.family != socket.AF_UNIX:
        return None
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return pid, uid, gid


def peer_doc(request: Any) -> dict[str, Any]:
    return creds_doc(peer_credentials(request))


def creds_doc(creds: tuple[int, int, int] | None) -> dict[str, Any]:
    """The peer as logs and notices show it, from credentials already read."""
    if creds is None:
        return {}
    return {"pid": creds[0], "uid": creds[1], "gid": creds[2]}


def _process_groups(pid: int) -> set[int]:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as handle:
            for line in handle:
                if line.startswith("Groups:"):
                    return {int(g) for g in line.split()[1:]}
    except OSError:
        pass
    return set()


def is_admin(creds: tuple[int, int, int] | None, admin_group: str | None) -> tuple[bool, str]:
    """Root, the agent's own user, or a member of the admin group may use mutating endpoints."""
    if creds is None:
        return False, "peer credentials unavailable"
    pid, uid, gid = creds
    if uid == 0 or uid == os.geteuid():
        return True, "owner"
    if admin_group:
        try:
            admin_gid = grp.getgrnam(admin_group).gr_gid
        except KeyError:
            return False, f"admin group {admin_group!r} does not exist"
        if gid == admin_gid or admin_gid in _process_groups(pid):
            return True, f"member of {admin_group}"
        return False, f"uid {uid} is not root and not in the admin group {admin_group!r}"
    return False, f"uid {uid} is not root and no admin_group is configured"
