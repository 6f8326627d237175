"""PyTorch Lightning's callback at the path docs/client.md and the README give; the code lives in
:mod:`agent.client.frameworks.lightning`, beside the other framework adapters."""

from agent.client.frameworks.lightning import (
    CHECKPOINT_FILE,
    PreemptdCallback,
    writes_on_every_rank,
)

__all__ = [
    "CHECKPOINT_FILE",
    "PreemptdCallback",
    "writes_on_every_rank",
]
