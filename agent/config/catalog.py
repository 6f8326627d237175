"""The catalog of the plug-in registries whose entries read configuration tables (agent/core/plugins.py): the
clouds' (``[aws]``, a plug-in cloud's), the reactors' (``[actions.slurm]``), the components' (``[ledger]``,
``[cost]``, ``[ram_tier]``). :func:`agent.config.load_config` asks each for its tables whenever a file is
loaded, so every entry point (``preemptd run``, ``report``, ``demo``, a test calling ``load_config``) checks
the same tables, whatever it imported before.

The registries are named, not imported here: they sit in layers above this one (docs/internals.md, "Layout")
and are imported when a file is loaded; ``agent.client`` never loads them.
"""

from __future__ import annotations

from typing import Any

from agent.core.plugins import Registry, load_ref

REGISTRIES: tuple[str, ...] = (
    "agent.sources.clouds:CLOUDS",
    "agent.actions.registry:REACTORS",
    "agent.service.components:COMPONENTS",
)


def registries() -> list[Registry[Any]]:
    """The registries of the catalog (imported now; once per process)."""
    found: list[Registry[Any]] = [load_ref(ref) for ref in REGISTRIES]
    return found
