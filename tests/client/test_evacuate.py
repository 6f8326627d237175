"""The evacuation's parts (issue 24 item 2): the plan every rank computes alike (the ring of hosts, the buddy
of each rank of a notified host), the job id, the RAM-tier client against a real agent, and the sharded
store's ``tier="peer"`` on a process group of one: into the host's RAM tier when another host survives, else
to the durable root with a warning saying why."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import socket
import subprocess
import sys
import textwrap
import zlib
from pathlib import Path
from typing import Any

import pytest

from agent.client.peer.ramtier import RamTier, RamTierError, job_id, read_tier_file, write_tier_file
from tests.client.support import tier_agent
from tests.lazy import Lazy
from tests.support import REPO, http_json

# torch and the modules that import it are imported by the first test that uses them (tests/lazy.py).
torch = Lazy("torch")
PeerTierUnusable = Lazy("agent.client.peer.evacuate", "PeerTierUnusable")
Place = Lazy("agent.client.peer.evacuate", "Place")
plan = Lazy("agent.client.peer.evacuate", "plan")
Holding = Lazy("agent.client.peer.resume", "Holding")
choose = Lazy("agent.client.peer.resume", "choose")

JOB = "job-1"


def _places(*hosts: tuple[str, int, bool]) -> list[Place]:
    """Places from (host, number of ranks, noticed), ranks numbered in order."""
    places: list[Place] = []
    for host, count, noticed in hosts:
        places += [Place(len(places), host, noticed, 100) for _ in range(count)]
    return [Place(rank, p.host, p.noticed, p.estimate) for rank, p in enumerate(places)]


@pytest.mark.parametrize(
    ("hosts", "buddies"),
    [
        ((("a", 1, False), ("b", 1, True), ("c", 1, False)), {1: 2}),
        ((("a", 1, False), ("b", 1, False), ("c", 1, True)), {2: 0}),  # the ring wraps
        ((("a", 1, False), ("b", 1, True), ("c", 1, True)), {1: 0, 2: 0}),  # the buddy host has a notice too
        ((("a", 2, True), ("b", 2, False)), {0: 2, 1: 3}),  # the k-th rank to the k-th rank
        ((("a", 2, True), ("b", 1, False)), {0: 2, 1: 2}),
        ((("a", 1, False), ("b", 1, False)), {}),  # no host with a notice: every shard stays where it is
    ],
)
def test_each_rank_of_a_notified_host_sends_to_the_next_host_in_the_ring_without_a_notice(
    hosts: tuple[tuple[str, int, bool], ...], buddies: dict[int, int]
) -> None:
    assert buddies == dict(plan(_places(*hosts)).buddy)


def test_ranks_are_grouped_by_host_and_the_lowest_rank_leads_its_host() -> None:
    """Ranks of one host need not be consecutive; the ring follows each host's lowest rank."""
    places = [
        Place(0, "a", False, 1),
        Place(1, "b", True, 1),
        Place(2, "a", False, 1),
        Place(3, "b", True, 1),
    ]
    found = plan(places)
    assert ((("a", (0, 2)), ("b", (1, 3))), 0, 1) == (found.hosts, found.leader("a"), found.leader("b"))
    assert {1: 0, 3: 2} == dict(found.buddy)


def test_no_plan_when_every_host_has_a_notice() -> None:
    with pytest.raises(PeerTierUnusable.resolve(), match="every host of the job has a notice"):
        plan(_places(("a", 1, True), ("b", 2, True)))


def test_no_plan_when_a_rank_cannot_use_its_hosts_tier_and_the_rank_is_named() -> None:
    places = [Place(0, "a", False, 1), Place(1, "b", True, 1, "RAM tier: no agent at /x.sock")]
    with pytest.raises(PeerTierUnusable.resolve(), match=r"rank 1: RAM tier: no agent at /x\.sock"):
        plan(places)


