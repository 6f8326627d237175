"""The Hugging Face Trainer callback with a real agent: a drill makes the Trainer save a durable, verified
checkpoint and stop; the Trainer resumes from it. The model is built from a config: nothing is downloaded."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

from transformers import TrainerCallback, TrainerControl, TrainerState

from agent.client import EXIT_PREEMPTED, Checkpoint, CheckpointError, CheckpointWarning
from agent.client.hf import MANIFEST, PreemptdTrainerCallback, last_good_checkpoint
from agent.client.preempted import ENV, read_records
from agent.client.store import seal
from tests.hf_trainer_job import trainer
from tests.store_fs import fill, small_fs
from tests.support import REPO, http_json, running_agent

__all__ = ["small_fs"]  # the fixture, used by name

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


class PauseAt(TrainerCallback):
    """At step ``step``, tells the test and holds training until the watcher has the drill."""

    def __init__(self, step: int, preemptd: PreemptdTrainerCallback, reached: Any) -> None:
        self.step, self.preemptd, self.reached = step, preemptd, reached

    def on_step_end(self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        if state.global_step == self.step and self.preemptd.watcher is not None:
            self.reached()
            assert self.preemptd.watcher.wait(30) is not None


class Record(TrainerCallback):
    def on_train_begin(self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        self.start_step = state.global_step


async def test_drill_makes_the_trainer_save_durably_stop_and_resume(base: Path) -> None:
    sock = base / "a.sock"
    loop = asyncio.get_running_loop()
    reached = asyncio.Event()
    async with running_agent(base, components=[]):
        preemptd = PreemptdTrainerCallback(socket_path=sock)
        pause = PauseAt(3, preemptd, lambda: loop.call_soon_threadsafe(reached.set))
        first = trainer(base / "out", 100, [pause, preemptd])
        train = asyncio.ensure_future(asyncio.to_thread(first.train))
        await asyncio.wait_for(reached.wait(), 60)
        status, _ = await http_json(sock, "POST", "/v1/drills", {"kind": "termination", "in_s": 30})
        await asyncio.wait_for(train, 120)
        [saved] = preemptd.saved
        assert (201, True, 3, True) == (status, preemptd.preempted, first.state.global_step, saved.emergency)

        # Resumed while the drill is still active: its checkpoint exists, so it does not stop this run.
        resume_from = last_good_checkpoint(base / "out")
        record = Record()
        second = trainer(base / "out", 6, [record, PreemptdTrainerCallback(socket_path=sock)])
        await asyncio.to_thread(second.train, resume_from_checkpoint=resume_from)
    assert (str(base / "out" / "checkpoint-3"), 3, 6) == (
        resume_from,
        record.start_step,
        second.state.global_step,
    )


def test_checkpoint_without_manifest_is_skipped_with_a_warning(tmp_path: Path) -> None:
    good = tmp_path / "checkpoint-2"
    good.mkdir()
    (good / "model.safetensors").write_bytes(b"weights")
    seal(good, 2, manifest=MANIFEST)
    (tmp_path / "checkpoint-5").mkdir()
    with pytest.warns(CheckpointWarning, match="incomplete"):
        assert str(good) == last_good_checkpoint(tmp_path)


@pytest.mark.torch_mp
async def test_under_exec_and_torchrun_a_drill_ends_the_job_with_75(base: Path) -> None:
    """torchrun turns the worker's 75 into 1; the callback records its sealed emergency checkpoint for
    ``preemptd exec``, which exits 75."""
    sock, output = base / "a.sock", base / "out"
    environ = {k: v for k, v in os.environ.items() if not k.startswith("PREEMPTD_")}
    environ.update(PYTHONPATH=str(REPO), GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    async with running_agent(base, components=[]):
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "agent", "exec", "--",
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
            str(REPO / "tests" / "hf_trainer_job.py"), str(output), str(sock),
            env=environ, cwd=str(REPO), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        try:
            assert proc.stdout is not None
            line = await asyncio.wait_for(proc.stdout.readline(), 120)
            assert b'"training"' in line, line
            status, drill = await http_json(sock, "POST", "/v1/drills", {"kind": "termination", "in_s": 30})
            _, err = await asyncio.wait_for(proc.communicate(), 120)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    resume_from = last_good_checkpoint(output)
    assert resume_from is not None, err.decode()[-3000:]
    saved = Checkpoint.load(Path(resume_from), MANIFEST)
    assert (201, True, drill["notice"]["id"], EXIT_PREEMPTED) == (
        status,
        saved.emergency,
        saved.notice_id,
        proc.returncode,
    ), err.decode()[-3000:]


class FillDisk(TrainerCallback):
    """Fills the file system of the output directory once the Trainer has written its checkpoint, before
    the preemptd callback seals it: the manifest write meets a real ENOSPC."""

    def __init__(self, mount: Path) -> None:
        self.mount = mount

    def on_save(self, args: Any, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        fill(self.mount)


async def test_an_emergency_save_that_cannot_be_sealed_falls_back_to_the_earlier_checkpoint(
    base: Path, small_fs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full disk while the emergency checkpoint is sealed: trainer.train() raises a CheckpointError naming
    the space, and the earlier sealed checkpoint is recorded for ``preemptd exec`` (which then exits 75)."""
    channel = base / "exec"
    channel.mkdir()
    monkeypatch.setenv(ENV, str(channel))
    output = small_fs / "out"
    earlier = output / "checkpoint-1"
    earlier.mkdir(parents=True)
    (earlier / "model.safetensors").write_bytes(b"weights")
    seal(earlier, 1, manifest=MANIFEST)
    sock = base / "a.sock"
    loop = asyncio.get_running_loop()
    reached = asyncio.Event()
    async with running_agent(base, components=[]):
        preemptd = PreemptdTrainerCallback(socket_path=sock)
        pause = PauseAt(3, preemptd, lambda: loop.call_soon_threadsafe(reached.set))
        job = trainer(output, 100, [pause, FillDisk(small_fs), preemptd])
        train = asyncio.ensure_future(asyncio.to_thread(job.train))
        await asyncio.wait_for(reached.wait(), 60)
        _, drill = await http_json(sock, "POST", "/v1/drills", {"kind": "termination", "in_s": 30})
        try:
            with pytest.raises(CheckpointError) as failed:
                await asyncio.wait_for(train, 120)
        finally:  # train() raised: on_train_end, which stops the watcher, never ran
            preemptd.stop_watching()
        preemptd.reporter.flush(10)
    [record] = read_records(channel)
    assert ("no_space", 1) == (failed.value.reason, failed.value.fallback and failed.value.fallback.step)
    assert "no space left on the file system" in str(failed.value)
    assert (1, True, 3, drill["notice"]["id"]) == (
        record["step"],
        record["fallback"],
        record["failed_step"],
        record["notice_id"],
    )
