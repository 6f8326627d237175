"""A Lightning DDP job (gloo on CPU) with PreemptdCallback(tier="peer") for tests/e2e/test_shrink_lightning.py, run as
``preemptd exec -- torchrun --nnodes MIN:MAX … tests/lightning_elastic_job.py`` on each simulated host. Takes the
flags of examples/sharded_training.py that the hosts' runner passes (``--checkpoint-dir``, ``--socket``,
``--tier``, ``--steps``, ``--step-time``, ``--log-every``) and prints JSON lines: ``resumed`` (world size, step,
digest of the model) at every (re)start, ``step`` every ``--log-every`` steps, ``stopped`` (step, digest, the
elastic answer) when the callback stopped it; exits 75 when the callback says ``preempted``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
import zlib
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, TensorDataset

from agent.client import EXIT_PREEMPTED
from agent.client.lightning import PreemptdCallback


def emit(**fields: Any) -> None:
    sys.stdout.write(json.dumps(fields) + "\n")  # one write per line
    sys.stdout.flush()


class Tiny(LightningModule):
    def __init__(self, step_time: float) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(4, 1)
        self.step_time = step_time

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        time.sleep(self.step_time)
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0.01)


def digest(module: torch.nn.Module) -> int:
    return zlib.crc32(b"".join(v.detach().numpy().tobytes() for v in module.state_dict().values()))


class Report(Callback):
    def __init__(self, every: int, preemptd: PreemptdCallback) -> None:
        self.every, self.preemptd = every, preemptd

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        emit(
            event="resumed",
            world_size=trainer.world_size,
            rank=trainer.global_rank,
            next_step=trainer.global_step,
            digest=digest(pl_module),
        )

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        if trainer.global_step % self.every == 0:
            emit(event="step", world_size=trainer.world_size, step=trainer.global_step)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        reform = self.preemptd.reform
        emit(
            event="stopped",
            step=trainer.global_step,
            digest=digest(pl_module),
            reform=reform.as_dict() if reform else None,
        )


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint-dir", required=True)
    parser.add_argument("--socket", required=True)
    parser.add_argument("--tier", default="peer")
    parser.add_argument("--steps", type=int, default=100000)
    parser.add_argument("--step-time", type=float, default=0.02)
    parser.add_argument("--log-every", type=int, default=5)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(1 << 16, 4, generator=generator)
    data = DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=4)
    preemptd = PreemptdCallback(args.checkpoint_dir, socket_path=args.socket, tier=args.tier)
    trainer = Trainer(
        max_steps=args.steps,
        callbacks=[preemptd, Report(args.log_every, preemptd)],
        accelerator="cpu",
        devices=1,
        num_nodes=int(os.environ["WORLD_SIZE"]),
        strategy=DDPStrategy(process_group_backend="gloo"),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )
    trainer.fit(Tiny(args.step_time), data, ckpt_path=preemptd.resume_path())
    return EXIT_PREEMPTED if preemptd.preempted else 0


if __name__ == "__main__":
    sys.exit(main())