@pytest.mark.parametrize(
    ("explicit", "env", "expected"),
    [
        ("mine", {"PREEMPTD_JOB_ID": "env"}, "mine"),
        (None, {"PREEMPTD_JOB_ID": "env", "TORCHELASTIC_RUN_ID": "rdzv"}, "env"),
        (None, {"TORCHELASTIC_RUN_ID": "rdzv", "SLURM_JOB_ID": "7"}, "rdzv"),
        (None, {"TORCHELASTIC_RUN_ID": "none", "SLURM_JOB_ID": "7"}, "7"),  # torchrun's default id
        (None, {"SLURM_JOB_ID": "7", "SLURM_ARRAY_TASK_ID": "3"}, "7_3"),
    ],
)
def test_the_job_id_comes_from_the_argument_then_preemptd_then_torchrun_then_slurm(
    explicit: str | None, env: dict[str, str], expected: str
) -> None:
    assert expected == job_id(explicit, env)


def test_without_a_job_id_the_error_says_how_to_set_one() -> None:
    with pytest.raises(ValueError, match="set PREEMPTD_JOB_ID"):
        job_id(None, {"TORCHELASTIC_RUN_ID": "none"})


def test_a_job_id_outside_the_allowed_characters_is_refused_naming_where_it_came_from() -> None:
    with pytest.raises(ValueError, match=r"PREEMPTD_JOB_ID 'a/b' is not a valid RAM-tier job id"):
        job_id(None, {"PREEMPTD_JOB_ID": "a/b"})


def _doc(step: int, files: dict[str, int], every: dict[str, int], run: int = 0) -> dict[str, Any]:
    """A tier.json: this host's files (name -> size) and every file of the step."""
    held = {name: {"size": size, "crc32": size, "rank": 0} for name, size in files.items()}
    return {"step": step, "run": run, "files": held, "step_files": every, "complete": True}


STEP = {".metadata": 1, "__0_0.distcp": 10, "__1_0.distcp": 11}


def test_the_newest_step_complete_across_the_hosts_union_is_chosen_with_its_holders() -> None:
    holdings = [
        Holding(0, "a", {4: _doc(4, {".metadata": 1, "__0_0.distcp": 10}, STEP)}),
        Holding(1, "b", {4: _doc(4, {"__1_0.distcp": 11}, STEP)}),
    ]
    choice, notes = choose(holdings, durable=(0, 3))
    assert choice is not None and [] == notes
    assert (4, {"__1_0.distcp": ("b",), ".metadata": ("a",)}) == (
        choice.step,
        {k: v for k, v in choice.holders.items() if k != "__0_0.distcp"},
    )


def test_an_incomplete_newer_step_is_named_with_what_each_host_holds_and_an_older_complete_one_is_chosen() -> (
    None
):
    holdings = [
        Holding(0, "a", {5: _doc(5, {".metadata": 1, "__0_0.distcp": 10}, STEP), 4: _doc(4, STEP, STEP)}),
    ]
    choice, notes = choose(holdings, durable=None)
    assert choice is not None and 4 == choice.step
    assert ["RAM step 5 is incomplete: __1_0.distcp on no host (a holds .metadata, __0_0.distcp)"] == notes


def test_a_ram_step_not_newer_than_the_newest_durable_step_is_not_chosen() -> None:
    """Newer is by run, then step: a durable step of a later run outranks a higher RAM step."""
    holdings = [Holding(0, "a", {9: _doc(9, STEP, STEP, run=0)})]
    assert (None, []) == choose(holdings, durable=(1, 2))


