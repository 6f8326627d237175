#!/usr/bin/env python3
"""Evacuation benchmark (issue 24): from the agreed emergency decision to "every shard is safe on a host
without a notice", for the peer tier (``ShardedStore(tier="peer")``: into the RAM tiers of the other hosts; **peer** streams the
notified rank's shard to its buddy as DCP writes it, **peer_files** is the earlier path, kept for the A/B: the
notified rank writes its shard into its own RAM tier and sends the files afterwards) and for the durable tier (the same store's emergency save to a disk root), with the floors measured beside
them in the same run: a bare process-group send of the bytes the notified host must move, and a bare write of
each rank's shard to tmpfs.

    .venv/bin/python bench/evacuate.py --hosts 2 --gib 2 --rounds 3 [--dir /var/tmp/preemptd-bench]
    .venv/bin/python bench/evacuate.py --full-state --hosts 3 --gib 1 --rounds 3
    .venv/bin/python bench/evacuate.py --hosts 2 --gib 2 --rounds 5 --crc zlib   # the A/B's other half

``--full-state``: every rank holds the whole state (DDP) and saves through ``PeerCheckpointStore``: the peer
tier (one copy written by each surviving host's rank, nothing sent) against the durable tier (rank 0 writes
the root) and a bare ``torch.save`` of the state into tmpfs on the surviving ranks.

Simulated hosts on one machine: one real agent per host (its own socket, state directory and RAM tier under
``/dev/shm``), one rank per host, gloo over loopback; the last host has the notice. Every rank holds 1/hosts
of the state as DTensors (FSDP2-style row shards). Each measure is timed on all ranks together, from a common
start (a barrier) to the slowest rank's end; the order of the measures alternates between rounds. The clock
starts at the agreed decision: seeing the notice takes milliseconds (bench/flush.py) and is left out. Prints
one JSON object (medians, per-round ratios, the machine); figures go to bench/RESULTS.md, nothing is asserted.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

JOB = "bench-evacuate"
PIECE = 64 * 1024 * 1024  # float32 elements per tensor: 256 MiB
COLUMNS = 4096  # a weight matrix sharded on its rows (see bench/sharded_flush.py on 1-D shards)


# -- the launcher: agents and ranks ----------------------------------------------------------------------


def machine() -> str:
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{os.cpu_count()} cores, {mem:.0f} GiB, {platform.platform()}, Python {platform.python_version()}"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def start_agent(base: Path, ram: Path, cap: int) -> subprocess.Popen[bytes]:
    log = (base / "agent.log").open("ab")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREEMPTD_", "NOTIFY_SOCKET"))}
    env["PYTHONPATH"] = str(REPO)
    args = [sys.executable, "-m", "agent", "run", "--socket", str(base / "a.sock"), "--state-dir",
            str(base / "state"), "--cloud", "none", "--log-format", "json",
            "--set", "ram_tier.enabled=true", "--set", f"ram_tier.path={ram}",
            "--set", f"ram_tier.cap_bytes={cap}"]  # fmt: skip
    return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(REPO))


def wait_for_tier(sock: Path, timeout: float = 60.0) -> None:
    from agent.client.peer.ramtier import RamTier, RamTierError

    deadline = time.monotonic() + timeout
    while True:
        try:
            RamTier(sock).info()
            return
        except RamTierError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


@contextlib.contextmanager
def simulated_hosts(count: int, prefix: str, cap: int = 1 << 30) -> Iterator[tuple[Path, list[Path]]]:
    """``count`` agents, each with its own socket, state and RAM tier (in /dev/shm), started and ready: the
    base directory and their sockets. Stopped on leaving; their logs kept (and named) when it raised."""
    base = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    agents, socks = [], []
    try:
        for index in range(count):
            host = base / f"h{index}"
            host.mkdir()
            agents.append(start_agent(host, Path(tempfile.mkdtemp(prefix="pd-ram-", dir="/dev/shm")), cap))
            socks.append(host / "a.sock")
        for sock in socks:
            wait_for_tier(sock)
        yield base, socks
    finally:
        for agent in agents:
            agent.terminate()
            agent.wait(timeout=30)
        if sys.exc_info()[0] is None:
            shutil.rmtree(base, ignore_errors=True)
        else:
            print(f"the hosts' logs: {base}", file=sys.stderr)
        for ram in Path("/dev/shm").glob("pd-ram-*"):
            shutil.rmtree(ram, ignore_errors=True)


def crc_implementation() -> str:
    """Which CRC32 this process's checkpoint code uses (agent/checkpoint/checksum.py): "zlib-ng" or "zlib"."""
    from agent.checkpoint.checksum import FAST

    return "zlib-ng" if FAST else "zlib"


