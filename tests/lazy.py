"""Names from torch (and modules that import it) resolved when a test first uses them, not when pytest collects
the module: every parallel worker collects every module, and importing torch costs each one seconds. In the fast
lane, the tests of a module that holds a ``Lazy`` run on one worker (tests/conftest.py), which imports torch
once. Without torch installed, the first use skips the test, as ``importorskip`` would at import."""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

import pytest

# For tests that run torch in child processes only: whether it is installed, without importing it here.
HAS_TORCH = importlib.util.find_spec("torch") is not None
needs_torch = pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed (pip install -e '.[torch]')")


class Lazy:
    """``module`` (or its attribute ``name``), imported on first use: a call, an attribute, an item."""

    def __init__(self, module: str, name: str | None = None) -> None:
        self._module, self._name = module, name
        self._target: Any = None

    def resolve(self) -> Any:
        if self._target is None:
            pytest.importorskip("torch")
            module = importlib.import_module(self._module)
            self._target = module if self._name is None else getattr(module, self._name)
        return self._target

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("_"):  # copy, pickle and pytest's own probes: not the target's
            raise AttributeError(attr)
        return getattr(self.resolve(), attr)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.resolve()(*args, **kwargs)

    def __repr__(self) -> str:
        return f"Lazy({self._module!r}, {self._name!r})"