async def test_a_step_is_reserved_written_committed_listed_and_freed_through_the_client() -> None:
    async with tier_agent() as (sock, ram):
        client = RamTier(sock)

        def work() -> tuple[Any, ...]:
            reservation = client.reserve(JOB, 5, 1000)
            (reservation.path / "__0_0.distcp").write_bytes(b"x" * 100)
            entry = {"size": 100, "crc32": zlib.crc32(b"x" * 100), "rank": 0}
            write_tier_file(
                reservation.path, job=JOB, step=5, run=0, world_size=1, files={"__0_0.distcp": entry},
                complete=True,
            )  # fmt: skip
            client.commit(JOB, 5, reservation.id)
            listed = client.job(JOB)
            client.free(JOB, 5)
            return reservation.path, listed, client.job(JOB)["steps"], read_tier_file(reservation.path)

        path, listed, after, tier_doc = await asyncio.to_thread(work)
    assert ram / str(os.getuid()) / JOB / "5" == path
    assert [(5, True, {"__0_0.distcp"})] == [
        (s["step"], s["complete"], set(s["files"])) for s in listed["steps"]
    ]
    assert ([], None) == (after, tier_doc)


@pytest.mark.parametrize(
    ("enabled", "nbytes", "reason"),
    [(True, 1 << 30, "full"), (False, 10, "disabled")],
)
async def test_a_full_or_disabled_tier_is_an_error_with_its_reason(
    enabled: bool, nbytes: int, reason: str
) -> None:
    async with tier_agent(enabled=enabled) as (sock, _ram):
        client = RamTier(sock)

        def work() -> RamTierError:
            with pytest.raises(RamTierError) as caught:
                client.info() if not enabled else client.reserve(JOB, 1, nbytes)
            return caught.value

        error = await asyncio.to_thread(work)
    assert reason == error.reason, error


def test_no_agent_is_an_unreachable_tier(tmp_path: Path) -> None:
    with pytest.raises(RamTierError, match="no agent at") as caught:
        RamTier(tmp_path / "none.sock").info()
    assert "unreachable" == caught.value.reason


def _state() -> dict[str, Any]:
    return {"weights": torch.arange(1 << 12, dtype=torch.float32)}


@pytest.mark.timeout(120)
async def test_a_peer_save_without_a_notice_on_its_host_stays_in_its_ram_tier_and_the_root_is_untouched(
    group_of_one: None, tmp_path: Path
) -> None:
    from agent.client.dcp import ShardedStore

    async with tier_agent() as (sock, ram):
        store = await asyncio.to_thread(
            ShardedStore, tmp_path / "ckpt", report=False, socket_path=sock, tier="peer", job=JOB
        )
        saved = await asyncio.to_thread(lambda: store.save(3, _state(), emergency=True, noticed=()))
        tier_doc = json.loads((ram / str(os.getuid()) / JOB / "3" / "tier.json").read_text())
    assert (ram / str(os.getuid()) / JOB / "3", "peer") == (saved.path, saved.checkpoint.metadata["tier"])
    assert [] == list((tmp_path / "ckpt").iterdir())
    assert {".metadata", "__0_0.distcp"} == set(tier_doc["files"]) == set(tier_doc["step_files"])


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("agent", "cap_bytes", "noticed", "why"),
    [
        (True, 1 << 24, (0,), "every host of the job has a notice"),
        (False, 1 << 24, (), "no agent at"),
        (True, 1024, (), "ram tier full: need"),
    ],
)
async def test_a_peer_save_that_cannot_evacuate_goes_to_the_durable_root_with_a_warning_saying_why(
    group_of_one: None, tmp_path: Path, agent: bool, cap_bytes: int, noticed: tuple[int, ...], why: str
) -> None:
    from agent.client.dcp import CheckpointWarning, ShardedStore

    async with tier_agent(cap_bytes=cap_bytes) as (sock, ram):
        socket_path = sock if agent else tmp_path / "none.sock"
        store = await asyncio.to_thread(
            ShardedStore, tmp_path / "ckpt", report=False, socket_path=socket_path, tier="peer", job=JOB
        )
        with pytest.warns(CheckpointWarning, match=why):
            saved = await asyncio.to_thread(lambda: store.save(3, _state(), emergency=True, noticed=noticed))
        held = list(ram.glob(f"{os.getuid()}/{JOB}/*"))
    assert (store.path_of(3), []) == (saved.path, held)