def launch(args: argparse.Namespace) -> int:
    need = int(args.gib * 2**30 * 3.2)  # own shards, the received ones, the tmpfs floor's files
    free = shutil.disk_usage("/dev/shm").free
    if free < need:
        raise SystemExit(
            f"/dev/shm has {free / 2**30:.1f} GiB free, this run needs about {need / 2**30:.1f} GiB"
        )
    bases = [Path(tempfile.mkdtemp(prefix=f"pdb{i}-", dir="/tmp")) for i in range(args.hosts)]
    rams = [
        Path(tempfile.mkdtemp(prefix=f"preemptd-bench-{i}-", dir="/dev/shm")) / "tier"
        for i in range(args.hosts)
    ]
    data = Path(tempfile.mkdtemp(prefix="preemptd-bench-", dir=args.dir))
    agents = [start_agent(b, r, need) for b, r in zip(bases, rams, strict=True)]
    ranks: list[subprocess.Popen[bytes]] = []
    try:
        for base in bases:
            wait_for_tier(base / "a.sock")
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PREEMPTD_", "TORCHELASTIC_"))}
        env.update(PYTHONPATH=str(REPO), GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(free_port()), WORLD_SIZE=str(args.hosts))  # fmt: skip
        for rank, base in enumerate(bases):
            command = [sys.executable, __file__, "--rank-of", str(base / "a.sock"), "--gib", str(args.gib),
                       "--rounds", str(args.rounds), "--data", str(data), "--shm", str(rams[rank].parent),
                       "--crc", args.crc, *(["--full-state"] if args.full_state else [])]  # fmt: skip
            ranks.append(
                subprocess.Popen(
                    command, env={**env, "RANK": str(rank), "LOCAL_RANK": "0"}, stdout=subprocess.PIPE
                )
            )
        outs = [proc.communicate()[0] for proc in ranks]
        if any(proc.returncode for proc in ranks):
            raise SystemExit(f"a rank failed: {[proc.returncode for proc in ranks]}")
        result = json.loads(outs[0].decode().strip().splitlines()[-1])
        result["machine"] = machine()
        print(json.dumps(result, indent=1))
    finally:
        for proc in ranks:
            if proc.poll() is None:
                proc.kill()
        for agent in agents:
            agent.send_signal(signal.SIGTERM)
        for agent in agents:
            try:
                agent.wait(20)
            except subprocess.TimeoutExpired:
                agent.kill()
        for path in [*bases, *(r.parent for r in rams), data]:
            shutil.rmtree(path, ignore_errors=True)
    return 0


# -- one rank ---------------------------------------------------------------------------------------------


def instrument() -> dict[str, float]:
    """Seconds this rank spends in each phase of an evacuation (added up until cleared): the evacuation's
    own functions, wrapped where the module looks them up, so the figures say where the time goes."""
    from agent.client.peer import evacuate

    spent: dict[str, float] = {}

    def wrap(owner: Any, name: str, label: str) -> None:
        original = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                spent[label] = spent.get(label, 0.0) + time.perf_counter() - start

        setattr(owner, name, timed)

    wrap(evacuate.Evacuation, "_place", "ask the agent (info)")
    wrap(evacuate.Evacuation, "_reserve", "reserve (and its gather)")
    wrap(evacuate, "dcp_save", "DCP save into tmpfs (peer: the notified shard streamed), CRC32 as written")
    wrap(evacuate.Streams, "__exit__", "end of the stream (buddy: its receivers joined)")
    wrap(evacuate.Evacuation, "_transfer", "transfer (send / receive, CRC, write)")
    wrap(evacuate.Evacuation, "_held", "CRC of the files kept (their sums)")
    wrap(evacuate.Evacuation, "_commit", "tier.json, commit (and its gather)")
    wrap(evacuate.Evacuation, "run", "evacuation in all")
    return spent


