"""Shared fixtures: short temporary directories for Unix sockets, cleaned up after each test."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import short_tmp


@pytest.fixture
def base() -> Iterator[Path]:
    """A short /tmp directory for an agent's socket and state (Unix socket paths are limited to 108 bytes)."""
    path = short_tmp()
    yield path
    shutil.rmtree(path, ignore_errors=True)