async def _drained(sock: Path, key: str, timeout: float = 60.0) -> dict[str, Any]:
    """The agent's drain of ``key`` ("job/step") once it has ended (committed or failed), from its status."""

    async def ended() -> dict[str, Any]:
        while True:
            status, body = await http_json(sock, "GET", "/v1/status")
            assert status == 200, body
            drain = body["ram_tier"].get("drains", {}).get(key)
            if drain is not None and drain["state"] in ("committed", "failed"):
                return dict(drain)
            await asyncio.sleep(0.1)  # the drain is a child process of the agent: its state is polled

    return await asyncio.wait_for(ended(), timeout)


@pytest.mark.timeout(120)
async def test_a_step_committed_with_drain_to_becomes_a_durable_step_that_plain_dcp_loads(
    group_of_one: None, tmp_path: Path
) -> None:
    """RamTier(drain_to=root): the agent copies the committed RAM step into the store's root as an ordinary
    committed step, which the store lists and ``torch.distributed.checkpoint.load`` reads."""
    import torch.distributed.checkpoint as dcp

    from agent.client.dcp import ShardedStore

    ckpt = tmp_path / "ckpt"
    async with tier_agent() as (sock, _ram):
        tiers = RamTier(sock, drain_to=ckpt)
        store = await asyncio.to_thread(
            ShardedStore, ckpt, report=False, socket_path=sock, tier="peer", job=JOB, ram_tier=tiers
        )
        await asyncio.to_thread(lambda: store.save(3, _state(), emergency=True, noticed=()))
        drain = await _drained(sock, f"{os.getuid()}/{JOB}/3")
    loaded = {"weights": torch.zeros(1 << 12)}
    dcp.load(loaded, checkpoint_id=str(store.path_of(3)))
    assert ("committed", [3]) == (drain["state"], store.steps()), drain
    assert torch.equal(_state()["weights"], loaded["weights"])


@pytest.mark.timeout(120)
async def test_a_ram_step_older_than_the_newest_durable_step_is_ignored_by_the_resume_and_freed(
    group_of_one: None, tmp_path: Path
) -> None:
    from agent.client.dcp import ShardedStore

    async with tier_agent() as (sock, _ram):
        store = await asyncio.to_thread(
            ShardedStore, tmp_path / "ckpt", report=False, socket_path=sock, tier="peer", job=JOB
        )
        await asyncio.to_thread(lambda: store.save(3, _state(), emergency=True, noticed=()))
        await asyncio.to_thread(lambda: store.save(5, {"weights": torch.ones(1 << 12)}))
        loaded = {"weights": torch.zeros(1 << 12)}
        resumed = await asyncio.to_thread(store.load_latest, loaded)
        held = await asyncio.to_thread(lambda: RamTier(sock).job(JOB)["steps"])
    assert resumed is not None
    assert (5, store.path_of(5), []) == (resumed.step, resumed.path, held)
    assert torch.equal(torch.ones(1 << 12), loaded["weights"])


@pytest.mark.timeout(120)
async def test_two_jobs_on_the_same_hosts_each_resume_their_own_ram_step(
    group_of_one: None, tmp_path: Path
) -> None:
    from agent.client.dcp import ShardedStore

    async with tier_agent() as (sock, _ram):
        stores = [
            await asyncio.to_thread(
                ShardedStore, tmp_path / job, report=False, socket_path=sock, tier="peer", job=job
            )
            for job in ("job-a", "job-b")
        ]
        for step, store in enumerate(stores, start=3):
            state = {"weights": torch.full((1 << 12,), float(step))}
            await asyncio.to_thread(functools.partial(store.save, step, state, emergency=True, noticed=()))
        loaded = [{"weights": torch.zeros(1 << 12)} for _ in stores]
        resumed = [
            await asyncio.to_thread(s.load_latest, into) for s, into in zip(stores, loaded, strict=True)
        ]
    assert [3, 4] == [r.step for r in resumed if r is not None]
    assert [3.0, 4.0] == [float(into["weights"][0]) for into in loaded]


