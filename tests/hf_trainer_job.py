"""A small Hugging Face Trainer job on CPU with PreemptdTrainerCallback, for tests/client/test_hf_callback.py to run
under ``preemptd exec -- torchrun`` (the tests build their Trainers with :func:`trainer` too). The model is
built from a config: nothing is downloaded. Prints JSON lines (``training`` once the first step is done,
``stopped`` with the step); exits 75 when it stopped for a notice after its emergency checkpoint.

    python tests/hf_trainer_job.py OUTPUT_DIR SOCKET
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainerControl,
    TrainerState,
    TrainingArguments,
)

from agent.client import EXIT_PREEMPTED
from agent.client.hf import PreemptdTrainerCallback


def emit(**fields: Any) -> None:
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


class Pace(TrainerCallback):
    """Slow enough for a drill to land mid-training; says when training runs."""

    def on_step_end(self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        if state.global_step == 1:
            emit(event="training")
        time.sleep(0.05)


def model() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=32, n_positions=8))


def dataset() -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    rows = torch.randint(0, 32, (64, 8), generator=generator)
    return [{"input_ids": row, "labels": row} for row in rows]


def trainer(output: Path, max_steps: int, callbacks: list[TrainerCallback]) -> Trainer:
    """The small Trainer of tests/client/test_hf_callback.py, and of this job."""
    args = TrainingArguments(
        output_dir=str(output), max_steps=max_steps, per_device_train_batch_size=4, save_strategy="no",
        report_to=[], use_cpu=True, logging_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
    )  # fmt: skip
    return Trainer(model=model(), args=args, train_dataset=dataset(), callbacks=callbacks)


def main(output: Path, socket_path: str) -> int:
    preemptd = PreemptdTrainerCallback(socket_path=socket_path)
    job = trainer(output, 100000, [Pace(), preemptd])
    job.train()
    emit(event="stopped", step=job.state.global_step, preempted=preemptd.preempted)
    return EXIT_PREEMPTED if preemptd.preempted else 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), sys.argv[2]))
