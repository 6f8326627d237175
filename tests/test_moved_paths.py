"""The modules' old import paths (before the move into agent/core, config, service and cli) still work for
one release, with a DeprecationWarning that names the new path."""

from __future__ import annotations

import importlib
import sys
import warnings
from collections.abc import Iterator

import pytest

from agent import _moved
from tests.support import REPO


@pytest.fixture
def forget_old_paths() -> Iterator[None]:
    """Leaves sys.modules and the parent packages as they were: no alias outlives the test that made it."""
    before = {old: sys.modules[old] for old in _moved.MOVED if old in sys.modules}
    yield
    for old, new in _moved.MOVED.items():
        parent, _, name = old.rpartition(".")
        if old in before:
            sys.modules[old] = before[old]
        elif (
            sys.modules.pop(old, None) is not None
            and getattr(sys.modules[parent], name, None) is sys.modules[new]
        ):
            delattr(sys.modules[parent], name)


@pytest.mark.parametrize(("old", "new"), sorted(_moved.MOVED.items()))
@pytest.mark.usefixtures("forget_old_paths")
def test_an_old_import_path_warns_and_gives_the_moved_module(old: str, new: str) -> None:
    """Importing a module by its old path warns, naming the new path, and gives the same module object."""
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=f"^{old} moved to {new}:"):
        module = importlib.import_module(old)
    assert importlib.import_module(new) is module
    assert (new, new) == (module.__name__, module.__spec__.name)


def test_no_old_path_exists_as_a_file() -> None:
    """Every old path is only an alias: no module file is left under it to hide the new one."""
    left = [old for old in _moved.MOVED if (REPO / (old.replace(".", "/") + ".py")).exists()]
    assert [] == left


def test_new_paths_import_without_a_warning() -> None:
    """The new paths themselves never warn (the test suite turns warnings into errors)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for new in _moved.MOVED.values():
            importlib.import_module(new)
