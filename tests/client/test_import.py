"""The training-side client is cheap to import: standard library only."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.support import REPO

HEAVY = (
    "aiohttp",
    "pynvml",
    "structlog",
    "torch",
    "prometheus_client",
    "psutil",
    "lightning",
    "transformers",
)


def test_importing_agent_client_pulls_in_no_heavy_dependency() -> None:
    code = (
        "import json, sys; import agent.client, agent.client.aio; "
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True, timeout=30
    ).stdout
    loaded = set(json.loads(out))
    assert [] == sorted(loaded & set(HEAVY))


def loaded_after(statement: str) -> set[str]:
    """The agent.client modules a fresh interpreter holds after running ``statement``."""
    code = f"import json, sys; {statement}; print(json.dumps(sorted(m for m in sys.modules if m.startswith('agent'))))"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True, timeout=30
    ).stdout
    return set(json.loads(out))


def test_exec_channel_and_transport_import_neither_the_store_nor_the_watcher() -> None:
    """What ``preemptd exec`` and the client verbs import leaves the store, reporter and watcher unloaded."""
    loaded = loaded_after("import agent.client.preempted, agent.client.transport")
    assert set() == loaded & {"agent.client.store", "agent.client.watcher", "agent.client.reporting"}


def test_every_public_name_of_the_client_package_imports() -> None:
    """``from agent.client import X`` works for every name in ``__all__``, each loaded on first use."""
    import agent.client

    for name in agent.client.__all__:
        assert getattr(agent.client, name) is not None, name
    loaded = loaded_after("from agent.client import Watcher")
    assert "agent.client.watcher" in loaded
    assert "agent.client.store" not in loaded
