"""Files the command line writes for a person (a report page, a plot): replaced in one piece, never through a
symbolic link. Standard library only."""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
from pathlib import Path


def replace_file(path: Path, data: bytes) -> None:
    """Write ``data`` to a new file in ``path``'s directory and rename it over ``path``: a reader sees the old
    file or the new one, and a symbolic link at ``path`` is itself replaced, its target left alone (a link
    planted in a shared directory must not make us overwrite another file). The temporary file is gone
    whether this succeeds or raises (OSError)."""
    temporary, fd = _create_beside(path)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise


def _create_beside(path: Path) -> tuple[Path, int]:
    """A new file next to ``path``, open for writing. Its mode is the one a plain ``open(path, "w")`` would
    give (0666 less the umask), which mkstemp's 0600 would not."""
    if not path.name:  # "." or "/": a directory
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
    for _ in range(100):
        # Cut short: a name of 255 bytes and the suffix would exceed NAME_MAX.
        temporary = path.with_name(f".{path.name[:48]}.{secrets.token_hex(4)}.tmp")
        try:
            # O_EXCL: never an existing file, and never through a link planted under the temporary name.
            fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
        except FileExistsError:
            continue
        return temporary, fd
    raise FileExistsError(f"no free temporary name next to {path}")
