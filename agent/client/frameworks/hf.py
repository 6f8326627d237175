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
from pathlib import Path
from typing import TYPE_CHECKING, Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from agent.client.frameworks.callbacks import FollowsNotices, WatchOptions
from agent.client.frameworks.torch import Coordinator, Decision
from agent.client.preempted import record_emergency
from agent.client.reporting import Reporter
from agent.client.store import Checkpoint, CheckpointError, Verify, seal, valid_only
from agent.client.store_failure import convertible, fall_back, save_failure

if TYPE_CHECKING:
    from typing_extensions import Unpack

MANIFEST = "preemptd-manifest.json"
_CHECKPOINT_DIR = re.compile(r"^checkpoint-(\d+)$")


class PreemptdTrainerCallback(FollowsNotices, TrainerCallback):
    """Emergency (and optionally periodic) saves for ``transformers.Trainer``.

    Options (:class:`~agent.client.frameworks.callbacks.WatchOptions`): ``every`` (a collective when distributed),
    ``interval_s`` (None leaves periodic saving to ``save_steps``), ``stop_on_notice``, ``socket_path``,
    ``watcher`` (otherwise one runs from ``on_train_begin`` to ``on_train_end``), ``policy``.
    """

    def __init__(
        self, *, checksum: bool = True, reporter: Reporter | None = None, **options: Unpack[WatchOptions]
    ) -> None:
        FollowsNotices.__init__(self, **options)
        self.checksum = checksum
        self.reporter = reporter if reporter is not None else Reporter(self.socket_path)
        self.coordinator = Coordinator(self.watcher, self.schedule, every=self.every)
        self._pending: tuple[Decision, float] | None = None
        self.saved: list[Checkpoint] = []

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        watcher = self.coordinator.watcher = self.start_watching()
        if state.global_step and args.output_dir is not None:
            # Resumed: the notice the checkpoint was saved for (if any) does not stop this run again.
            try:
                resumed = Checkpoint.load(Path(args.output_dir) / f"checkpoint-{state.global_step}", MANIFEST)
            except CheckpointError:
                return
            watcher.mark_handled([resumed.notice_id])

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
                try:
                    checkpoint = seal(
                        directory,
                        state.global_step,
                        manifest=MANIFEST,
                        checksum=self.checksum,
                        emergency=decision.emergency,
                        notice_id=decision.notice_id,
                        started=started,
                    )
                except BaseException as exc:
                    if not convertible(exc):  # an interrupt or exit: not a storage failure
                        raise
                    raise self._failed(exc, directory, state.global_step, decision) from exc
                self.saved.append(checkpoint)
                if decision.emergency:  # durable now: `preemptd exec` may turn the launcher's failure into 75
                    record_emergency(state.global_step, path=directory, notice_id=decision.notice_id)
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

    def _failed(self, exc: BaseException, directory: Path, step: int, decision: Decision) -> CheckpointError:
        """The CheckpointError for a checkpoint that could not be sealed, reported as failed. For an emergency
        save the newest earlier sealed checkpoint is recorded for ``preemptd exec`` instead (so the job still
        exits 75 and resumes from it), as the stores do."""
        root = directory.parent
        earlier = [d for d in _checkpoint_dirs(root) if d != directory]

        def newest() -> Checkpoint | None:
            for candidate in earlier:
                try:
                    return Checkpoint.load(candidate, MANIFEST)
                except CheckpointError:
                    continue
            return None

        error = save_failure(exc, step, root, directory, None, newest)
        flush = None
        if decision.emergency:
            error.fallback = fall_back(
                lambda: earlier, step, decision.notice_id, error, sharded=False, manifest=MANIFEST
            )
            flush = {"fallback_step": error.fallback.step} if error.fallback is not None else None
        self.reporter.checkpoint(
            "failed", step, emergency=decision.emergency, notice_id=decision.notice_id, flush=flush
        )
        return error

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self.stop_watching()
        self.coordinator.watcher = self.watcher
        self.reporter.flush()


def last_good_checkpoint(output_dir: str | Path, verify: Verify = "checksum") -> str | None:
    """The newest ``checkpoint-<step>`` directory whose preemptd manifest verifies, for
    ``trainer.train(resume_from_checkpoint=...)``; incomplete or corrupt ones are skipped with a
    :class:`~agent.client.store.CheckpointWarning`. None when there is none."""
    root = Path(output_dir)
    if not root.is_dir():
        return None

    def get(directory: Path) -> str:
        Checkpoint.load(directory, MANIFEST).verify(verify)
        return str(directory)

    return next(valid_only(_checkpoint_dirs(root), get), None)


def _checkpoint_dirs(root: Path) -> list[Path]:
    """The Trainer's ``checkpoint-<step>`` directories under ``root``, newest step first ([] when it cannot be
    listed)."""
    try:
        entries = list(root.iterdir())
    except OSError:
        return []
    found = sorted(
        ((int(m.group(1)), p) for p in entries if (m := _CHECKPOINT_DIR.match(p.name)) and p.is_dir()),
        reverse=True,
    )
    return [directory for _step, directory in found]


__all__ = [
    "MANIFEST",
    "PreemptdTrainerCallback",
    "last_good_checkpoint",
]
