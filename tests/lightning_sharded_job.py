"""A Lightning job whose strategy writes a sharded checkpoint on every rank, on CPU/gloo with PreemptdCallback,
for tests/client/test_lightning_callback.py: Lightning starts the other rank by running this file again. Prints JSON
lines (``start`` with the global step, ``stopped``); exits 75 after an emergency save.

``model_parallel``: ModelParallelStrategy, FSDP2 inside ``configure_model``. ``fsdp``: FSDPStrategy (FSDP1)
with ``state_dict_type="sharded"``. Lightning refuses FSDPStrategy itself unless the accelerator is CUDA; its
check compares the strategy's exact type, so a subclass that changes nothing runs it on CPU, where FSDP1 and
Lightning's FSDP code handle a CPU device (``device_id=None``, gloo).

    python tests/lightning_sharded_job.py CHECKPOINT_DIR SOCKET MAX_STEPS DEVICES [model_parallel|fsdp]
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy, Strategy
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset

from agent.client import EXIT_PREEMPTED
from agent.client.lightning import PreemptdCallback


class Sharded(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

    def configure_model(self) -> None:
        mesh = self.device_mesh["data_parallel"]
        for layer in (self.net[0], self.net[2]):
            fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        time.sleep(0.02)  # slow enough for a drill to land mid-training
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0.01)


class Wrapped(Sharded):
    """The same model under FSDPStrategy (FSDP1), wrapped here on the CPU device: FSDP1 refuses a CPU module
    without an explicit ``device_id``, which Lightning's own wrapping leaves out on CPU."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import FullyShardedDataParallel

        self.net = FullyShardedDataParallel(self.net, device_id=torch.device("cpu"))


class CPUFSDPStrategy(FSDPStrategy):
    """FSDPStrategy unchanged: only its type differs, which Lightning's CUDA-only check looks at."""


def emit(**fields: Any) -> None:
    # One write per line: both ranks share the pipe, and print() may split a line into two writes.
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


class Report(Callback):
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        emit(event="start", rank=trainer.global_rank, step=trainer.global_step)

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        if trainer.global_step == 1:
            emit(event="training", rank=trainer.global_rank)


def main() -> int:
    root, sock, max_steps, devices = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    kind = sys.argv[5] if len(sys.argv) > 5 else "model_parallel"
    strategy: Strategy
    if kind == "fsdp":
        strategy, module = CPUFSDPStrategy(state_dict_type="sharded"), Wrapped()
    else:
        strategy = ModelParallelStrategy(data_parallel_size=devices, tensor_parallel_size=1)
        module = Sharded()
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(4096, 4, generator=generator)
    data = DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=8)
    callback = PreemptdCallback(root, socket_path=sock)
    trainer = Trainer(
        max_steps=max_steps, callbacks=[callback, Report()], accelerator="cpu", devices=devices,
        strategy=strategy, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, data, ckpt_path=callback.resume_path())
    saved = [c.step for c in callback.saved]
    emit(event="stopped", rank=trainer.global_rank, step=trainer.global_step, saved=saved,
         preempted=callback.preempted)  # fmt: skip
    return EXIT_PREEMPTED if callback.preempted else 0


if __name__ == "__main__":
    sys.exit(main())
