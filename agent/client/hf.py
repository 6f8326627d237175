"""The Hugging Face Trainer's callback at the path docs/client.md and the README give; the code lives in
:mod:`agent.client.frameworks.hf`, beside the other framework adapters."""

from agent.client.frameworks.hf import (
    MANIFEST,
    PreemptdTrainerCallback,
    last_good_checkpoint,
)

__all__ = [
    "MANIFEST",
    "PreemptdTrainerCallback",
    "last_good_checkpoint",
]
