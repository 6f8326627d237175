"""The agent's plug-in registries, imported in one place so that :func:`agent.config.load_config` checks every
plug-in's table when a file is loaded (agent/config/tables.py): the reactors' (the built-in actions,
agent/bridges/*, the ``preemptd.reactors`` entry points) and the clouds' (agent/sources/clouds.py, the
``preemptd.clouds`` entry points). A component with a table of its own declares it with ``register_table``
in the module that defines its schema, and agent/config/catalog.py lists that module (the loader imports it
for every entry point, not only for this one).

``preemptd run`` imports this module before it reads the configuration, and so does the daemon.
"""

from __future__ import annotations

# Imported for what they do when imported: each registry joins the loader (agent.config.add_discovery).
import agent.actions.registry
import agent.sources.clouds  # noqa: F401
