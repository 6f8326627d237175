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
