"""Old import paths of the modules that moved into ``agent/core``, ``agent/config``, ``agent/service``,
``agent/cli`` and ``agent/actions`` after 0.1.0 (one folder per layer, see docs/internals.md): importing one
still works for one release, with a :class:`DeprecationWarning` that names the new path, and gives the very
module the new path gives.

Standard library only and cheap: :mod:`agent` installs the finder, and training processes import it.
"""

from __future__ import annotations

import importlib
import sys
import warnings
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    from importlib.abc import Loader

# old path → new path; these aliases go away one release after the move.
MOVED: dict[str, str] = {
    "agent.notice": "agent.core.notice",
    "agent.board": "agent.core.board",
    "agent.fanout": "agent.core.fanout",
    "agent.hub": "agent.core.subscribers",
    "agent.sse": "agent.core.sse",
    "agent.reports": "agent.core.reports",
    "agent.status": "agent.core.status",
    "agent.health": "agent.core.source_health",
    "agent.ports": "agent.core.ports",
    "agent.tasks": "agent.core.tasks",
    "agent.threads": "agent.core.threads",
    "agent.errors": "agent.core.errors",
    "agent.durations": "agent.core.durations",
    "agent.paths": "agent.core.paths",
    "agent.config_loader": "agent.config.loader",
    "agent.actions.validate": "agent.config.validate",
    "agent.reactors": "agent.actions.registry",
    "agent.daemon": "agent.service.daemon",
    "agent.server": "agent.service.server",
    "agent.keeper": "agent.service.state_keeper",
    "agent.state": "agent.service.state_files",
    "agent.components": "agent.service.components",
    "agent.connections": "agent.service.connections",
    "agent.sdnotify": "agent.service.sdnotify",
    "agent.logs": "agent.service.logs",
    "agent.journal": "agent.service.journal",
    "agent.api": "agent.service.api",
    "agent.metrics_export": "agent.service.metrics",
    "agent.peers": "agent.service.peers",
    "agent.clientlog": "agent.service.clientlog",
    "agent.cli_help": "agent.cli.help",
    "agent.render": "agent.cli.render",
    "agent.demo": "agent.cli.demo",
    "agent.exec": "agent.cli.exec",
    "agent.exec_keeper": "agent.cli.exec_child",
}


class _Alias:
    """A loader whose module is the one already imported under the new path (no second copy)."""

    def __init__(self, new: str) -> None:
        self.new = new
        self.spec: ModuleSpec | None = None

    def create_module(self, spec: ModuleSpec) -> ModuleType:
        module = importlib.import_module(self.new)
        self.spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: the module was executed under its new name. The import system has just set the
        alias's spec on the shared module: give it back its own, so that it still names the new path."""
        module.__spec__ = self.spec


class MovedFinder:
    """A meta path finder for the old paths only (no module exists under them any more, so going first
    hides nothing; first, because an editable install's finder would otherwise look the old name up in
    its own folder)."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        new = MOVED.get(fullname)
        if new is None:
            return None
        # stacklevel 2 with the import machinery's frames skipped points at the importing line.
        warnings.warn(
            f"{fullname} moved to {new}: import {new} instead (the old path goes away in the next release)",
            DeprecationWarning,
            stacklevel=2,
        )
        # A duck-typed loader: importlib.abc would cost a training process an import of importlib.resources.
        return ModuleSpec(fullname, cast("Loader", _Alias(new)))


def install() -> None:
    """Put the finder on ``sys.meta_path`` once."""
    if not any(isinstance(finder, MovedFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, MovedFinder())
