"""The agent's plug-in registries (the clouds', the reactors', the components': agent/config/catalog.py),
frozen when the agent starts: what it runs, and what a reload checks a file against, is what it found at
start; a late ``register()`` is refused with an error that says so."""

from __future__ import annotations

from agent.config.catalog import registries


def freeze() -> None:
    """Find every registry's entries once more and freeze them."""
    for registry in registries():
        registry.freeze()
