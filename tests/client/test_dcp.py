"""Sharded checkpoints (agent.client.dcp) with real torch.distributed on gloo and examples/sharded_training.py:
a drill under ``preemptd exec -- torchrun`` gives one committed step and 75; 2 → 1 and 1 → 2 ranks resume at
the next step with the same full-state digest; a rank killed mid-save commits nothing; a corrupt or missing
shard is skipped with a warning naming the file; a mismatching model is refused by name before anything is
overwritten; a root the ranks do not share is refused at start-up.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import sys
import textwrap
import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from agent.client import EXIT_PREEMPTED, Checkpoint
from tests.store_fs import fill, small_fs
from tests.support import REPO, http_json, running_agent

__all__ = ["small_fs"]  # the fixture, used by name

torch = pytest.importorskip("torch")

EXAMPLE = REPO / "examples" / "sharded_training.py"
pytestmark = [pytest.mark.slow, pytest.mark.torch_mp, pytest.mark.timeout(240)]


def _env(**extra: str) -> dict[str, str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("PREEMPTD_")}
    environ.update({"PYTHONPATH": str(REPO), "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", **extra})
    return environ


class Run:
    """A training command as a child process; its JSON-lines progress (from every rank) read as it comes."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.events: list[dict[str, Any]] = []
        self.stderr = ""

    @classmethod
    async def start(cls, command: Sequence[str], env: Mapping[str, str] | None = None) -> Run:
        proc = await asyncio.create_subprocess_exec(
            *command, env=dict(env or _env()), cwd=str(REPO),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        return cls(proc)

    async def until(self, event: str, count: int = 1, timeout: float = 120.0) -> None:
        """Until ``count`` progress lines of this kind have been read."""

        async def read() -> None:
            assert self.proc.stdout is not None
            while len(self.of(event)) < count:
                line = await self.proc.stdout.readline()
                if not line:
                    raise AssertionError(f"ended before {count} {event!r}: {await self._stderr()}")
                self._add(line.decode())

        await asyncio.wait_for(read(), timeout)

    async def finish(self, timeout: float = 120.0) -> int:
        out, err = await asyncio.wait_for(self.proc.communicate(), timeout)
        for line in out.decode().splitlines():
            self._add(line)
        self.stderr = err.decode()
        assert self.proc.returncode is not None
        return self.proc.returncode

    async def _stderr(self) -> str:
        return (await self.proc.stderr.read()).decode()[-4000:] if self.proc.stderr else ""

    def _add(self, line: str) -> None:
        if line.startswith("{"):
            self.events.append(json.loads(line))

    def of(self, event: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["event"] == event]


def _example(ranks: int, ckpt: Path, *args: str, exec_: bool = False) -> list[str]:
    wrapper = [sys.executable, "-m", "agent", "exec", "--"] if exec_ else []
    if ranks == 1:
        launcher = [sys.executable]
    else:
        launcher = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(ranks),
        ]
    return [*wrapper, *launcher, str(EXAMPLE), "--checkpoint-dir", str(ckpt), *args]


async def _interrupted(base: Path, ranks: int, ckpt: Path) -> Run:
    """Train on ``ranks`` ranks under exec and an agent until a drill interrupts."""
    async with running_agent(base):
        sock = base / "a.sock"
        run = await Run.start(
            _example(
                ranks, ckpt, "--steps", "100000", "--step-time", "0.02", "--socket", str(sock), exec_=True
            )
        )
        await run.until("agent_connected", ranks)
        status, body = await http_json(sock, "POST", "/v1/drills", {"kind": "termination", "in_s": 60})
        assert status == 201, body
        await run.finish()
    return run


def _committed(ckpt: Path) -> list[Checkpoint]:
    return [Checkpoint.load(p) for p in sorted(ckpt.glob("step-*"))]


@pytest.mark.parametrize(("before", "after"), [(2, 1), (1, 2)])
async def test_drill_commits_one_step_exits_75_and_resumes_at_another_world_size(
    base: Path, before: int, after: int
) -> None:
    ckpt = base / "ckpt"
    run = await _interrupted(base, before, ckpt)
    saved = run.of("checkpoint")
    [committed] = _committed(ckpt)
    assert EXIT_PREEMPTED == run.proc.returncode, run.stderr[-3000:]
    assert [(committed.step, True, True, before)] * before == [
        (c["step"], c["emergency"], c["before_deadline"], c["world_size"]) for c in saved
    ]
    assert (True, before) == (committed.emergency, committed.metadata["world_size"])

    resumed = await Run.start(
        _example(after, ckpt, "--steps", str(committed.step + 2), "--socket", str(base / "none.sock"))
    )
    assert 0 == await resumed.finish(), resumed.stderr[-3000:]
    starts = resumed.of("resumed")
    assert [(committed.step, after, saved[0]["digest"])] * after == [
        (s["next_step"], s["world_size"], s["digest"]) for s in starts
    ]


