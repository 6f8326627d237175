"""The command line's tests' shared parts."""

from __future__ import annotations

from pathlib import Path


def alive(pid: int) -> bool:
    """The process exists and has not exited (a zombie has)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2] != "Z"
