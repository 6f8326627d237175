"""A host lost silently (issue 38, "Noticing a silent loss in seconds"): two simulated hosts, each in a network
namespace of this test's own (``ip netns``, one veth pair between them, 10.77.x.1 and 10.77.x.2; nothing
outside them is reached), run examples/sharded_training.py under ``preemptd exec -- torchrun --nnodes 2`` with
peer snapshots every 10 steps and ``--collective-timeout-s 10``. Host 1's link is then cut: no FIN, no RST, its
processes still alive. Host 0's rank stops within the collective timeout instead of gloo's 30 minutes, and the
job relaunched on host 0 alone resumes from the newest committed snapshot with the digest it had when taken."""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.hosts import JOB, Host, HostRun, finished, free_port, hosts
from tests.lazy import HAS_TORCH

pytestmark = [
    pytest.mark.slow,
    pytest.mark.torch_mp,
    pytest.mark.timeout(300),
    pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed"),
]

_PAIRS = itertools.count()


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


@pytest.fixture
def link() -> Iterator[tuple[list[str], list[str], list[str]]]:
    """Two namespaces joined by one veth pair: their names, their addresses, their interfaces."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2")
    tag = f"{os.getpid() % 10000}x{next(_PAIRS)}"
    spaces, links = [f"pd{tag}h0", f"pd{tag}h1"], [f"pd{tag}a", f"pd{tag}b"]
    subnet = 10 + os.getpid() % 200
    addresses = [f"10.77.{subnet}.1", f"10.77.{subnet}.2"]
    try:
        for space in spaces:
            _ip("netns", "add", space)
        _ip("link", "add", links[0], "type", "veth", "peer", "name", links[1])
        for space, name, address in zip(spaces, links, addresses, strict=True):
            _ip("link", "set", name, "netns", space)
            _ip("-n", space, "addr", "add", f"{address}/24", "dev", name)
            _ip("-n", space, "link", "set", name, "up")
            _ip("-n", space, "link", "set", "lo", "up")
    except subprocess.CalledProcessError as exc:
        for space in spaces:
            subprocess.run(["ip", "netns", "del", space], capture_output=True, check=False)
        pytest.skip(f"cannot make network namespaces here: {exc.stderr.strip()}")
    yield spaces, addresses, links
    for space in spaces:
        subprocess.run(["ip", "netns", "del", space], capture_output=True, check=False)


async def _start(
    host: Host, node: int, space: str, master: str, port: int, iface: str, ckpt: Path
) -> HostRun:
    static = ["--nnodes", "2", "--node-rank", str(node), "--master-addr", master, "--master-port", str(port)]
    args = [
        "--steps",
        "100000",
        "--step-time",
        "0.02",
        "--snapshot-every",
        "10",
        "--collective-timeout-s",
        "10",
    ]
    return await HostRun.start(
        host,
        node,
        2,
        port,
        ckpt,
        args,
        launcher=static,
        prefix=["ip", "netns", "exec", space],
        env={"GLOO_SOCKET_IFNAME": iface},
    )


async def test_a_host_cut_off_silently_stops_the_job_within_the_collective_timeout_and_the_snapshot_holds(
    tmp_path: Path, link: tuple[list[str], list[str], list[str]]
) -> None:
    spaces, addresses, links = link
    ckpt = tmp_path / "ckpt"
    async with hosts(2) as two:
        runs = [
            await _start(host, node, spaces[node], addresses[0], 29511, links[node], ckpt)
            for node, host in enumerate(two)
        ]
        for run in runs:
            while len(run.of("snapshot")) < 3:
                await run.until_more(timeout=120)
        _ip("-n", spaces[1], "link", "set", links[1], "down")  # silent: no FIN, no RST, host 1 still runs
        codes = await finished(runs, timeout=150)
        assert all(code != 0 for code in codes), codes
        # Host 0 stopped on the collective timeout, not on a closed connection: the cut was silent.
        assert "Timed out waiting 10000ms" in runs[0].stderr, runs[0].stderr[-3000:]
        digests = {e["step"]: e["digest"] for run in runs for e in run.of("snapshot")}
        newest = max(record.step for record in two[0].tier.holdings.steps_of(os.getuid(), JOB))
        again = await HostRun.start(two[0], 0, 1, free_port(), ckpt, ["--steps", str(newest + 2)])
        restarted = await finished([again])
    assert [0] == restarted, again.stderr[-3000:]
    [resumed] = again.of("resumed")
    assert (newest, 1, digests[newest]) == (resumed["next_step"], resumed["world_size"], resumed["digest"])