_KILL_MID_SAVE = textwrap.dedent(
    """
    # Rank 1 of step 2's save dies (SIGKILL) the moment DCP opens its shard file for writing.
    import os, runpy, signal, sys
    target = int(os.environ["KILL_AT_STEP"])
    def hook(event, args):
        if event == "open" and os.environ.get("RANK") == "1" and STEP[0] == target:
            path = str(args[0])
            if "/.tmp-" in path and path.endswith(".distcp"):
                os.kill(os.getpid(), signal.SIGKILL)
    STEP = [0]
    import agent.client.dcp as dcp
    save = dcp.ShardedStore.save
    def counting(self, step, *a, **k):
        STEP[0] = step
        return save(self, step, *a, **k)
    dcp.ShardedStore.save = counting
    sys.addaudithook(hook)
    sys.argv = [sys.argv[1], *sys.argv[2:]]
    runpy.run_path(sys.argv[0], run_name="__main__")
    """
)


async def test_a_rank_killed_mid_save_commits_nothing_and_resume_uses_the_previous_step(
    base: Path, tmp_path: Path
) -> None:
    ckpt = base / "ckpt"
    wrapper = tmp_path / "kill_mid_save.py"
    wrapper.write_text(_KILL_MID_SAVE)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    run = await Run.start(
        [*torchrun, str(wrapper), str(EXAMPLE), "--checkpoint-dir", str(ckpt), "--steps", "5",
         "--interval-s", "0.001", "--keep", "0", "--socket", str(base / "none.sock")],
        env=_env(KILL_AT_STEP="2"),
    )  # fmt: skip
    code = await run.finish()
    # rank 1 died by SIGKILL inside step 2's save; step 1 is the only committed step
    assert (True, True, [1]) == (code != 0, "SIGKILL" in run.stderr, [c.step for c in _committed(ckpt)])

    resumed = await Run.start(_example(1, ckpt, "--steps", "2", "--socket", str(base / "none.sock")))
    assert 0 == await resumed.finish(), resumed.stderr[-3000:]
    [start] = resumed.of("resumed")
    assert (1, run.of("checkpoint")[0]["digest"]) == (start["next_step"], start["digest"])
    assert [] == [p.name for p in ckpt.iterdir() if p.name.startswith(".tmp-")]  # nothing half-saved left


async def test_a_drill_on_a_full_disk_exits_75_with_the_earlier_step_and_resumes_from_it(
    base: Path, small_fs: Path
) -> None:
    """Step 1 fits; the disk is then full, so the emergency save fails on both ranks with a CheckpointError
    (not torch's CheckpointException): the notice is handled with step 1, exec exits 75."""
    ckpt = small_fs / "ckpt"
    nowhere = str(base / "none.sock")
    first = await Run.start(_example(2, ckpt, "--steps", "1", "--interval-s", "0.001", "--socket", nowhere))
    assert 0 == await first.finish(), first.stderr[-3000:]
    async with running_agent(base):
        sock = base / "a.sock"
        run = await Run.start(
            _example(2, ckpt, "--steps", "100000", "--step-time", "0.02", "--socket", str(sock), exec_=True)
        )
        await run.until("agent_connected", 2)
        fill(small_fs)  # the disk fills up while the job trains
        status, body = await http_json(sock, "POST", "/v1/drills", {"kind": "termination", "in_s": 60})
        assert status == 201, body
        await run.finish()
    full = [(p["step"], "no space left on the file system" in p["error"]) for p in run.of("preempted")]
    assert (EXIT_PREEMPTED, [(1, True)] * 2) == (run.proc.returncode, full), run.stderr[-3000:]
    assert [1] == [c.step for c in _committed(ckpt)]
    (small_fs / "filler").unlink()
    resumed = await Run.start(_example(1, ckpt, "--steps", "1", "--socket", nowhere))
    assert 0 == await resumed.finish(), resumed.stderr[-3000:]
    [start] = resumed.of("resumed")
    assert (1, first.of("checkpoint")[-1]["digest"]) == (start["next_step"], start["digest"])


@pytest.fixture(scope="module")
def two_steps() -> Iterator[Path]:
    """Periodic checkpoints of steps 1 and 2 from two ranks (with CRCs), shared by the damage tests."""
    root = Path(__import__("tempfile").mkdtemp(prefix="pd-dcp-"))
    ckpt = root / "ckpt"

    async def make() -> int:
        run = await Run.start(
            _example(2, ckpt, "--steps", "2", "--interval-s", "0.001", "--keep", "0", "--socket",
                     str(root / "none.sock"))
        )  # fmt: skip
        code = await run.finish()
        assert 0 == code, run.stderr[-3000:]
        return code

    asyncio.run(make())
    yield ckpt
    shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("damage", ["corrupt", "missing"])