def run_rank(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from agent.client.dcp import ShardedStore
    from agent.client.peer.ramtier import RamTier

    torch.set_num_threads(1)
    phases = instrument()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    notified = world - 1  # the last host has the notice; its buddy is host 0 (the next in the ring)
    buddy = 0
    mesh = init_device_mesh("cpu", (world,))
    per_rank = int(args.gib * 2**30 / world)
    pieces = max(1, per_rank // (PIECE * 4))
    rows = per_rank // 4 // pieces // COLUMNS
    generator = torch.Generator().manual_seed(rank)
    local = [torch.rand(rows, COLUMNS, generator=generator) for _ in range(pieces)]
    state = {
        f"layer{i}": DTensor.from_local(t, mesh, [Shard(0)], run_check=False) for i, t in enumerate(local)
    }
    nbytes = pieces * rows * COLUMNS * 4
    sock = Path(args.rank_of)
    tier = RamTier(sock)
    root = Path(args.data) / "root"
    peer = ShardedStore(root, keep=1, report=False, socket_path=sock, tier="peer", job=JOB)
    files = ShardedStore(root, keep=1, report=False, socket_path=sock, tier="peer", job=JOB)
    assert peer.peer is not None and files.peer is not None
    files.peer.streaming = False  # the earlier path: the notified shard written to tmpfs, then sent by file
    durable = ShardedStore(root, keep=1, report=False, socket_path=sock)
    received = [torch.empty_like(t) for t in local] if rank == buddy else []
    shm = Path(args.shm)

    cpu: dict[str, list[float]] = {}  # CPU seconds of all ranks together (every thread), per round

    def timed(fn: Any, name: str = "") -> float:
        dist.barrier()
        start, used = time.perf_counter(), time.process_time()
        fn()
        mine = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        spent = torch.tensor([time.process_time() - used], dtype=torch.float64)
        dist.all_reduce(mine, op=dist.ReduceOp.MAX)
        dist.all_reduce(spent)
        cpu.setdefault(name, []).append(float(spent.item()))
        return float(mine.item())

    def bare_send() -> None:
        if rank == notified:
            for t in local:
                dist.send(t, buddy)
        elif rank == buddy:
            for t in received:
                dist.recv(t, notified)

    def bare_tmpfs() -> None:
        with open(shm / f"floor-{rank}", "wb", buffering=0) as handle:
            for t in local:
                handle.write(t.numpy().data)

    step = [0]

    def peer_save(store: Any = peer) -> None:
        step[0] += 1
        saved = store.save(step[0], state, emergency=True, noticed={notified})
        assert saved.checkpoint.metadata.get("tier") == "peer", "the peer tier fell back"

    def durable_save() -> None:
        step[0] += 1
        durable.save(step[0], state, emergency=True)
        durable.wait_checksums()  # the CRCs come after the step is durable; not timed, but not left running

    results: dict[str, list[float]] = {"peer": [], "peer_files": [], "durable": [], "send": [], "tmpfs": []}
    breakdown: dict[str, list[dict[str, float]]] = {"peer": [], "peer_files": []}  # this rank's phases
    measures = {"peer": peer_save, "peer_files": lambda: peer_save(files), "durable": durable_save,
                "send": bare_send, "tmpfs": bare_tmpfs}  # fmt: skip
    timed(bare_tmpfs)  # the first touch of tmpfs and the allocator, counted against nothing
    (shm / f"floor-{rank}").unlink()
    for round_ in range(args.rounds):
        order = list(measures) if round_ % 2 == 0 else list(reversed(measures))
        for name in order:
            phases.clear()
            results[name].append(timed(measures[name], name))
            if name in breakdown:
                breakdown[name].append(dict(phases))
            # Cleaning up, untimed: the RAM step freed, the durable step and the floor's file removed.
            if name in breakdown and rank != notified:  # the notified host freed its copy itself
                tier.free(JOB, step[0])
            elif name == "durable" and rank == 0:
                shutil.rmtree(durable.path_of(step[0]), ignore_errors=True)
            elif name == "tmpfs":
                (shm / f"floor-{rank}").unlink()
            dist.barrier()
        if rank == 0:
            line = ", ".join(f"{k} {v[-1]:.3f} s" for k, v in results.items())
            print(f"round {round_ + 1}: {line}", file=sys.stderr, flush=True)
    every: list[Any] = [None] * world
    dist.all_gather_object(every, breakdown)
    if rank == 0:
        median = {k: statistics.median(v) for k, v in results.items()}
        labels = sorted({label for mine in every for rounds in mine.values() for s in rounds for label in s})
        where = {
            measure: {
                f"rank {r}{' (notified)' if r == notified else ' (buddy)' if r == buddy else ''}": {
                    label: round(statistics.median(s.get(label, 0.0) for s in mine[measure]), 3)
                    for label in labels
                }
                for r, mine in enumerate(every)
            }
            for measure in breakdown
        }
        floor = [s + w for s, w in zip(results["send"], results["tmpfs"], strict=True)]
        overlapped = [max(s, w) for s, w in zip(results["send"], results["tmpfs"], strict=True)]
        result = {
            "hosts": world,
            "bytes_total": nbytes * world,
            "bytes_per_host": nbytes,
            "bytes_sent": nbytes,
            "rounds": args.rounds,
            "seconds": {k: [round(x, 3) for x in v] for k, v in results.items()},
            "median_s": {k: round(v, 3) for k, v in median.items()},
            # the floor of what the evacuation does in sequence: each rank's shard to tmpfs, then the send
            "floor_median_s": round(statistics.median(floor), 3),
            "peer_over_floor": round(
                statistics.median(p / f for p, f in zip(results["peer"], floor, strict=True)), 3
            ),
            # an evacuation that overlapped the two could reach the larger of them
            "peer_over_overlapped_floor": round(
                statistics.median(p / f for p, f in zip(results["peer"], overlapped, strict=True)), 3
            ),
            "peer_files_over_floor": round(
                statistics.median(p / f for p, f in zip(results["peer_files"], floor, strict=True)), 3
            ),
            "peer_over_peer_files": round(
                statistics.median(p / f for p, f in zip(results["peer"], results["peer_files"], strict=True)),
                3,
            ),
            "peer_over_send": round(median["peer"] / median["send"], 3),
            "peer_over_durable": round(
                statistics.median(p / d for p, d in zip(results["peer"], results["durable"], strict=True)), 3
            ),
            "send_gb_s": round(nbytes / median["send"] / 1e9, 3),
            "tmpfs_gb_s": round(nbytes / median["tmpfs"] / 1e9, 3),
            "durable_gb_s_per_host": round(nbytes / median["durable"] / 1e9, 3),
            "peer_phases_median_s": where,
            # CPU seconds of the ranks' processes (all threads, not the agents'), all ranks together
            "cpu_s_median": {k: round(statistics.median(cpu[k]), 3) for k in results},
            "load_average": os.getloadavg(),
            "crc32": crc_implementation(),
        }
        print(json.dumps(result), flush=True)
    peer.close()
    files.close()
    durable.close()
    dist.destroy_process_group()
    return 0


def run_full_state(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    from agent.client.peer.ramtier import RamTier
    from agent.client.peer.store import PeerCheckpointStore
    from agent.client.torch import torch_writer

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    notified = world - 1
    generator = torch.Generator().manual_seed(0)  # the same state on every rank
    pieces = max(1, int(args.gib * 2**30) // (PIECE * 4))
    state = {
        f"layer{i}": torch.rand(int(args.gib * 2**30) // 4 // pieces, generator=generator)
        for i in range(pieces)
    }
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    sock, shm = Path(args.rank_of), Path(args.shm)
    root = Path(args.data) / "root"
    peer = PeerCheckpointStore(root, keep=1, report=False, socket_path=sock, tier="peer", job=JOB)
    durable = PeerCheckpointStore(root, keep=1, report=False, socket_path=sock, tier="durable")
    step = [0]

    def timed(fn: Any) -> float:
        dist.barrier()
        start = time.perf_counter()
        fn()
        mine = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(mine, op=dist.ReduceOp.MAX)
        return float(mine.item())

    def peer_save() -> None:
        step[0] += 1
        saved = peer.save(step[0], torch_writer(state), emergency=True, noticed={notified})
        assert saved.metadata.get("tier") == "peer", "the peer tier fell back"

    def durable_save() -> None:
        step[0] += 1
        durable.save(step[0], torch_writer(state), emergency=True)
        durable.wait_checksums()

    def bare_tmpfs() -> None:
        if rank != notified:
            torch.save(state, shm / "floor.pt")

    results: dict[str, list[float]] = {"peer": [], "durable": [], "tmpfs": []}
    measures = {"peer": peer_save, "durable": durable_save, "tmpfs": bare_tmpfs}
    for round_ in range(args.rounds):
        order = list(measures) if round_ % 2 == 0 else list(reversed(measures))
        for name in order:
            results[name].append(timed(measures[name]))
            if name == "peer" and rank != notified:
                RamTier(sock).free(JOB, step[0])
            elif name == "durable" and rank == 0:
                shutil.rmtree(durable.path_of(step[0]), ignore_errors=True)
            elif name == "tmpfs" and rank != notified:
                (shm / "floor.pt").unlink()
            dist.barrier()
        if rank == 0:
            line = ", ".join(f"{k} {v[-1]:.3f} s" for k, v in results.items())
            print(f"round {round_ + 1}: {line}", file=sys.stderr, flush=True)
    if rank == 0:
        pair = zip(results["peer"], results["tmpfs"], strict=True)
        result = {
            "full_state": True,
            "hosts": world,
            "bytes_state": nbytes,
            "rounds": args.rounds,
            "seconds": {k: [round(x, 3) for x in v] for k, v in results.items()},
            "median_s": {k: round(statistics.median(v), 3) for k, v in results.items()},
            "peer_over_floor": round(statistics.median(p / f for p, f in pair), 3),
            "peer_over_durable": round(
                statistics.median(p / d for p, d in zip(results["peer"], results["durable"], strict=True)), 3
            ),
            "load_average": os.getloadavg(),
            "crc32": crc_implementation(),
        }
        print(json.dumps(result), flush=True)
    peer.close()
    durable.close()
    dist.destroy_process_group()
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--hosts", type=int, default=2, help="simulated hosts, one rank each (2 or 3)")
    parser.add_argument("--gib", type=float, default=2.0, help="total state over all hosts, GiB")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--dir", type=Path, default=Path("/var/tmp"), help="where the durable root goes (a disk)"
    )
    parser.add_argument("--full-state", action="store_true", help="every rank holds the whole state (DDP)")
    parser.add_argument(
        "--crc",
        choices=("fast", "zlib"),
        default="fast",
        help="the ranks' CRC32: whatever agent/checkpoint/checksum.py picks (zlib-ng when installed), or the "
        "standard library's zlib (zlib-ng hidden from the ranks), for an A/B in one session",
    )
    parser.add_argument("--rank-of", help=argparse.SUPPRESS)  # internal: run one rank against this socket
    parser.add_argument("--data", help=argparse.SUPPRESS)
    parser.add_argument("--shm", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_of:
        if args.crc == "zlib":  # before agent.checkpoint.checksum is imported: zlib-ng cannot be imported
            sys.modules["zlib_ng"] = None  # type: ignore[assignment]
        return run_full_state(args) if args.full_state else run_rank(args)
    args.dir.mkdir(parents=True, exist_ok=True)
    return launch(args)


if __name__ == "__main__":
    sys.exit(main())
