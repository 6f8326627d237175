"""The PyTorch helpers (state-dict writers, the ranks' agreement) at the path docs/client.md and the README
give; the code lives in :mod:`agent.client.frameworks.torch`, beside the other framework adapters."""

from agent.client.frameworks.torch import (
    NOTHING,
    SAFETENSORS_FILE,
    STATE_FILE,
    Coordinator,
    Decision,
    agree_latest,
    agree_load,
    load_agreed,
    load_safetensors,
    load_torch,
    rank_and_world,
    safetensors_writer,
    torch_writer,
)

__all__ = [
    "NOTHING",
    "SAFETENSORS_FILE",
    "STATE_FILE",
    "Coordinator",
    "Decision",
    "agree_latest",
    "agree_load",
    "load_agreed",
    "load_safetensors",
    "load_torch",
    "rank_and_world",
    "safetensors_writer",
    "torch_writer",
]
