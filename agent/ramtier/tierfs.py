"""The RAM tier's directory, opened the safe way: every directory and file is reached from the tier's root
descriptor one name at a time with ``O_NOFOLLOW``, checked with ``fstat`` (kind, owner, mode) and then used
through that descriptor. A job's user owns its job directory and may swap anything under it for a link, a FIFO
or another user's file between two calls; the agent, which may read any file, must never act on what a path
names *now* after checking what it named *before* (docs/security.md). Blocking: run it in a worker thread.

Layout: ``<root>/<uid>/<job>/<step>/<file>``; the root and each uid directory are the agent's (0711), a job
directory and what is under it belong to the job's uid (0700).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path

from agent.ramtier.errors import TierError

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: opening a FIFO for reading never waits for a writer (the fstat then refuses it).
_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
UID_DIR_MODE = 0o711
JOB_DIR_MODE = 0o700
_READ_BLOCK = 4 * 1024 * 1024


def kind_of(mode: int) -> str:
    for test, name in (
        (stat.S_ISREG, "a regular file"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def open_dir(parent: int, name: str, where: str, owner: int | None = None) -> int:
    """``name`` under the directory ``parent`` as a directory descriptor, never through a link; with ``owner``,
    refused unless that uid owns it."""
    try:
        fd = os.open(name, _DIR, dir_fd=parent)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise TierError(409, f"{where} is not a directory (a link or a file)") from None
        raise
    if owner is not None:
        st = os.fstat(fd)
        if st.st_uid != owner:
            os.close(fd)
            raise TierError(409, f"{where} belongs to uid {st.st_uid}, not to uid {owner}")
    return fd


@contextlib.contextmanager
def opened_dir(parent: int, name: str, where: str, owner: int | None = None) -> Iterator[int]:
    fd = open_dir(parent, name, where, owner)
    try:
        yield fd
    finally:
        os.close(fd)


def open_file(directory: int, name: str, where: str, owner: int) -> tuple[int, os.stat_result]:
    """``name`` in ``directory`` opened for reading and checked: a regular file of ``owner`` (a link, a FIFO,
    a device or another user's file, a hard link to it included, is refused); its descriptor and its stat."""
    try:
        fd = os.open(name, _FILE, dir_fd=directory)
    except FileNotFoundError:
        raise TierError(409, f"{where}: {name} is not in the directory") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise TierError(409, f"{where}: {name} is a symbolic link, not a regular file") from None
        if exc.errno == errno.ENXIO:  # a socket
            raise TierError(409, f"{where}: {name} is not a regular file") from None
        raise
    st = os.fstat(fd)
    problem = None
    if not stat.S_ISREG(st.st_mode):
        problem = f"{name} is {kind_of(st.st_mode)}, not a regular file"
    elif st.st_uid != owner:
        problem = f"{name} belongs to uid {st.st_uid}, not to the job's uid {owner}"
    if problem is not None:
        os.close(fd)
        raise TierError(409, f"{where}: {problem}")
    return fd, st


def read_all(fd: int, limit: int) -> bytes:
    """At most ``limit`` bytes of an open file, from its start."""
    chunks = []
    offset = 0
    while offset < limit:
        chunk = os.pread(fd, min(_READ_BLOCK, limit - offset), offset)
        if not chunk:
            break
        chunks.append(chunk)
        offset += len(chunk)
    return b"".join(chunks)


def entries(directory: int) -> list[tuple[str, bool]]:
    """The names in an open directory, each with whether it is a directory (links are not), sorted. Read
    through a descriptor of its own: one that other threads share would share its read position too."""
    own = os.open(".", _DIR, dir_fd=directory)
    try:
        with os.scandir(own) as found:
            return sorted((e.name, e.is_dir(follow_symlinks=False)) for e in found)
    finally:
        os.close(own)


def tree_bytes(directory: int) -> int:
    """What the regular files under the open ``directory`` hold, walked through descriptors (links are not
    followed): the RAM it takes."""
    total = 0
    for name, is_dir in entries(directory):
        with contextlib.suppress(FileNotFoundError, TierError):
            if is_dir:
                with opened_dir(directory, name, name) as inner:
                    total += tree_bytes(inner)
            else:
                st = os.stat(name, dir_fd=directory, follow_symlinks=False)
                total += st.st_size if stat.S_ISREG(st.st_mode) else 0
    return total


def make_dir(parent: int, name: str, mode: int, uid: int, gid: int) -> bool:
    """Create ``name`` under ``parent`` with ``mode`` and give it to ``uid``:``gid``; False when it exists."""
    try:
        os.mkdir(name, mode, dir_fd=parent)
    except FileExistsError:
        return False
    fd = open_dir(parent, name, name)  # swapped for a link since the mkdir (its parent is the job's): refused
    try:
        os.fchmod(fd, mode)  # the umask may have taken bits
        st = os.fstat(fd)
        if (st.st_uid, st.st_gid) != (uid, gid):
            os.fchown(fd, uid, gid)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.rmdir(name, dir_fd=parent)
        raise
    os.close(fd)
    return True


def remove(path: Path) -> None:
    """Remove a job's or a step's directory tree. ``shutil.rmtree`` walks through descriptors and refuses a
    top that is (or became) a link, so nothing outside the tree is touched (``avoids_symlink_attacks``)."""
    shutil.rmtree(path, ignore_errors=True)
