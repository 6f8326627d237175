"""Who the drain child runs as: the job's user and group, with no capability at all.

The agent may start the drain as root (outside the packaged unit) or as its own user holding ``CAP_SETUID``,
``CAP_SETGID``, ``CAP_CHOWN``, ``CAP_DAC_OVERRIDE``, ``CAP_KILL`` and ``CAP_SYSLOG`` as ambient capabilities
(the packaged unit: docs/ram-tier.md, "Under the packaged systemd unit"). Capabilities survive a switch from
one non-root user to another, so :func:`become` switches the ids when they differ and then clears every set
(bounding where it may, ambient, inheritable, permitted, effective) and sets ``no_new_privs``: the drain can
write only where the job's own user may. When the switch is not allowed it stops with an error that names the
missing capability, never drains as the agent's user. Plain ctypes calls, no callbacks: they work under
``MemoryDenyWriteExecute=yes``.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

DOC = 'docs/ram-tier.md, "Under the packaged systemd unit"'
CAP_SETGID = 6
CAP_SETUID = 7
CAP_SETPCAP = 8
_PR_CAPBSET_DROP = 24
_PR_SET_NO_NEW_PRIVS = 38
_PR_CAP_AMBIENT = 47
_PR_CAP_AMBIENT_CLEAR_ALL = 4
_CAPABILITY_VERSION_3 = 0x20080522
DRAIN_UMASK = 0o022
SETS = ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb")


class IdentityError(PermissionError):
    """The drain cannot take the job's user or shed its capabilities; the message says what to grant."""


class ReadOnlyRootError(OSError):
    """The durable root is on a read-only mount; the message names the drop-in line that makes it writable."""


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    ]


def capabilities() -> dict[str, int]:
    """This process's capability sets as the kernel shows them (``CapEff``: bit N is capability N)."""
    sets: dict[str, int] = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in SETS:
            sets[key] = int(value.strip(), 16)
    return sets


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _prctl(libc: ctypes.CDLL, option: int, arg: int = 0) -> int:
    result = libc.prctl(
        ctypes.c_int(option), ctypes.c_ulong(arg), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0)
    )
    return int(result)


def _drop_bounding(libc: ctypes.CDLL) -> None:
    """Empty the bounding set when this process may (``CAP_SETPCAP``: root outside the unit); the unit's own
    bounding set stays otherwise, and no_new_privs with empty sets makes it unreachable."""
    if capabilities().get("CapEff", 0) >> CAP_SETPCAP & 1:
        last = int(Path("/proc/sys/kernel/cap_last_cap").read_text())
        for cap in range(last + 1):
            _prctl(libc, _PR_CAPBSET_DROP, cap)


def drop_capabilities(libc: ctypes.CDLL | None = None) -> None:
    """Clear the ambient, inheritable, permitted and effective sets and set ``no_new_privs``; check it."""
    libc = libc or _libc()
    if _prctl(libc, _PR_SET_NO_NEW_PRIVS, 1) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS) failed")
    if _prctl(libc, _PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_CAP_AMBIENT_CLEAR_ALL) failed")
    header = _CapHeader(_CAPABILITY_VERSION_3, 0)
    data = (_CapData * 2)()
    if libc.capset(ctypes.byref(header), data) != 0:
        raise IdentityError(
            f"capset() to drop the drain's capabilities failed ({os.strerror(ctypes.get_errno())}): a system "
            f"call filter must let capset through ({DOC})"
        )
    left = {key: hex(value) for key, value in capabilities().items() if key != "CapBnd" and value}
    if left:
        raise IdentityError(f"the drain still holds capabilities after dropping them: {left} ({DOC})")


def become(uid: int, gid: int) -> None:
    """Take the job's uid and gid (when they are not already this process's) and drop every capability.

    Call it after the imports (the interpreter's files may be readable by the agent's user alone) and before
    any thread starts: capabilities are per thread, and a new thread takes its creator's."""
    libc = _libc()
    _drop_bounding(libc)  # before the switch: a root process loses CAP_SETPCAP with it
    if os.getresuid() != (uid, uid, uid) or os.getresgid() != (gid, gid, gid):
        try:
            os.setgroups([])
            os.setresgid(gid, gid, gid)
            os.setresuid(uid, uid, uid)
        except PermissionError as exc:
            raise IdentityError(_refused(uid, gid, exc)) from None
    drop_capabilities(libc)
    # What the job's own saves get with the usual umask: readable checkpoint files, whatever the agent's
    # (the packaged unit's UMask=0077 is for the agent's state, not for the jobs' checkpoints).
    os.umask(DRAIN_UMASK)


def _refused(uid: int, gid: int, exc: OSError) -> str:
    effective = capabilities().get("CapEff", 0)
    missing = [
        name
        for bit, name in ((CAP_SETUID, "CAP_SETUID"), (CAP_SETGID, "CAP_SETGID"))
        if not effective >> bit & 1
    ]
    want = f"the drain must run as the job's user (uid {uid}, gid {gid}), and the agent runs as uid {os.geteuid()}"
    if missing:
        return (
            f"{want} without {' and '.join(missing)}: give the agent {' and '.join(missing)} (its unit's "
            f"AmbientCapabilities= and CapabilityBoundingSet=) or run it as root; nothing was drained, the step "
            f"stays in RAM ({DOC})"
        )
    return (
        f"{want}, and switching was refused ({exc.strerror}) although it holds CAP_SETUID and CAP_SETGID: a "
        f"system call filter must let @setuid through (its unit's SystemCallFilter=); nothing was drained, the "
        f"step stays in RAM ({DOC})"
    )


def check_writable(root: Path) -> None:
    """Stop with the fix when the durable root lies on a read-only mount, as it does under the packaged unit
    (``ProtectSystem=strict``, ``ProtectHome=read-only``) until a drop-in names it."""
    probe = root
    while True:
        try:
            os.stat(probe)
            break
        except (FileNotFoundError, NotADirectoryError):
            if probe.parent == probe:
                return
            probe = probe.parent
        except OSError:
            return  # the drain's own open says why
    if os.statvfs(probe).f_flag & os.ST_RDONLY:
        raise ReadOnlyRootError(
            f"the durable root {root} is on a read-only file system for the agent ({probe} is mounted "
            "read-only; under the packaged systemd unit everything but its own directories is, "
            f"ProtectSystem=strict): add a drop-in, `systemctl edit preemptd`, with `[Service]` and "
            f"`ReadWritePaths={probe}`, then `systemctl restart preemptd`; nothing was drained, the step stays "
            f"in RAM ({DOC})"
        )
