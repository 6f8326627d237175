"""What a sharded checkpoint holds: a model and optimizer, and the training position, as DCP ``Stateful``
objects through torch's own ``get_state_dict`` / ``set_state_dict``, plus the DTensor layout the manifest
records. Part of :mod:`agent.client.dcp`; import from there.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor


class TrainState:
    """A model and its optimizer as one DCP ``Stateful``, through torch's ``get_state_dict`` /
    ``set_state_dict`` (sharded DTensor state under FSDP2 or tensor parallel, plain tensors otherwise).

    Put it in the dict given to :meth:`ShardedStore.save` / :meth:`ShardedStore.load` next to other
    ``Stateful`` objects (step, RNG, data position)::

        state = {"train": TrainState(model, optimizer), "progress": progress}
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        options: StateDictOptions | None = None,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.options = options

    def state_dict(self) -> dict[str, Any]:
        if self.optimizer is None:
            model_state, _ = get_state_dict(self.model, [], options=self.options)
            return {"model": model_state}
        model_state, optim_state = get_state_dict(self.model, self.optimizer, options=self.options)
        return {"model": model_state, "optimizer": optim_state}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_state_dict(
            self.model,
            [] if self.optimizer is None else self.optimizer,
            model_state_dict=state_dict["model"],
            optim_state_dict=state_dict.get("optimizer", {}),
            options=self.options,
        )


@dataclass
class Progress:
    """Training position as a DCP ``Stateful``: the step, and the generators' states (CPU RNG, and CUDA's
    when present) so that a resumed run draws the same numbers. ``extra`` carries any small values (data
    position, epoch)."""

    step: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    rng: bool = True

    def state_dict(self) -> dict[str, Any]:
        doc: dict[str, Any] = {"step": self.step, "extra": json.dumps(self.extra)}
        if self.rng:
            doc["rng_cpu"] = torch.get_rng_state()
        return doc

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"])
        self.extra = json.loads(state_dict.get("extra") or "{}")
        if self.rng and "rng_cpu" in state_dict:
            torch.set_rng_state(state_dict["rng_cpu"])


def layout(state: Mapping[str, Any]) -> dict[str, Any]:
    """The device mesh and placements of every DTensor in ``state`` (``Stateful`` values through their
    ``state_dict()``), for the manifest: what the job looked like when it saved."""
    found: dict[str, Any] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, DTensor):
            mesh = value.device_mesh
            found[prefix] = {
                "mesh": list(mesh.shape),
                "mesh_dims": list(mesh.mesh_dim_names or ()),
                "placements": [str(p) for p in value.placements],
                "shape": list(value.shape),
            }
        elif isinstance(value, Mapping):
            for key, item in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), item)
        elif hasattr(value, "state_dict") and hasattr(value, "load_state_dict"):
            walk(prefix, value.state_dict())

    walk("", state)
    return found
