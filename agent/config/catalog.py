"""The catalog of the tables that built-in components declare (``[ledger]``, ``[cost]``, ``[ram_tier]``): the
modules that call :func:`agent.config.tables.register_table` for them, which the loader imports before it
checks a file. So every entry point (``preemptd run``, ``report``, ``demo``, a test calling ``load_config``)
knows the same tables, whatever it happened to import before.

The modules are named, not imported here: they sit in a layer above this one (docs/internals.md, "Layout"),
and are imported only when a file is loaded, as the plug-in registries import theirs; ``agent.client`` never
loads them. Tables found by a registry are not listed: the bridges' ``[actions.*]`` and the clouds' come with
the reactor and cloud registries (agent/service/plugins.py), which also find third-party plug-ins. A new
component with a table of its own adds its schema's module here (tests/test_config_tables.py checks that
``preemptd run`` knows no top-level table this catalog does not).
"""

from __future__ import annotations

import importlib

MODULES: tuple[str, ...] = (
    "agent.ledger.config",  # [ledger], [cost]
    "agent.ramtier.config",  # [ram_tier]
)


def declare_builtin_tables() -> None:
    """Import every module of the catalog (each declares its tables as it is imported; once per process)."""
    for name in MODULES:
        importlib.import_module(name)
