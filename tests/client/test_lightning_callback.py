"""The Lightning callback with a real agent: a drill gives a checkpoint that Lightning resumes from."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lightning")

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch.utils.data import DataLoader, TensorDataset

from agent.client import EXIT_PREEMPTED, Checkpoint
from agent.client.lightning import PreemptdCallback
from tests.support import REPO, http_json, running_agent

pytestmark = [
    # importing Lightning alone takes seconds
    pytest.mark.slow,
    pytest.mark.timeout(120),
    # Lightning's advice for real training, irrelevant to a 16-sample CPU model:
    pytest.mark.filterwarnings("ignore:The '.*dataloader' does not have many workers"),
    pytest.mark.filterwarnings("ignore:You're resuming from a checkpoint that ended before the epoch ended"),
    # Lightning 2.6 builds a pytree LeafSpec, deprecated by newer torch (not our code):
    pytest.mark.filterwarnings(r"ignore:`isinstance\(treespec, LeafSpec\)` is deprecated:FutureWarning"),
    # On a host with Slurm installed, Lightning suggests srun; these tests run one local process on purpose.
    pytest.mark.filterwarnings("ignore:The `srun` command is available on your system but is not used"),
]


class Tiny(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0.01)


def loader() -> DataLoader[Any]:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(64, 4, generator=generator)
    return DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=4)


def trainer(max_steps: int, *callbacks: Callback) -> Trainer:
    return Trainer(
        max_steps=max_steps, callbacks=list(callbacks), accelerator="cpu", devices=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip


class PauseAt(Callback):
    """At step ``step``, tells the test and holds training until the watcher has a trigger: the drill
    arrives at a known step without sleeping."""

    def __init__(self, step: int, preemptd: PreemptdCallback, reached: Any) -> None:
        self.step, self.preemptd, self.reached = step, preemptd, reached

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        if trainer.global_step == self.step and self.preemptd.watcher is not None:
            self.reached()
            assert self.preemptd.watcher.wait(30) is not None


class Record(Callback):
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.start_step = trainer.global_step
        self.start_weights = {k: v.clone() for k, v in pl_module.state_dict().items()}


async def test_drill_checkpoint_is_resumed_by_lightning(base: Path) -> None:
    sock = base / "a.sock"
    first = Tiny()
    loop = asyncio.get_running_loop()
    reached = asyncio.Event()
    async with running_agent(base, components=[]):
        preemptd = PreemptdCallback(base / "ckpt", socket_path=sock)
        pause = PauseAt(3, preemptd, lambda: loop.call_soon_threadsafe(reached.set))
        fit = asyncio.ensure_future(asyncio.to_thread(trainer(100, pause, preemptd).fit, first, loader()))
        await asyncio.wait_for(reached.wait(), 60)
        status, _ = await http_json(sock, "POST", "/v1/drills", {"kind": "termination", "in_s": 30})
        await asyncio.wait_for(fit, 60)
        [saved] = preemptd.saved
        assert (201, True, 3, True) == (status, preemptd.preempted, saved.step, saved.emergency)

        # Resumed while the drill is still active: its checkpoint exists, so it does not stop this run.
        resumed = PreemptdCallback(base / "ckpt", socket_path=sock)
        record = Record()
        second = trainer(6, record, resumed)
        await asyncio.to_thread(second.fit, Tiny(), loader(), ckpt_path=resumed.resume_path())
    same = all(torch.equal(v, first.state_dict()[k]) for k, v in record.start_weights.items())
    assert (3, True, 6) == (record.start_step, same, second.global_step)


def test_periodic_checkpoints_keep_the_newest(base: Path) -> None:
    preemptd = PreemptdCallback(base / "ckpt", keep=2, interval_s=1e-9, socket_path=base / "none.sock")
    trainer(4, preemptd).fit(Tiny(), loader())
    assert ([4, 3], [False] * 4) == (preemptd.store.steps(), [c.emergency for c in preemptd.saved])


def test_a_callback_refuses_a_tier_it_does_not_know_and_a_drain_without_the_peer_tier(base: Path) -> None:
    """Before training, not at the emergency: the arguments that cannot work say what would."""
    with pytest.raises(ValueError, match="tier must be 'durable' or 'peer', got 'ram'"):
        PreemptdCallback(base / "ckpt", tier="ram", socket_path=base / "none.sock")
    with pytest.raises(ValueError, match="drain=True drains the peer tier's steps: it needs tier='peer'"):
        PreemptdCallback(base / "ckpt", drain=True, socket_path=base / "none.sock")


# -- a strategy that writes on every rank: ModelParallelStrategy (FSDP2) on CPU/gloo, two ranks


async def _sharded_job(
    root: Path, sock: Path, max_steps: int, devices: int, kind: str = "model_parallel"
) -> asyncio.subprocess.Process:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREEMPTD_")}
    env.update({"PYTHONPATH": str(REPO), "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"})
    job = [sys.executable, str(REPO / "tests" / "lightning_sharded_job.py")]
    return await asyncio.create_subprocess_exec(
        *job, str(root), str(sock), str(max_steps), str(devices), kind, env=env, cwd=str(REPO),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, start_new_session=True,
    )  # fmt: skip


def _stop(job: asyncio.subprocess.Process) -> None:
    """Whatever failed, leave no rank behind (Lightning's second rank is a child of the first)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(job.pid, signal.SIGKILL)


async def _lines(proc: asyncio.subprocess.Process, event: str, count: int) -> None:
    async def read() -> None:
        assert proc.stdout is not None
        seen = 0
        while seen < count:
            line = await proc.stdout.readline()
            if not line:
                raise AssertionError(f"the job ended before {count} {event!r} lines")
            seen += line.decode().count(f'"event": "{event}"')

    await asyncio.wait_for(read(), 240)


def _events(out: bytes, event: str) -> list[dict[str, Any]]:
    docs = [json.loads(line) for line in out.decode().splitlines() if line.startswith("{")]
    return [d for d in docs if d["event"] == event]


@pytest.mark.torch_mp
@pytest.mark.slow
@pytest.mark.timeout(480)
@pytest.mark.parametrize("kind", ["model_parallel", "fsdp"])
async def test_sharded_strategy_drill_saves_every_rank_shard_once_and_resumes_on_one_rank(
    base: Path, kind: str
) -> None:
    """ModelParallelStrategy (FSDP2), and FSDPStrategy (FSDP1, state_dict_type="sharded"): a drill → every rank
    writes its shard in Lightning's format → one commit → exit 75 → ``ckpt_path`` resumes it on one rank."""
    root = base / "ckpt"
    async with running_agent(base):
        sock = base / "a.sock"
        job = await _sharded_job(root, sock, 100000, 2, kind)
        try:
            await _lines(job, "training", 2)
            status, body = await http_json(sock, "POST", "/v1/drills", {"kind": "termination", "in_s": 60})
            assert status == 201, body
            out, err = await asyncio.wait_for(job.communicate(), 180)
        finally:
            _stop(job)
    stopped = _events(out, "stopped")
    [committed] = [Checkpoint.load(p) for p in sorted(root.glob("step-*"))]
    ranks = {f.path.split("/")[-1] for f in committed.files}
    assert EXIT_PREEMPTED == job.returncode, err.decode()[-3000:]
    assert [[committed.step], [committed.step]] == [s["saved"] for s in stopped]
    assert (True, 2, {"__0_0.distcp", "__1_0.distcp", ".metadata", "meta.pt"} <= ranks) == (
        committed.emergency, committed.metadata["world_size"], True,
    )  # fmt: skip

    resumed = await _sharded_job(root, base / "none.sock", committed.step + 2, 1, kind)
    try:
        out, err = await asyncio.wait_for(resumed.communicate(), 180)
    finally:
        _stop(resumed)
    assert 0 == resumed.returncode, err.decode()[-3000:]
    assert [committed.step] == [s["step"] for s in _events(out, "start")]
