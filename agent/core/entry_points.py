"""The installed entry points of a plug-in group (``preemptd.reactors``, ``preemptd.clouds``), read once per
state of the import path. Reading every distribution's metadata takes tens of milliseconds and the
configuration is loaded often (at start, at each reload, many times in tests), while what is installed rarely
changes; an install or a new path entry is still noticed, as the state includes each path entry's
modification time."""

from __future__ import annotations

import importlib.metadata
import os
import sys
from functools import lru_cache


def entry_points(group: str) -> tuple[importlib.metadata.EntryPoint, ...]:
    """The entry points of ``group``, sorted by name."""
    return _read(group, _path_state())


def _path_state() -> tuple[tuple[str, int], ...]:
    state: list[tuple[str, int]] = []
    for entry in sys.path:
        try:
            state.append((entry, os.stat(entry or ".").st_mtime_ns))
        except OSError:
            state.append((entry, -1))
    return tuple(state)


@lru_cache(maxsize=8)
def _read(group: str, state: tuple[tuple[str, int], ...]) -> tuple[importlib.metadata.EntryPoint, ...]:
    return tuple(sorted(importlib.metadata.entry_points(group=group), key=lambda p: p.name))
