"""Simulated hosts on this machine for the multi-host tests (tests/e2e/, and the client's and bridges' tests
that run a job on several hosts): each host an agent of its own (own socket, state directory and RAM-tier
directory), and ``preemptd exec -- torchrun --nnodes N --node-rank i`` of examples/sharded_training.py on it
over loopback (gloo on CPU). Importing this module imports no torch."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import shutil
import signal
import socket
import sys
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from agent.ramtier import RamTierComponent
from agent.service.daemon import Agent
from tests.support import REPO, agent_config, http_json, short_tmp

EXAMPLE = REPO / "examples" / "sharded_training.py"
JOB = "evacuate-test"


@dataclass
class Host:
    """One simulated host: its agent (``[ram_tier]`` on, its tier in its own temporary directory)."""

    index: int
    base: Path
    agent: Agent | None = None
    settings: dict[str, Any] = field(default_factory=dict)  # more of the agent's configuration

    @property
    def socket(self) -> Path:
        return self.base / "a.sock"

    @property
    def ram(self) -> Path:
        return self.base / "ram"

    @property
    def tier(self) -> RamTierComponent:
        assert self.agent is not None
        return next(c for c in self.agent.components if isinstance(c, RamTierComponent))

    def step_dir(self, step: int) -> Path:
        return self.ram / str(os.getuid()) / JOB / str(step)

    async def stop(self) -> None:
        if self.agent is not None:
            await self.agent.stop()

    async def start(self) -> None:
        """Start its agent (again: the same socket, state and RAM tier); return once the tier is read back."""
        settings = {"ram_tier.enabled": True, "ram_tier.path": str(self.ram), "ram_tier.cap_bytes": 1 << 30}
        settings.update(self.settings)
        self.agent = Agent(agent_config(self.base, settings))
        await self.agent.start()
        await asyncio.wait_for(self.tier.loaded.wait(), 30)


@asynccontextmanager
async def hosts(
    count: int, settings: Mapping[int, dict[str, Any]] | None = None
) -> AsyncIterator[list[Host]]:
    """``count`` simulated hosts, their agents started (host ``i`` with ``settings[i]`` added)."""
    async with AsyncExitStack() as stack:
        found = []
        for index in range(count):
            host = Host(index, short_tmp(), settings=dict((settings or {}).get(index, {})))
            stack.callback(shutil.rmtree, host.base, True)
            await host.start()
            # The agent running at the end (a host may have restarted it); stopping twice does nothing.
            stack.push_async_callback(lambda host=host: host.stop())
            found.append(host)
        yield found


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class HostRun:
    """``preemptd exec -- torchrun --nnodes N --node-rank i`` of the example on one host; its JSON-lines
    progress read as it comes."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.events: list[dict[str, Any]] = []
        self.stderr = ""

    @classmethod
    async def start(
        cls,
        host: Host,
        node: int,
        count: int,
        port: int,
        ckpt: Path,
        args: Sequence[str],
        wrapper: Path | None = None,
        launcher: Sequence[str] | None = None,
        prefix: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        script: Path = EXAMPLE,
    ) -> HostRun:
        """``launcher``: torchrun's node and rendezvous flags (default: static, ``count`` nodes, this one ``node``,
        the master on ``port``); ``prefix``: what runs the command (``ip netns exec NS``); ``env``: more of the
        environment (another interface for gloo); ``script``: the training script (the example's flags)."""
        static = f"--nnodes {count} --node-rank {node} --master-addr 127.0.0.1 --master-port {port}".split()
        nodes = static if launcher is None else list(launcher)
        script_args = [
            str(script),
            "--checkpoint-dir",
            str(ckpt),
            "--socket",
            str(host.socket),
            "--tier",
            "peer",
        ]
        torchrun = [sys.executable, "-m", "torch.distributed.run", *nodes, "--nproc-per-node", "1"]
        command = [sys.executable, "-m", "agent", "exec", "--", *torchrun]
        command += [*([str(wrapper)] if wrapper else []), *script_args, *args]
        proc = await asyncio.create_subprocess_exec(
            *prefix,
            *command,
            env={**host_env(), **(env or {})},
            cwd=str(REPO),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        return cls(proc)

    async def until(self, event: str, timeout: float = 180.0) -> None:
        async def read() -> None:
            assert self.proc.stdout is not None
            while not self.of(event):
                line = await self.proc.stdout.readline()
                if not line:
                    err = (await self.proc.stderr.read()).decode() if self.proc.stderr else ""
                    raise AssertionError(f"ended before {event!r}: {err[-4000:]}")
                self._add(line.decode())

        await asyncio.wait_for(read(), timeout)

    async def until_more(self, timeout: float = 180.0) -> None:
        """Read the next line of progress."""
        assert self.proc.stdout is not None
        line = await asyncio.wait_for(self.proc.stdout.readline(), timeout)
        if not line:
            err = (await self.proc.stderr.read()).decode() if self.proc.stderr else ""
            raise AssertionError(f"ended: {err[-4000:]}")
        self._add(line.decode())

    async def finish(self, timeout: float = 180.0) -> int:
        out, err = await asyncio.wait_for(self.proc.communicate(), timeout)
        for line in out.decode().splitlines():
            self._add(line)
        self.stderr = err.decode()
        assert self.proc.returncode is not None
        return self.proc.returncode

    def _add(self, line: str) -> None:
        if line.startswith("{"):
            self.events.append(json.loads(line))

    def of(self, event: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["event"] == event]


def host_env() -> dict[str, str]:
    """The tests' environment: this repository, loopback for gloo, and the job's id for the RAM tier."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("PREEMPTD_", "TORCHELASTIC_"))}
    environ.update(
        {"PYTHONPATH": str(REPO), "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "PREEMPTD_JOB_ID": JOB}
    )
    return environ


def file_tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``root`` with its size and modification time."""
    return {
        str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in root.rglob("*")
        if p.is_file()
    }


async def train(
    group: Sequence[Host], ckpt: Path, *args: str, wrappers: Mapping[int, Path] | None = None
) -> list[HostRun]:
    """The example on each host of ``group`` (node ranks in that order), started together; on the nodes
    ``wrappers`` names, through that script."""
    port = free_port()
    return [
        await HostRun.start(host, node, len(group), port, ckpt, args, (wrappers or {}).get(node))
        for node, host in enumerate(group)
    ]


# torchrun's rendezvous waits, shortened for tests (docs/elastic.md): a round with MIN nodes but fewer than MAX
# completes after 3 s of last call (default 30 s), and a departed node's heartbeat expires after 5 s (c10d only;
# default 15 s). Long enough for a loaded machine's torchruns to join one round and keep their heartbeats.
FAST_RENDEZVOUS = {
    "c10d": "last_call_timeout=3,keep_alive_interval=1,keep_alive_max_attempt=5",
    "etcd-v2": "last_call_timeout=3",
}


def elastic_flags(port: int, nodes: str = "2:3", backend: str = "c10d") -> list[str]:
    """torchrun's elastic flags; the rendezvous at 127.0.0.1:``port`` (c10d: served by the first torchrun to
    bind it; etcd-v2: an etcd server), its id unique to the run (etcd keeps a closed one), its waits short."""
    return [
        "--rdzv-conf",
        FAST_RENDEZVOUS[backend],
        "--nnodes",
        nodes,
        "--rdzv-backend",
        backend,
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        f"shrink-test-{os.getpid()}-{next(_RUNS)}",
        "--max-restarts",
        "3",
        "--monitor-interval",
        "0.1",
    ]


_RUNS = itertools.count()


LONG_RUN = ["--steps", "100000", "--step-time", "0.02", "--log-every", "5"]


def store_host(runs: Sequence[HostRun], port: int) -> int:
    """Which run's process tree listens on the rendezvous port (the first torchrun to bind it serves it)."""
    for index, run in enumerate(runs):
        for proc in psutil.Process(run.proc.pid).children(recursive=True):
            try:
                listening = [c for c in proc.net_connections("tcp") if c.status == psutil.CONN_LISTEN]
            except psutil.Error:
                continue
            if any(c.laddr.port == port for c in listening):
                return index
    raise AssertionError(f"no torchrun listens on {port}")


async def drill_host(host: Host) -> None:
    status, body = await http_json(host.socket, "POST", "/v1/drills", {"kind": "termination", "in_s": 60})
    assert status == 201, body


async def kill_runs(runs: Sequence[HostRun]) -> None:
    for run in runs:
        if run.proc.returncode is None:
            run.proc.send_signal(signal.SIGKILL)  # exec's keeper takes the whole tree with it
            await run.proc.wait()


async def finished(runs: list[HostRun], timeout: float = 180.0) -> list[int]:
    """Every run's exit status; on a timeout, the runs killed and every run's stderr in the failure."""
    try:
        return [await run.finish(timeout=timeout) for run in runs]
    except (TimeoutError, asyncio.TimeoutError):
        for run in runs:
            if run.proc.returncode is None:
                run.proc.kill()
        tails = [((await run.proc.stderr.read()).decode() if run.proc.stderr else "")[-3000:] for run in runs]
        raise AssertionError(f"not all runs ended in {timeout} s: {tails}") from None