_TRANSFER = textwrap.dedent(
    """
    import json, sys, zlib
    from pathlib import Path
    import torch.distributed as dist
    from agent.client.peer.evacuate import receive_file, send_file

    dist.init_process_group("gloo")
    where = Path(sys.argv[1])
    data = bytes(range(256)) * 40 + b"x" * 123
    if dist.get_rank() == 0:
        (where / "src").write_bytes(data)
        (where / "empty").write_bytes(b"")
        send_file(None, 1, where / "src", len(data), chunk=1000)
        send_file(None, 1, where / "missing", 2500, chunk=1000)
        send_file(None, 1, where / "src", len(data), chunk=1000, crc=zlib.crc32(data))
        send_file(None, 1, where / "src", len(data), chunk=1000, crc=zlib.crc32(data) ^ 1)
        send_file(None, 1, where / "src", len(data), chunk=1000)
        send_file(None, 1, where / "empty", 0, chunk=1000)
    else:
        crc, problem = receive_file(None, 0, where / "dst", len(data), chunk=1000)
        _, unreadable = receive_file(None, 0, where / "dst2", 2500, chunk=1000)
        known = receive_file(None, 0, where / "dst3", len(data), chunk=1000)
        _, wrong = receive_file(None, 0, where / "dst4", len(data), chunk=1000)
        _, unwritable = receive_file(None, 0, where / "nowhere" / "dst5", len(data), chunk=1000)
        empty = receive_file(None, 0, where / "dst6", 0, chunk=1000)
        same = (where / "dst").read_bytes() == data and crc == zlib.crc32(data)
        print(json.dumps({
            "same": same, "problem": problem, "unreadable": unreadable, "wrong": wrong,
            "unwritable": unwritable, "known": known[1] is None and known[0] == crc,
            "empty": [empty[1], (where / "dst6").read_bytes().decode()],
        }))
    dist.destroy_process_group()
    """
)


@pytest.mark.torch_mp
@pytest.mark.timeout(120)
def test_a_file_crosses_the_group_in_chunks_whole_and_an_unreadable_one_arrives_refused(
    tmp_path: Path,
) -> None:
    """send_file/receive_file between two real gloo ranks: 11 chunks arrive byte for byte with the CRC32,
    computed by the sender or given to it (the CRC32 it summed as it wrote the file: a wrong one is refused);
    a file the sender cannot read, or the receiver cannot create, is received in full (the sender is never
    left blocked) and refused; an empty file arrives empty."""
    script = tmp_path / "transfer.py"
    script.write_text(_TRANSFER)
    env = {**os.environ, "PYTHONPATH": str(REPO), "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    done = subprocess.run(
        [*command, str(script), str(tmp_path)],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert 0 == done.returncode, done.stderr[-3000:]
    report = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("{")))
    assert (True, None) == (report["same"], report["problem"])
    assert "dst2 from rank 0 arrived damaged" in report["unreadable"]
    assert "dst4 from rank 0 arrived damaged" in report["wrong"]
    assert "cannot write" in report["unwritable"]
    assert (True, [None, ""]) == (report["known"], report["empty"])


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_dcp_files_are_summed_as_they_are_written(tmp_path: Path) -> None:
    """SummingFileSystem under DCP's writer: every file it writes (the shard with two threads' worth of
    tensors, .metadata after its rename) gets the CRC32 and size of its bytes on disk, and DCP reads the
    step back."""
    pytest.importorskip("torch")
    from torch.distributed.checkpoint import load as dcp_load
    from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    from agent.client.peer._transfer import SummingFileSystem

    state = {"a": torch.arange(1000, dtype=torch.float32), "b": torch.ones(7, 3), "n": 5}
    writer = FileSystemWriter(tmp_path, sync_files=False, thread_count=2)
    writer.fs = sums = SummingFileSystem(chunk=1000)  # "a" (4000 bytes) summed in pieces beside its write
    dcp_save(state, storage_writer=writer, no_dist=True)
    on_disk = {p.name: (zlib.crc32(p.read_bytes()), p.stat().st_size) for p in tmp_path.iterdir()}
    assert ".metadata" in on_disk and len(on_disk) >= 3, on_disk
    assert on_disk == sums.sums
    into = {"a": torch.zeros(1000), "b": torch.zeros(7, 3), "n": 0}
    dcp_load(into, storage_reader=FileSystemReader(tmp_path), no_dist=True)
    assert (float(into["a"][999]), float(into["b"].sum()), into["n"]) == (999.0, 21.0, 5)


