"""The Lightning callback with ``tier="peer"`` (issue 24 item 7): a DDP job on two simulated hosts (a real agent
each, one Lightning process each over loopback gloo); a drill on host 1 puts Lightning's checkpoint into host
0's RAM tier only, nothing under the durable root; ``resume_path()`` finds it there. Ranks that would resume
from different steps (a new host without the copy) stop in ``setup`` after the copy is sent to every host, and
the next start resumes it on both."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from tests.hosts import Host, free_port, hosts
from tests.lazy import HAS_TORCH
from tests.support import REPO, http_json

JOB = "lightning-peer-test"
# Lightning runs in the child processes only: collecting this module imports neither it nor torch.
pytestmark = [
    pytest.mark.slow,
    pytest.mark.torch_mp,
    pytest.mark.timeout(400),
    pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed"),
    pytest.mark.skipif(importlib.util.find_spec("lightning") is None, reason="lightning is not installed"),
]

# One node of the job: Tiny trains under DDP (gloo); "save" pauses at step 3 until its watcher has a trigger
# (the test drills host 1 once both nodes said "reached"), "resume" starts from resume_path().
_NODE = textwrap.dedent(
    """
    import json, os, sys, warnings, zlib
    import torch
    from lightning.pytorch import Callback, LightningModule, Trainer
    from lightning.pytorch.strategies import DDPStrategy
    from torch.utils.data import DataLoader, TensorDataset
    from agent.client.lightning import PreemptdCallback

    warnings.filterwarnings("ignore")
    mode, root, sock, job, nodes = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])

    class Tiny(LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.layer(x), y)

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=0.01)

    def digest(module):
        return zlib.crc32(b"".join(v.detach().numpy().tobytes() for v in module.state_dict().values()))

    def say(**fields):
        print(json.dumps(fields), flush=True)

    class Pause(Callback):
        def on_train_batch_end(self, trainer, *args):
            if mode == "save" and trainer.global_step == 3:
                say(event="reached")
                if trainer.global_rank == 1:
                    assert preemptd.watcher.wait(60) is not None

        def on_train_start(self, trainer, module):
            say(event="start", step=trainer.global_step, digest=digest(module))

        def on_train_end(self, trainer, module):
            say(event="end", step=trainer.global_step, digest=digest(module))

    generator = torch.Generator().manual_seed(1)
    x = torch.randn(64, 4, generator=generator)
    data = DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=4)
    preemptd = PreemptdCallback(root, socket_path=sock, tier="peer", job=job, drain=bool(os.environ.get("DRAIN")))
    trainer = Trainer(
        max_steps=100 if mode == "save" else 6, callbacks=[Pause(), preemptd], accelerator="cpu", devices=1,
        num_nodes=nodes, strategy=DDPStrategy(process_group_backend="gloo") if nodes > 1 else "auto",
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False,
    )
    path = preemptd.resume_path() if mode == "resume" else None
    try:
        trainer.fit(Tiny(), data, ckpt_path=path)
    except Exception as exc:
        say(event="failed", error=str(exc))
        sys.exit(3)
    saved = [(c.step, c.metadata.get("tier"), str(c.path)) for c in preemptd.saved]
    say(event="done", saved=saved, resumed_from=path)
    """
)


class Node:
    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.events: list[dict[str, Any]] = []

    async def until(self, event: str) -> None:
        assert self.proc.stdout is not None
        while not any(e["event"] == event for e in self.events):
            line = await asyncio.wait_for(self.proc.stdout.readline(), 120)
            assert line, f"ended before {event!r}"
            if line.startswith(b"{"):
                self.events.append(json.loads(line))

    async def finish(self) -> tuple[int, dict[str, dict[str, Any]]]:
        out, err = await asyncio.wait_for(self.proc.communicate(), 180)
        self.events += [json.loads(line) for line in out.decode().splitlines() if line.startswith("{")]
        assert self.proc.returncode is not None
        assert self.proc.returncode in (0, 3), err.decode()[-3000:]
        return self.proc.returncode, {e["event"]: e for e in self.events}


async def _nodes(group: Sequence[Host], tmp: Path, mode: str, drain: bool = False) -> list[Node]:
    script = tmp / "node.py"
    script.write_text(_NODE)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREEMPTD_", "TORCHELASTIC_", "SLURM_"))}
    env.update(PYTHONPATH=str(REPO), GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), LOCAL_RANK="0", WORLD_SIZE=str(len(group)),
               **({"DRAIN": "1"} if drain else {}))  # fmt: skip
    nodes = []
    for index, host in enumerate(group):
        args = (mode, str(tmp / "ckpt"), str(host.socket), JOB, str(len(group)))
        proc = await asyncio.create_subprocess_exec(
            sys.executable, str(script), *args, env={**env, "NODE_RANK": str(index)}, cwd=str(REPO),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        nodes.append(Node(proc))
    return nodes


def _steps(host: Host) -> list[int]:
    return [record.step for record in host.tier.holdings.steps_of(os.getuid(), JOB)]


async def test_a_drill_keeps_lightnings_checkpoint_in_the_other_hosts_ram_and_the_job_resumes_it(
    tmp_path: Path,
) -> None:
    async with hosts(3) as every:
        two = every[:2]
        saving = await _nodes(two, tmp_path, "save")
        for node in saving:
            await node.until("reached")
        status, body = await http_json(
            two[1].socket, "POST", "/v1/drills", {"kind": "termination", "in_s": 60}
        )
        assert status == 201, body
        saved = [await node.finish() for node in saving]
        held = [_steps(host) for host in two]
        durable = sorted(p.name for p in (tmp_path / "ckpt").glob("step-*"))

        # Host 1 is gone; host 0 resumes with a new host 2 that holds nothing: they disagree, stop, and the
        # copy is on both afterwards; started again, both resume it.
        await every[1].stop()
        pair = [every[0], every[2]]
        refused = [await node.finish() for node in await _nodes(pair, tmp_path, "resume")]
        held_after = [_steps(host) for host in pair]
        resumed = [await node.finish() for node in await _nodes(pair, tmp_path, "resume")]
    assert [0, 0] == [code for code, _ in saved]
    [(step, tier, path)] = saved[0][1]["done"]["saved"]
    assert (3, "peer", [[3], []], []) == (step, tier, held, durable)
    assert str(every[0].ram) in path
    assert [3, 3] == [code for code, _ in refused]
    assert "start the job again" in refused[0][1]["failed"]["error"]
    assert [[3], [3]] == held_after
    end = saved[0][1]["end"]["digest"]
    assert [(0, 3, end, 6)] * 2 == [
        (code, events["start"]["step"], events["start"]["digest"], events["end"]["step"])
        for code, events in resumed
    ]


async def test_with_drain_lightnings_peer_checkpoint_becomes_a_durable_step_that_a_new_host_resumes_at_once(
    tmp_path: Path,
) -> None:
    """PreemptdCallback(tier="peer", drain=True): after the drill on host 1, host 0's agent drains Lightning's
    checkpoint into the root as an ordinary step; host 0 and a new host 2 then both take it in resume_path()
    and resume it in one start (no stop to spread the RAM copy)."""
    async with hosts(3) as every:
        two = every[:2]
        saving = await _nodes(two, tmp_path, "save", drain=True)
        for node in saving:
            await node.until("reached")
        status, body = await http_json(
            two[1].socket, "POST", "/v1/drills", {"kind": "termination", "in_s": 60}
        )
        assert status == 201, body
        saved = [await node.finish() for node in saving]
        drain = every[0].tier.drains.records[(os.getuid(), JOB, 3)] if every[0].tier.drains else None
        assert drain is not None
        await asyncio.wait_for(drain.done.wait(), 120)
        await every[1].stop()
        resumed = [await node.finish() for node in await _nodes([every[0], every[2]], tmp_path, "resume")]
    step_dir = tmp_path / "ckpt" / f"step-{3:012d}"
    assert [0, 0] == [code for code, _ in saved]
    assert ("committed", ["lightning.ckpt", "manifest.json"]) == (
        drain.state,
        sorted(p.name for p in step_dir.iterdir()),
    )
    end = saved[0][1]["end"]["digest"]
    assert [(0, 3, end, 6, str(step_dir / "lightning.ckpt"))] * 2 == [
        (code, events["start"]["step"], events["start"]["digest"], events["end"]["step"],
         events["done"]["resumed_from"])
        for code, events in resumed
    ]  # fmt: skip
