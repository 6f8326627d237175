"""Hugging Face ``Trainer`` integration: a callback that asks the Trainer to save and stop when the host gets a
notice (or the process a signal), makes each checkpoint it saves durable and verifiable, and reports it.

    callback = PreemptdTrainerCallback()
    trainer = Trainer(..., callbacks=[callback])
    trainer.train(resume_from_checkpoint=last_good_checkpoint(args.output_dir))

The Trainer writes ``checkpoint-<step>`` itself (not atomically); in ``on_save`` the callback fsyncs the
directory and writes ``preemptd-manifest.json`` last, so :func:`last_good_checkpoint` can skip a checkpoint
that a crash left half written. Ranks agree through ``torch.distributed`` when a process group is up.
"""

from __future__ import annotations

import re
import time
import warnings
from pathlib import Path
from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from agent.client.events import TriggerPolicy
from agent.client.reporting import CheckpointSchedule, Reporter
from agent.client.store import Checkpoint, CheckpointError, CheckpointWarning, Verify, seal
from agent.client.torch import Coordinator, Decision
from agent.client.watcher import Watcher, WatcherBase

MANIFEST = "preemptd-manifest.json"
_CHECKPOINT_DIR = re.compile(r"^checkpoint-(\d+)$")


class PreemptdTrainerCallback(TrainerCallback):
    """Emergency (and optionally periodic) saves for ``transformers.Trainer``.

    ``every``: check every this many optimizer steps (a collective when distributed). ``interval_s``: a fixed
    periodic interval used until the agent advises one; None leaves periodic saving to ``save_steps``.
    ``stop_on_notice``: stop training after the emergency save. ``watcher``: share an existing watcher;
    otherwise one runs from ``on_train_begin`` to ``on_train_end``.
    """

    def __init__(
        self,
        *,
        every: int = 1,
        interval_s: float | None = None,
        stop_on_notice: bool = True,
        socket_path: str | Path | None = None,
        watcher: WatcherBase | None = None,
        policy: TriggerPolicy | None = None,
        checksum: bool = True,
        reporter: Reporter | None = None,
    ) -> None:
        self.socket_path = socket_path
        self.policy = policy
        self.watcher = watcher
        self._own_watcher = watcher is None
        self.stop_on_notice = stop_on_notice
        self.checksum = checksum
        self.reporter = reporter if reporter is not None else Reporter(socket_path)
        schedule = CheckpointSchedule(interval_s, socket_path) if interval_s is not None else None
        self.coordinator = Coordinator(watcher, schedule, every=every)
        self._pending: tuple[Decision, float] | None = None
        self.saved: list[Checkpoint] = []
        self.preempted = False

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self.watcher is None:
            self.watcher = Watcher(self.socket_path, policy=self.policy).start()
            self.coordinator.watcher = self.watcher
        if state.global_step and args.output_dir is not None:
            # Resumed: the notice the checkpoint was saved for (if any) does not stop this run again.
            try:
                resumed = Checkpoint.load(Path(args.output_dir) / f"checkpoint-{state.global_step}", MANIFEST)
            except CheckpointError:
                return
            self.watcher.mark_handled([resumed.notice_id])

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        decision = self.coordinator.check(state.global_step)
        if not decision.checkpoint:
            return
        control.should_save = True
        if decision.emergency and self.stop_on_notice:
            control.should_training_stop = True
            self.preempted = True
        self._pending = (decision, time.monotonic())
        if args.should_save:
            self.reporter.checkpoint(
                "started", state.global_step, emergency=decision.emergency, notice_id=decision.notice_id
            )

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        decision, started = self._pending or (Decision(), time.monotonic())
        self._pending = None
        if args.should_save and args.output_dir is not None:
            directory = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            if directory.is_dir():
                checkpoint = seal(
                    directory,
                    state.global_step,
                    manifest=MANIFEST,
                    checksum=self.checksum,
                    emergency=decision.emergency,
                    notice_id=decision.notice_id,
                    started=started,
                )
                self.saved.append(checkpoint)
                self.reporter.checkpoint(
                    "finished",
                    state.global_step,
                    duration_s=time.monotonic() - started,
                    size=checkpoint.bytes,
                    emergency=decision.emergency,
                    notice_id=decision.notice_id,
                    path=directory,
                )
        self.coordinator.done(decision)

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self._own_watcher and isinstance(self.watcher, Watcher):
            self.watcher.stop()
            self.watcher = None
            self.coordinator.watcher = None
        self.reporter.flush()


def last_good_checkpoint(output_dir: str | Path, verify: Verify = "checksum") -> str | None:
    """The newest ``checkpoint-<step>`` directory whose preemptd manifest verifies, for
    ``trainer.train(resume_from_checkpoint=...)``; incomplete or corrupt ones are skipped with a
    :class:`~agent.client.store.CheckpointWarning`. None when there is none."""
    root = Path(output_dir)
    if not root.is_dir():
        return None
    found = sorted(
        ((int(m.group(1)), p) for p in root.iterdir() if (m := _CHECKPOINT_DIR.match(p.name)) and p.is_dir()),
        reverse=True,
    )
    for _step, directory in found:
        try:
            Checkpoint.load(directory, MANIFEST).verify(verify)
        except CheckpointError as exc:
            warnings.warn(f"skipping checkpoint: {exc}", CheckpointWarning, stacklevel=2)
            continue
        return str(directory)
    return None