async def test_a_damaged_shard_skips_its_step_with_a_warning_naming_the_file(
    two_steps: Path, tmp_path: Path, damage: str
) -> None:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(two_steps, ckpt)
    shard = ckpt / "step-000000000002" / "__1_0.distcp"
    if damage == "corrupt":
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    else:
        shard.unlink()
    resumed = await Run.start(_example(1, ckpt, "--steps", "1", "--socket", str(tmp_path / "none.sock")))
    assert 0 == await resumed.finish(), resumed.stderr[-3000:]
    why = "checksum mismatch" if damage == "corrupt" else "missing"
    [start] = resumed.of("resumed")
    assert (1, True) == (start["next_step"], f"{shard}: {why}" in resumed.stderr), resumed.stderr[-3000:]


async def test_a_model_that_does_not_match_is_refused_by_name_and_nothing_is_overwritten(
    two_steps: Path, tmp_path: Path
) -> None:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(two_steps, ckpt)
    before = {p.relative_to(ckpt): p.read_bytes() for p in ckpt.rglob("*") if p.is_file()}
    run = await Run.start(
        _example(1, ckpt, "--steps", "4", "--width", "48", "--interval-s", "0.001", "--socket",
                 str(tmp_path / "none.sock"))
    )  # fmt: skip
    code = await run.finish()
    after = {p.relative_to(ckpt): p.read_bytes() for p in ckpt.rglob("*") if p.is_file()}
    assert (True, [], True) == (code != 0, run.of("checkpoint"), before == after)
    assert "does not match" in run.stderr and "train.model.embed.weight" in run.stderr, run.stderr[-3000:]
    assert "torch.Size([64, 32])" in run.stderr and "torch.Size([64, 48])" in run.stderr


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_a_root_the_ranks_do_not_share_is_refused_before_training(tmp_path: Path) -> None:
    """Each rank sees its own directory at the checkpoint path (as with a local disk on every host)."""
    port = str(_free_port())
    runs = []
    for rank in (0, 1):
        env = _env(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=port)  # fmt: skip
        command = _example(
            1, tmp_path / f"local-{rank}", "--steps", "2", "--socket", str(tmp_path / "x.sock")
        )
        runs.append(await Run.start(command, env))
    codes = [await run.finish() for run in runs]
    assert ([True, True], []) == ([c != 0 for c in codes], [e for r in runs for e in r.events])
    assert all("is not shared between the ranks: rank 1" in r.stderr for r in runs), runs[0].stderr[-3000:]


async def test_async_periodic_saves_commit_in_the_background_and_resume_alike(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    nowhere = str(tmp_path / "none.sock")
    run = await Run.start(
        _example(2, ckpt, "--steps", "4", "--interval-s", "0.001", "--async-saves", "--socket", nowhere)
    )
    assert 0 == await run.finish(), run.stderr[-3000:]
    staged = {c["step"]: c["digest"] for c in run.of("checkpoint")}
    resumed = await Run.start(_example(1, ckpt, "--steps", "4", "--socket", nowhere))
    assert 0 == await resumed.finish(), resumed.stderr[-3000:]
    [start] = resumed.of("resumed")
    assert ([2, 3, 4], [1, 2, 3, 4]) == ([c.step for c in _committed(ckpt)], sorted(staged))
    assert (4, staged[4], 2) == (start["next_step"], start["digest"], start["saved_world_size"])


# -- in this process, a group of one: the deadline budget and the rule for a notice during a background save


@pytest.fixture
def group_of_one() -> Iterator[None]:
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _state(size: int = 1 << 16) -> dict[str, Any]:
    return {"weights": torch.arange(size, dtype=torch.float32)}


@pytest.mark.timeout(60)
def test_budget_predicts_from_earlier_saves_and_flags_a_miss(group_of_one: None, tmp_path: Path) -> None:
    from datetime import datetime, timedelta, timezone

    from agent.client.dcp import ShardedStore

    store = ShardedStore(tmp_path / "ckpt", report=False)
    store.save(1, _state())
    first = store.last_budget
    now = datetime.now(timezone.utc)
    store.save(2, _state(), emergency=True, deadline=now + timedelta(hours=1))
    ample = store.last_budget
    store.save(3, _state(), emergency=True, deadline=now - timedelta(seconds=1))
    late = store.last_budget
    assert first is not None and ample is not None and late is not None
    assert (None, False) == (first.predicted_s, first.predicted_miss)
    assert (True, False, True) == (ample.predicted_s is not None, ample.predicted_miss, late.predicted_miss)
    assert [1, 2, 3] == sorted(store.steps())


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("deadline_s", "served_step"), [(3600.0, 2), (-1.0, 3)])
def test_a_notice_during_a_background_save_waits_for_it_only_when_it_ends_in_time(
    group_of_one: None, tmp_path: Path, deadline_s: float, served_step: int
) -> None:
    """Recent and predicted to end before the deadline: that save is the emergency checkpoint; otherwise an
    emergency save of the new step starts at once."""
    from datetime import datetime, timedelta, timezone

    from agent.client.dcp import ShardedStore

    store = ShardedStore(tmp_path / "ckpt", report=False)
    store.save(1, _state())  # something to predict from
    pending = store.save_async(2, _state())
    deadline = datetime.now(timezone.utc) + timedelta(seconds=deadline_s)
    served = store.save(3, _state(), emergency=True, notice_id="n-1", deadline=deadline)
    store.close()
    committed = {c.step: c for c in _committed(tmp_path / "ckpt")}
    assert (served_step, 2, [1, 2, 3][:served_step]) == (served.step, pending.step, sorted(committed))


