"""The client's tests' shared parts: a peer save's job on simulated hosts, a sharded job's ranks, and an agent
with its RAM tier on."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
import textwrap
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from agent.ramtier import RamTierComponent
from agent.service.daemon import Agent
from tests.hosts import Host, free_port
from tests.support import REPO, agent_config, short_tmp

PEER_RANK_SCRIPT = textwrap.dedent(
    """
    import json, os, sys, warnings, zlib
    import torch, torch.distributed as dist
    from agent.checkpoint.manifest import CheckpointError
    from agent.client.peer.ramtier import RamTier
    from agent.client.peer.store import PeerCheckpointStore
    from agent.client.torch import load_torch, torch_writer

    mode, root, sock, noticed = sys.argv[1], sys.argv[2], sys.argv[3], set(json.loads(sys.argv[4]))
    job, step = sys.argv[5], int(sys.argv[6])
    dist.init_process_group("gloo")
    rank = dist.get_rank()

    def digest(state):
        return zlib.crc32(state["w"].numpy().tobytes()) ^ state["step"]

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        drain = RamTier(sock, drain_to=root) if os.environ.get("DRAIN") else None  # the agents drain to root
        store = PeerCheckpointStore(root, socket_path=sock, job=job, ram_tier=drain)
        out = {"rank": rank}
        if mode in ("save", "stale", "twice"):
            torch.manual_seed(0)
            state = {"w": torch.randn(256, 1024), "step": step}
            for at in (step, step + 1) if mode == "twice" else (step,):  # "twice": a newer peer step after it
                state["step"] = at
                saved = store.save(at, torch_writer(state), emergency=True, notice_id="n-1", noticed=noticed)
                out.setdefault("digests", {})[at] = digest(state)
            out.update(step=saved.step, path=str(saved.path), tier=saved.metadata.get("tier"), digest=digest(state))
            if mode == "stale":  # a newer durable step after it
                state["step"] += 1
                store.save(state["step"], torch_writer(state))
        if mode == "damaged":  # each copy loses a byte after its CRC32 was taken (RAM gone bad before the drain)
            torch.manual_seed(0)
            state = {"w": torch.randn(256, 1024), "step": step}

            def damaged(directory, write=torch_writer(state)):
                written = write(directory)
                with open(directory / "state.pt", "r+b") as handle:
                    handle.seek(1000)
                    byte = handle.read(1)[0]
                    handle.seek(1000)
                    handle.write(bytes([byte ^ 0xFF]))
                return written

            saved = store.save(step, damaged, emergency=True, notice_id="n-1", noticed=noticed)
            out.update(step=saved.step, tier=saved.metadata.get("tier"))
        if mode == "die":  # a durable step, then the notified rank dies as the emergency save starts
            torch.manual_seed(0)
            state = {"w": torch.randn(256, 1024), "step": step - 1}
            store.save(state["step"], torch_writer(state))
            if rank in noticed:
                os._exit(9)
            try:
                store.save(step, torch_writer(state), emergency=True, notice_id="n-1", noticed=noticed)
            except CheckpointError as exc:
                out.update(error=str(exc), fallback=exc.fallback.step if exc.fallback else None)
        found = store.load_latest(load_torch) if mode in ("resume", "stale") else None
        if found is not None:
            checkpoint, state = found
            out.update(step=checkpoint.step, path=str(checkpoint.path), digest=digest(state),
                       tier=checkpoint.metadata.get("tier"))
    out["warnings"] = [str(w.message) for w in caught if "CheckpointWarning" in type(w.message).__name__]
    print(json.dumps(out), flush=True)
    dist.destroy_process_group()
    """
)

RANK_SCRIPT = textwrap.dedent(
    """
    import atexit, json, os, sys

    def threads():
        return len(os.listdir("/proc/self/task"))

    mode, root = sys.argv[1], sys.argv[2]
    # Registered before the store's module is imported, so they run after the store's own exit handler (the
    # last registered runs first): then the job's groups are destroyed ("exit"), then the threads counted.
    atexit.register(lambda: print(json.dumps({"at_exit": threads()}), flush=True))
    import torch, torch.distributed as dist
    if mode == "exit":
        atexit.register(dist.destroy_process_group)
    from agent.client.dcp import ShardedStore

    out = {"bare": threads()}
    dist.init_process_group("gloo")
    given = dist.new_group(backend="gloo")
    out["job"] = threads()
    store = ShardedStore(root, report=False, group=given, tier="peer", job="close-test",
                         socket_path=os.path.join(root, "no-agent.sock"))
    out["store"] = threads()
    state = {"w": torch.arange(4096.0)}
    if mode == "failed":  # the root is a full file system: the background save fails on its thread
        failed = store.save_async(1, {"w": torch.ones(1 << 20)})
        try:
            store.wait_async()
        except Exception as exc:
            out["error"] = str(exc)
        mode = "close"
    else:
        store.save_async(1, state)
        store.save(2, state)
    if mode == "close":
        store.close()
        out["closed"] = threads()
        try:
            store.save(3, {"w": torch.ones(1)})
        except RuntimeError as exc:
            out["save_after_close"] = str(exc)
        total = torch.ones(1)
        dist.all_reduce(total, group=given)  # the group it was given is let go, not destroyed
        out["given_group_sum"] = total.item()
        del given
        dist.destroy_process_group()
        out["destroyed"] = threads()
    elif mode == "destroy_first":  # the job's groups destroyed before the store is closed
        del given
        dist.destroy_process_group()
        store.close()
        out["destroyed"] = threads()
    else:  # a background save left running: its commit ends before the groups go
        del given
        store.save_async(3, state)
    print(json.dumps(out), flush=True)
    """
)


JOB = "full-state-test"


STEP = 7


async def peer_ranks(
    group: Sequence[Host],
    tmp: Path,
    mode: str,
    noticed: Sequence[int] = (),
    dies: Sequence[int] = (),
    drain: bool = False,
) -> list[dict[str, Any]]:
    """One rank per host of ``group`` (rank i on host i) running ``mode``; each rank's JSON line (none for
    the ranks in ``dies``, which must fail). ``drain``: the store's RamTier drains to the root."""
    script = tmp / "rank.py"
    script.write_text(PEER_RANK_SCRIPT)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREEMPTD_", "TORCHELASTIC_"))}
    env.update(PYTHONPATH=str(REPO), GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port), WORLD_SIZE=str(len(group)), **({"DRAIN": "1"} if drain else {}))  # fmt: skip
    procs = []
    for rank, host in enumerate(group):
        args = (mode, str(tmp / "ckpt"), str(host.socket), json.dumps(list(noticed)), JOB, str(STEP))
        proc = await asyncio.create_subprocess_exec(
            sys.executable, str(script), *args, env={**env, "RANK": str(rank)}, cwd=str(REPO),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        procs.append(proc)
    outs = [await asyncio.wait_for(proc.communicate(), 180) for proc in procs]
    for rank, (proc, (_, err)) in enumerate(zip(procs, outs, strict=True)):
        assert (proc.returncode == 0) != (rank in dies), err.decode()[-3000:]
    return [
        {} if r in dies else json.loads(out.decode().strip().splitlines()[-1])
        for r, (out, _) in enumerate(outs)
    ]


def steps_held(host: Host) -> list[int]:
    return [record.step for record in host.tier.holdings.steps_of(os.getuid(), JOB)]


async def dcp_job(
    tmp: Path, mode: str, root: Path | None = None, rank_script: str = RANK_SCRIPT
) -> list[dict[str, Any]]:
    """Two ranks of ``rank_script`` in ``mode`` (its second argument: ``root``, else ``tmp``/ckpt); each
    rank's JSON lines merged into one dict."""
    script = tmp / "rank.py"
    script.write_text(rank_script)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREEMPTD_", "TORCHELASTIC_"))}
    env.update(PYTHONPATH=str(REPO), GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), WORLD_SIZE="2")  # fmt: skip
    procs = []
    for rank in range(2):
        proc = await asyncio.create_subprocess_exec(
            sys.executable, str(script), mode, str(root or tmp / "ckpt"), env={**env, "RANK": str(rank)},
            cwd=str(REPO), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        procs.append(proc)
    outs = [await asyncio.wait_for(proc.communicate(), 150) for proc in procs]
    results = []
    for proc, (out, err) in zip(procs, outs, strict=True):
        assert proc.returncode == 0, err.decode()[-3000:]
        merged: dict[str, Any] = {}
        for line in out.decode().splitlines():
            merged.update(json.loads(line))
        results.append(merged)
    return results


@asynccontextmanager
async def tier_agent(enabled: bool = True, cap_bytes: int = 1 << 24) -> AsyncIterator[tuple[Path, Path]]:
    """A real agent with its RAM tier in a temporary directory: (its socket, the tier's directory)."""
    base = short_tmp()
    settings = {
        "ram_tier.enabled": enabled,
        "ram_tier.path": str(base / "ram"),
        "ram_tier.cap_bytes": cap_bytes,
    }
    agent = Agent(agent_config(base, settings))
    await agent.start()
    try:
        tier = next(c for c in agent.components if isinstance(c, RamTierComponent))
        await asyncio.wait_for(tier.loaded.wait(), 30)
        yield base / "a.sock", base / "ram"
    finally:
        await agent.stop()
        shutil.rmtree(base, ignore_errors=True)


# One rank: a peer-tier store (its own async and stream groups; the save group is the job's, given to it)
# saves in the background and in the foreground, then is closed or left to the exit.


# One rank of the job: the same state on every rank (as DDP keeps it), saved or resumed through the store.
