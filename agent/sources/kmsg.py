"""Follow the kernel log (``/dev/kmsg``, or a plain file or FIFO in tests) on a daemon thread and hand each
``NVRM: Xid`` line to a callback: not every fatal XID reaches NVML's event API.

Only lines written after the follower starts count (a seekable log is read from its end), so an XID from
earlier in this boot is not replayed as a new fault; the GPU's polled state covers what it left behind.
"""

from __future__ import annotations

import errno
import os
import select
import stat
import threading
from collections.abc import Callable
from pathlib import Path

from agent.sources.gpu_xid import KmsgXid, parse_kmsg_xid

READ_SIZE = 8192  # /dev/kmsg fails a read with EINVAL if the buffer is smaller than one record
POLL_S = 0.25
DOCS = "docs/kubernetes.md"

# The probable cause of each way opening the kernel log fails, and what to do (docs/kubernetes.md).
CAUSES = {
    errno.EPERM: (
        "the container's device cgroup does not allow /dev/kmsg (or kernel.dmesg_restrict=1 and no "
        f"CAP_SYSLOG): run privileged or mount it as a device; see {DOCS}"
    ),
    errno.EACCES: (
        "the agent's user may not read it (/dev/kmsg is root's, mode 0644 or stricter): run the agent as "
        f"root or give its user read access; see {DOCS}"
    ),
    errno.ENOENT: (
        "it does not exist here: in a container, mount the node's /dev/kmsg (a hostPath of type "
        f"CharDevice); see {DOCS}"
    ),
}


def open_failure(path: Path, exc: OSError) -> tuple[str, str]:
    """What an ``OSError`` from opening the kernel log says (``why``: the path, errno name and number, the
    system's text) and its probable cause with the fix (``cause``)."""
    code = exc.errno
    name = errno.errorcode.get(code, "?") if code is not None else "?"
    why = f"cannot open {path}: {name} (errno {code}): {exc.strerror or exc}"
    cause = CAUSES.get(code or 0, f"the kernel log cannot be opened; see {DOCS}")
    return why, cause


class KmsgFollower:
    """Reads ``path`` until :meth:`stop`; ``on_xid`` and ``on_state`` are called on the follower thread.
    ``on_state(state, why, cause)``: ``watching``; ``unavailable`` (it cannot be opened: why, and the probable
    cause with the fix); ``failed`` (reading it failed)."""

    def __init__(
        self,
        path: Path,
        on_xid: Callable[[KmsgXid], None],
        on_state: Callable[[str, str | None, str | None], None],
    ) -> None:
        self.path = path
        self._on_xid = on_xid
        self._on_state = on_state
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="preemptd-kmsg", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def join(self, timeout: float) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
        except OSError as exc:
            self._on_state("unavailable", *open_failure(self.path, exc))
            return
        try:
            mode = os.fstat(fd).st_mode
            if stat.S_ISCHR(mode) or stat.S_ISREG(mode):
                os.lseek(fd, 0, os.SEEK_END)
            self._on_state("watching", None, None)
            self._follow(fd)
        except OSError as exc:
            self._on_state("failed", f"reading {self.path}: {exc.strerror or exc}", None)
        finally:
            os.close(fd)

    def _follow(self, fd: int) -> None:
        pending = b""
        while not self._stop.is_set():
            readable, _, _ = select.select([fd], [], [], POLL_S)
            if not readable:
                continue
            try:
                chunk = os.read(fd, READ_SIZE)
            except BlockingIOError:
                continue
            except OSError as exc:
                if exc.errno == errno.EPIPE:  # /dev/kmsg: records were overwritten before we read them
                    continue
                raise
            if not chunk:
                # End of a plain file, or a FIFO whose writer left: wait for more without spinning.
                self._stop.wait(POLL_S)
                continue
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for raw in lines:
                found = parse_kmsg_xid(raw.decode("utf-8", "replace"))
                if found is not None:
                    self._on_xid(found)