_REPLICAS = textwrap.dedent(
    """
    import json, sys
    import torch, torch.distributed as dist
    from agent.client.dcp import ShardedStore

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    root, sockets = sys.argv[1], sys.argv[2:]
    store = ShardedStore(root, report=False, socket_path=sockets[rank], tier="peer", job="replicas")
    weights = torch.arange(1 << 16, dtype=torch.float32)
    state = {"a": weights, "b": weights + 1, "note": "the same on every rank"}
    saved = store.save(1, state, emergency=True, noticed=(1,))
    print(json.dumps({"rank": rank, "path": str(saved.path)}))
    dist.destroy_process_group()
    """
)


@pytest.mark.torch_mp
@pytest.mark.timeout(120)
async def test_a_replica_held_by_a_host_without_a_notice_is_not_sent(tmp_path: Path) -> None:
    """Two hosts whose ranks hold the same state (DDP replicas): the notified host's rank writes and sends
    no tensor bytes (DCP alone would spread the two tensors over both ranks); the survivor's shard holds
    both and the step is complete in its RAM."""
    script = tmp_path / "replicas.py"
    script.write_text(_REPLICAS)
    env = {**os.environ, "PYTHONPATH": str(REPO), "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    async with tier_agent() as (sock_a, ram_a), tier_agent() as (sock_b, ram_b):
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
        proc = await asyncio.create_subprocess_exec(
            *command, str(script), str(tmp_path / "ckpt"), str(sock_a), str(sock_b), env=env,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        _, err = await asyncio.wait_for(proc.communicate(), 100)
        assert 0 == proc.returncode, err.decode()[-3000:]
        doc = json.loads((ram_a / str(os.getuid()) / "replicas" / "1" / "tier.json").read_text())
        left = list(ram_b.glob("replicas/*"))
    sizes = {name: entry["size"] for name, entry in doc["files"].items()}
    assert (set(sizes), []) == (set(doc["step_files"]), left)
    assert sizes["__0_0.distcp"] >= 2 * (4 << 16)
    assert sizes.get("__1_0.distcp", 0) < 1024, sizes


_STREAM = textwrap.dedent(
    """
    import json, sys, zlib
    from pathlib import Path
    import torch.distributed as dist
    from agent.client.peer._stream import StreamingFileSystem, Streams

    dist.init_process_group("gloo")
    group = dist.new_group(backend="gloo")  # the stream's own, as the store makes it
    where = Path(sys.argv[1]) / str(dist.get_rank())
    where.mkdir()
    data = bytes(range(256)) * 17 + b"x" * 50  # 4402 bytes: one large write, sent in 5 pieces
    if dist.get_rank() == 0:
        fs = StreamingFileSystem(group, 1, chunk=1000)
        with fs.create_stream(where / "__0_0.distcp", "wb") as stream:
            for small in (b"head", b"er"):  # small writes are gathered into one piece
                stream.write(small)
            stream.write(data)  # read-only bytes, sent from the caller's buffer
            stream.write(b"tail")
        with fs.create_stream(where / ".metadata", "wb") as stream:  # not a shard: written here
            stream.write(b"meta")
        fs.end(True)
        wrong = StreamingFileSystem(group, 1, chunk=1000)
        index = wrong.sender.open("__0_1.distcp")
        wrong.sender.piece(index, memoryview(data))
        wrong.sender.close(index, zlib.crc32(data) ^ 1, len(data))
        wrong.end(True)
        cut = StreamingFileSystem(group, 1, chunk=1000)
        cut.sender.piece(cut.sender.open("__0_2.distcp"), memoryview(data[:10]))
        cut.end(False)  # the sender's save failed: the file is never closed
        print(json.dumps({"sent": fs.sent, "sums": {k: list(v) for k, v in fs.sums.items()},
                          "here": sorted(p.name for p in where.iterdir())}))
    else:
        outcome = []
        for _ in range(3):
            with Streams(group, None, [0], where) as streams:
                pass  # a buddy's own DCP write would run here
            outcome.append([{k: list(v) for k, v in streams.received.items()}, streams.problem])
        whole = (where / "__0_0.distcp").read_bytes()
        print(json.dumps({"outcome": outcome, "whole": whole == b"header" + data + b"tail",
                          "crc": zlib.crc32(whole), "size": len(whole)}))
    dist.destroy_process_group()
    """
)


@pytest.mark.slow
@pytest.mark.torch_mp
@pytest.mark.timeout(120)
def test_a_streamed_shard_arrives_whole_with_its_crc_and_a_damaged_or_cut_one_is_refused(
    tmp_path: Path,
) -> None:
    """The notified rank's file system streams a shard file to its buddy on a group of its own as it is
    written (small writes gathered, a large one in pieces), then its CRC32 and size: the buddy's receiver
    writes it byte for byte and reports its CRC32; .metadata is written on the sender, not streamed. A file
    whose CRC32 does not match is refused, and so is a stream its sender ends as failed."""
    script = tmp_path / "stream.py"
    script.write_text(_STREAM)
    env = {**os.environ, "PYTHONPATH": str(REPO), "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    done = subprocess.run(
        [*command, str(script), str(tmp_path)],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert 0 == done.returncode, done.stderr[-3000:]
    reports = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    sender = next(r for r in reports if "sent" in r)
    buddy = next(r for r in reports if "outcome" in r)
    crc, size = buddy["crc"], buddy["size"]
    assert ({"__0_0.distcp": size}, [".metadata"]) == (sender["sent"], sender["here"])
    assert [crc, size] == sender["sums"]["__0_0.distcp"]
    assert [zlib.crc32(b"meta"), 4] == sender["sums"][".metadata"]
    (intact, clean), (damaged, wrong), (cut, cut_short) = buddy["outcome"]
    assert (True, {"__0_0.distcp": [crc, size]}, None) == (buddy["whole"], intact, clean)
    assert ({}, {}) == (damaged, cut)
    assert "__0_1.distcp from rank 0 arrived damaged" in wrong
    assert "rank 0's save failed: its stream was cut short" in cut_short


_DIES_STREAMING = textwrap.dedent(
    """
    import json, os, sys
    import torch, torch.distributed as dist
    import agent.client.peer._stream as evacuate_stream
    from agent.client.dcp._commit import Ranks
    from agent.client.peer.evacuate import Evacuation
    from agent.client.peer.ramtier import RamTier

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ranks = Ranks()
    stream = dist.new_group(backend="gloo")
    dies = sys.argv[3] == "dies"
    if rank == 1 and dies:  # the notified rank dies once its shard file is open and a first piece went
        original, frames = evacuate_stream.send_piece, [0]

        def die(*args):
            frames[0] += 1
            if frames[0] > 2:
                os._exit(9)
            original(*args)

        evacuate_stream.send_piece = die
    tier = RamTier(sys.argv[1 + rank])
    state = {f"w{rank}": torch.arange(1 << 20, dtype=torch.float32), f"v{rank}": torch.ones(1000) * rank}
    threads = 1 if dies else 2  # two threads: the notified rank streams two files at once
    try:
        evacuation = Evacuation(ranks, ranks.group, tier, "dies", thread_count=threads, stream=stream)
        outcome = str(evacuation.run(1, 0, state, noticed={1}).path)
    except Exception as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    print(json.dumps({"outcome": outcome, "steps": tier.job("dies")["steps"]}), flush=True)
    if dies:
        os._exit(0)  # its peer is gone: no clean shutdown of the group
    dist.destroy_process_group()
    """
)


async def _two_hosts_evacuate(
    tmp_path: Path, mode: str
) -> tuple[list[Any], list[dict[str, Any]], dict[str, bytes], list[str]]:
    """Two hosts with their agents and one rank each, rank 1's host noticed, launched without torchrun (whose
    agent would stop the survivor when a rank dies): (the exit codes, what each rank printed, host 0's
    RAM tier)."""
    script = tmp_path / "evacuate.py"
    script.write_text(_DIES_STREAMING)
    async with tier_agent() as (sock_a, ram_a), tier_agent() as (sock_b, ram_b):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        env = {**os.environ, "PYTHONPATH": str(REPO), "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2"}  # fmt: skip
        pipe = asyncio.subprocess.PIPE
        args = (sys.executable, str(script), str(sock_a), str(sock_b), mode)
        procs = [
            await asyncio.create_subprocess_exec(*args, env={**env, "RANK": str(r)}, stdout=pipe, stderr=pipe)
            for r in (0, 1)
        ]
        outs = [await asyncio.wait_for(proc.communicate(), 100) for proc in procs]
        reports = [json.loads((out.decode().strip().splitlines() or ["{}"])[-1]) for out, _ in outs]
        held = {p.name: p.read_bytes() for p in (ram_a / str(os.getuid()) / "dies" / "1").glob("*")}
        left = list(ram_b.glob(f"{os.getuid()}/dies/*/*"))
    assert [] == left, left  # the notified host keeps nothing
    codes = [proc.returncode for proc in procs]
    return codes, reports, held, [err.decode()[-3000:] for _, err in outs]


@pytest.mark.slow
@pytest.mark.torch_mp
@pytest.mark.timeout(120)
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
async def test_a_notified_rank_writing_with_two_threads_streams_both_files_and_dcp_loads_the_step(
    tmp_path: Path,
) -> None:
    """The notified rank's DCP writer with two threads streams two shard files at once; the buddy holds all
    four files (its own two, the streamed two, .metadata), committed with their CRC32s, and DCP loads every
    tensor of both ranks from its RAM tier."""
    from torch.distributed.checkpoint import load as dcp_load
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    codes, reports, held, errs = await _two_hosts_evacuate(tmp_path, "two_threads")
    assert [0, 0] == codes, errs
    assert [True, True] == [r["outcome"].endswith("dies/1") for r in reports], reports
    tier = json.loads(held["tier.json"])
    assert {"__0_0.distcp", "__0_1.distcp", "__1_0.distcp", "__1_1.distcp", ".metadata"} == set(tier["files"])
    assert all(zlib.crc32(held[n]) == e["crc32"] for n, e in tier["files"].items())
    step = tmp_path / "step"
    step.mkdir()
    for name, data in held.items():
        (step / name).write_bytes(data)
    into = {k: torch.zeros(n) for k, n in (("w0", 1 << 20), ("w1", 1 << 20), ("v0", 1000), ("v1", 1000))}
    dcp_load(into, storage_reader=FileSystemReader(step), no_dist=True)
    assert (float(into["w1"][-1]), float(into["v1"].sum()), float(into["v0"].sum())) == (
        (1 << 20) - 1,
        1000,
        0,
    )


@pytest.mark.slow
@pytest.mark.torch_mp
@pytest.mark.timeout(120)
async def test_a_sender_that_dies_mid_stream_leaves_its_buddy_with_an_error_and_nothing_committed(
    tmp_path: Path,
) -> None:
    """The notified rank dies in the middle of streaming its shard: the buddy's evacuation raises the
    group's error (it does not wait for the rest, and it is not a PeerTierUnusable: no durable save is
    tried on a broken group), and nothing is left in its RAM tier."""
    codes, reports, held, errs = await _two_hosts_evacuate(tmp_path, "dies")
    assert [0, 9] == codes, errs
    assert ("RuntimeError", [], {}) == (reports[0]["outcome"].split(":")[0], reports[0]["steps"], held)