def test_reports_carry_the_flush_budget_and_bad_values_are_refused() -> None:
    from datetime import datetime, timezone

    from agent.core.reports import ReportError, parse_report

    now = datetime.now(timezone.utc)
    doc = {"kind": "checkpoint", "phase": "started", "step": 3, "emergency": True,
           "flush": {"sharded": True, "world_size": 8, "predicted_s": 41.5, "time_left_s": 30.0,
                     "predicted_miss": True, "async": None, "future_key": 1}}  # fmt: skip
    report = parse_report(doc, now)
    assert {"sharded": True, "world_size": 8, "predicted_s": 41.5, "time_left_s": 30.0,
            "predicted_miss": True} == dict(report.flush)  # fmt: skip
    with pytest.raises(ReportError, match=r"flush\.world_size"):
        parse_report({**doc, "flush": {"world_size": "8"}}, now)


@pytest.mark.timeout(60)
async def test_a_save_predicted_to_miss_its_deadline_shows_in_status_before_it_ends(
    group_of_one: None, base: Path
) -> None:
    from datetime import datetime, timedelta, timezone

    from agent.cli import format_status
    from agent.client import Reporter
    from agent.client.dcp import ShardedStore

    async with running_agent(base):
        sock = base / "a.sock"
        reporter = Reporter(sock)
        store = ShardedStore(base / "ckpt", reporter=reporter)
        await asyncio.to_thread(store.save, 1, _state())
        late = datetime.now(timezone.utc) - timedelta(seconds=1)
        await asyncio.to_thread(store.save, 2, _state(), emergency=True, notice_id="n-9", deadline=late)
        assert await asyncio.to_thread(reporter.flush, 10.0)
        status, doc = await http_json(sock, "GET", "/v1/status")
        await asyncio.to_thread(store.close)
    risk = doc["flush_risk"]
    assert (200, 2, "n-9", 0.0, "finished") == (
        status, risk["step"], risk["notice_id"], risk["time_left_s"], risk["outcome"]["phase"],
    )  # fmt: skip
    assert "Flush at risk: step 2 predicted to take" in format_status(doc)


@pytest.mark.timeout(60)
def test_torch_zip_crc_is_off_only_while_the_store_writes_and_the_step_loads_and_verifies(
    group_of_one: None, tmp_path: Path
) -> None:
    """The store's own CRC32 is what a resume checks, so torch's per-record CRC is skipped while the store
    writes, on the writing thread only, and restored after."""
    from torch import serialization
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    from agent.client.dcp import ShardedStore
    from agent.client.dcp._commit import zip_crc_off

    store = ShardedStore(tmp_path / "ckpt", report=False)
    seen: list[bool] = []

    def write(directory: Path) -> None:
        seen.append(serialization.get_crc32_options())
        dcp_save(_state(), checkpoint_id=directory, process_group=store.group)

    store.save_files(1, write)
    other: list[bool] = []
    with zip_crc_off():
        thread = threading.Thread(target=lambda: other.append(serialization.get_crc32_options()))
        thread.start()
        thread.join()
    latest = store.latest()
    assert latest is not None
    loaded = {"weights": torch.zeros(1 << 16)}
    dcp_load(loaded, checkpoint_id=latest.path, process_group=store.group)
    store.close()
    assert ([False], [True], True, "crc32", True) == (
        seen,
        other,
        serialization.get_crc32_options(),
        Checkpoint.load(latest.path).files[0].crc32 is not None and "crc32",
        torch.equal(_state()["weights"], loaded["weights"]),
    )
