"""Drains are bounded (security issue "Trust II": a hostile second user on the host, the agent root): a drain
child its user stopped is killed at its deadline and the step stays in RAM; one job's stuck drain never holds
up another job's; a job's drains run one at a time, in order; a claim another user planted in a shared durable
root is skipped, never waited for. Real agents, real drain children, real uids (the tests run as root)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import stat
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from structlog.testing import capture_logs

from agent.checkpoint.manifest import Checkpoint
from agent.client.peer.ramtier import write_tier_file
from agent.ramtier.drain import (
    CLAIM_NAMES,
    CLAIM_STALE_S,
    DrainError,
    claim_file,
    claim_names,
    drain,
    final_dir,
)
from agent.ramtier.drains import STOPPED, Drain, deadline
from tests.ramtier.support import as_user, tier_agent, write_step

as_others = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as other users")

USER = 65534  # the job's user
OTHER = 65533  # another user of the host: the hostile one
STEP = 5
STATE = os.urandom(200_000)
OPEN = {"socket_mode": 0o666}  # other users reach the agent's socket


@pytest.fixture
def base(base: Path) -> Iterator[Path]:
    """The test's directory, which the other users may traverse (the agent's socket is in it)."""
    os.chmod(base, 0o755)
    yield base


def connected(path: Path, uid: int) -> socket.socket:
    """A client socket of ``uid`` (and its gid: SO_PEERCRED records both at connect)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with as_user(uid):
        sock.connect(str(path))
    return sock


async def ask(path: Path, uid: int, method: str, target: str, body: Any = None) -> tuple[int, Any]:
    """One HTTP request to the agent as ``uid``: its status and JSON answer."""
    reader, writer = await asyncio.open_unix_connection(sock=connected(path, uid))
    raw = json.dumps(body).encode()
    head = f"{method} {target} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: {len(raw)}\r\n\r\n"
    writer.write(head.encode() + raw)
    answer = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    await writer.wait_closed()
    top, _, payload = answer.partition(b"\r\n\r\n")
    return int(top.split()[1]), json.loads(payload)


async def hold(
    agent: Any, uid: int, job: str, durable: Path, step: int = STEP, full: bool = True
) -> tuple[int, Any]:
    """What a job's client does as ``uid``: reserve, write the step (full-state, as PeerCheckpointStore
    writes it, or a one-rank sharded step), commit naming the durable root; the commit's status and answer."""
    sock = agent.config.socket
    status, res = await ask(
        sock, uid, "POST", f"/v1/ram-tier/jobs/{job}/reserve", {"step": step, "bytes": 300_000}
    )
    assert 200 == status, res
    with as_user(uid):
        if full:
            (Path(res["path"]) / "state.pt").write_bytes(STATE)
            files = {"state.pt": {"size": len(STATE), "crc32": zlib.crc32(STATE), "rank": 0}}
            write_tier_file(
                Path(res["path"]), job=job, step=step, run=1, world_size=2, files=files, complete=True,
                extra={"layout": "full", "step_files": {"state.pt": len(STATE)}},
            )  # fmt: skip
        else:
            write_step(Path(res["path"]), step, {"__0_0.distcp": b"tensor", ".metadata": b"meta"}, job=job)
    body = {"reservation": res["reservation"], "durable_root": str(durable)}
    return await ask(sock, uid, "POST", f"/v1/ram-tier/jobs/{job}/steps/{step}/commit", body)


async def until(what: Callable[[], bool], timeout: float = 30.0) -> None:
    """Wait, polling, until ``what()`` holds (at most ``timeout`` seconds)."""
    end = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < end, "timed out waiting"
        await asyncio.sleep(0.05)


def owned_dir(path: Path, uid: int, mode: int = 0o755) -> Path:
    path.mkdir()
    os.chown(path, uid, uid)
    os.chmod(path, mode)
    return path


def plant(path: Path, uid: int, text: str = '{"host": "elsewhere"}') -> None:
    with as_user(uid):
        path.write_text(text)


async def stuck(
    agent: Any, tier: Any, uid: int, job: str, durable: Path, step: int = STEP
) -> tuple[Drain, int]:
    """A full-state drain whose child its user stopped (SIGSTOP) while it waited for a claim of the job's own;
    the claim is then released, so only the stop holds the drain. The drain and its child's pid."""
    claim = claim_file(durable, step)
    plant(claim, uid)
    status, answer = await hold(agent, uid, job, durable, step)
    assert 200 == status, answer
    record: Drain = tier.drains.records[(uid, job, step)]
    await until(lambda: record.claimed_by == "elsewhere" and record.pid is not None)
    pid = record.pid
    assert pid is not None
    with as_user(uid):  # the job's user stops its own drain
        os.kill(pid, signal.SIGSTOP)
    await until(lambda: psutil.Process(pid).status() == psutil.STATUS_STOPPED)
    claim.unlink()  # a running child would take the claim and commit now
    return record, pid


def gone(pid: int) -> bool:
    """The process exited and was reaped (waited for: not even a zombie is left)."""
    return not psutil.pid_exists(pid)


@pytest.mark.slow
@as_others
async def test_a_stopped_drain_child_is_killed_at_its_deadline_and_the_step_stays_in_ram(base: Path) -> None:
    durable = owned_dir(base / "durable", USER)
    with capture_logs() as logs:
        async with tier_agent(base, agent_settings=OPEN, drain_timeout_s=5) as (agent, tier):
            record, pid = await stuck(agent, tier, USER, "job-a", durable)
            await asyncio.wait_for(record.done.wait(), 30)
            _, job = await ask(agent.config.socket, USER, "GET", "/v1/ram-tier/jobs/job-a")
    failed = [e for e in logs if e["event"] == "ram_tier_drain_failed"]
    assert ("failed", True) == (record.state, gone(pid))
    assert (
        "the drain did not finish within 5 s (ram_tier.drain_timeout_s): stopped, hung or too slow, its child "
        f"(pid {pid}) was killed; nothing was committed by this host, the step stays in RAM"
    ) == record.error
    assert [record.error] == [e["error"] for e in failed]
    assert [STEP] == [s["step"] for s in job["steps"]]
    assert not final_dir(durable, STEP).exists()


@as_others
async def test_one_jobs_stopped_drain_does_not_hold_up_another_jobs(base: Path) -> None:
    """Job A (one uid) is stuck in its drain, its deadline far off; job B (another uid) drains and commits."""
    durable_a = owned_dir(base / "a", USER)
    durable_b = owned_dir(base / "b", OTHER)
    async with tier_agent(base, agent_settings=OPEN) as (agent, tier):
        record_a, pid = await stuck(agent, tier, USER, "job-a", durable_a)
        await hold(agent, OTHER, "job-b", durable_b, full=False)
        record_b: Drain = tier.drains.records[(OTHER, "job-b", STEP)]
        await asyncio.wait_for(record_b.done.wait(), 30)
        a_then = (record_a.state, record_a.done.is_set(), psutil.Process(pid).status())
    assert ("committed", str(final_dir(durable_b, STEP))) == (record_b.state, record_b.path)
    assert ("copying", False, psutil.STATUS_STOPPED) == a_then


@as_others
async def test_a_jobs_drains_run_one_at_a_time_in_order(base: Path) -> None:
    """Job A's step 6 stays queued while A's step 5 is stuck, though another job's drain runs meanwhile; once
    step 5 goes on (SIGCONT) and commits, step 6 starts."""
    durable = owned_dir(base / "a", USER)
    other = owned_dir(base / "b", OTHER)
    with capture_logs() as logs:
        async with tier_agent(base, agent_settings=OPEN) as (agent, tier):
            first, pid = await stuck(agent, tier, USER, "job-a", durable)
            await hold(agent, USER, "job-a", durable, step=6, full=False)
            await hold(agent, OTHER, "job-b", other, full=False)
            await asyncio.wait_for(tier.drains.records[(OTHER, "job-b", STEP)].done.wait(), 30)
            second: Drain = tier.drains.records[(USER, "job-a", 6)]
            while_stuck = (first.state, second.state)
            os.kill(pid, signal.SIGCONT)
            await asyncio.wait_for(second.done.wait(), 30)
    order = [
        (e["event"], e["step"])
        for e in logs
        if e["event"] in ("ram_tier_drain_started", "ram_tier_drain_committed") and e["job"] == "job-a"
    ]
    assert ("copying", "queued") == while_stuck
    assert ("committed", "committed") == (first.state, second.state)
    assert [
        ("ram_tier_drain_started", STEP),
        ("ram_tier_drain_committed", STEP),
        ("ram_tier_drain_started", 6),
        ("ram_tier_drain_committed", 6),
    ] == order


@as_others
async def test_a_turn_that_frees_goes_to_a_user_with_no_drain_running_first(base: Path) -> None:
    """One user's two jobs hold both turns, stuck; that user's third job, then another user's, queue. When
    one of the first user's drains ends, the free turn goes to the other user's drain, not to the older third
    job of a user whose drain is still stuck."""
    durable = [owned_dir(base / name, USER) for name in ("a", "b", "c")]
    other = owned_dir(base / "o", OTHER)
    with capture_logs() as logs:
        async with tier_agent(base, agent_settings=OPEN) as (agent, tier):
            await stuck(agent, tier, USER, "job-a", durable[0])
            _, pid_b = await stuck(agent, tier, USER, "job-b", durable[1])
            await hold(agent, USER, "job-c", durable[2], full=False)
            await hold(agent, OTHER, "job-o", other, full=False)
            mine: Drain = tier.drains.records[(USER, "job-c", STEP)]
            theirs: Drain = tier.drains.records[(OTHER, "job-o", STEP)]
            queued = (mine.state, theirs.state)
            os.kill(pid_b, signal.SIGCONT)  # job-b's drain goes on and commits: a turn frees
            await asyncio.wait_for(asyncio.gather(theirs.done.wait(), mine.done.wait()), 30)
    started = [e["job"] for e in logs if e["event"] == "ram_tier_drain_started"]
    assert ("queued", "queued") == queued
    assert ["job-a", "job-b", "job-o", "job-c"] == started
    assert ("committed", "committed") == (theirs.state, mine.state)


@as_others
async def test_stopping_the_agent_kills_a_stopped_drain_child(base: Path) -> None:
    durable = owned_dir(base / "durable", USER)
    async with tier_agent(base, agent_settings=OPEN) as (agent, tier):
        record, pid = await stuck(agent, tier, USER, "job-a", durable)
    assert ("failed", STOPPED, True) == (record.state, record.error, gone(pid))


@as_others
async def test_a_claim_another_user_planted_in_a_shared_root_is_skipped_and_the_step_committed(
    base: Path,
) -> None:
    """In a shared 1777 root, another user's fresh file under the step's claim name is never waited for (not
    even for the stale time): the drain claims the next name and commits; the status and the log name the
    skipped claim's owner."""
    shared = owned_dir(base / "shared", 0, 0o1777)
    planted = claim_file(shared, STEP)
    plant(planted, OTHER)
    started = time.monotonic()
    with capture_logs() as logs:
        async with tier_agent(base, agent_settings=OPEN) as (agent, tier):
            await hold(agent, USER, "job-a", shared)
            record: Drain = tier.drains.records[(USER, "job-a", STEP)]
            await asyncio.wait_for(record.done.wait(), 30)
            status = tier.status()["drains"][f"{USER}/job-a/{STEP}"]
    took = time.monotonic() - started
    skipped = [e for e in logs if e["event"] == "ram_tier_drain_claim_skipped"]
    assert ("committed", False, None) == (record.state, record.already, record.error)
    assert [f"{planted}: owned by uid {OTHER}, not by the job's uid {USER}: untrusted, skipped"] == status[
        "skipped_claims"
    ]
    assert [(str(planted), OTHER)] == [(e["claim"], e["owner"]) for e in skipped]
    assert took < CLAIM_STALE_S
    assert STATE == (final_dir(shared, STEP) / "state.pt").read_bytes()
    assert (OTHER, [planted.name, final_dir(shared, STEP).name]) == (
        planted.stat().st_uid,
        sorted(p.name for p in shared.iterdir()),
    )  # the planted file is left alone; the drain's own claim (the next name) is gone with its drain


@as_others
async def test_a_drain_whose_every_claim_name_another_user_holds_fails_at_once_naming_them(
    base: Path,
) -> None:
    shared = owned_dir(base / "shared", 0, 0o1777)
    for name in claim_names(shared, STEP):
        plant(name, OTHER)
    started = time.monotonic()
    async with tier_agent(base, agent_settings=OPEN) as (agent, tier):
        await hold(agent, USER, "job-a", shared)
        record: Drain = tier.drains.records[(USER, "job-a", STEP)]
        await asyncio.wait_for(record.done.wait(), 30)
        _, job = await ask(agent.config.socket, USER, "GET", "/v1/ram-tier/jobs/job-a")
    took = time.monotonic() - started
    assert "failed" == record.state
    assert (
        f"DrainError: every claim name of this step in {shared} is held by another user or is not a file: "
        in str(record.error)
    )
    assert CLAIM_NAMES == str(record.error).count(f"owned by uid {OTHER}, not by the job's uid {USER}")
    assert "nothing was drained, the step stays in RAM" in str(record.error)
    assert took < CLAIM_STALE_S
    assert ([STEP], False) == ([s["step"] for s in job["steps"]], final_dir(shared, STEP).exists())


# ----- the child's program alone (in this process, as root) -----


def _plan(source: Path, durable: Path) -> dict[str, Any]:
    files = {"state.pt": {"size": len(STATE), "crc32": zlib.crc32(STATE), "rank": 0}}
    return {
        "layout": "full", "source": str(source), "durable_root": str(durable), "step": STEP, "run": 0,
        "world_size": 2, "files": files, "step_files": {"state.pt": len(STATE)}, "host": "h",
    }  # fmt: skip


def test_a_link_in_place_of_a_claim_is_skipped_never_followed(tmp_path: Path) -> None:
    source, durable = tmp_path / "ram", tmp_path / "durable"
    source.mkdir()
    durable.mkdir()
    (source / "state.pt").write_bytes(STATE)
    victim = tmp_path / "victim"
    victim.write_text("keep")
    claim_file(durable, STEP).symlink_to(victim)
    said: list[dict[str, Any]] = []
    outcome = drain(_plan(source, durable), said.append)
    assert ("committed", "keep", True) == (
        outcome["state"],
        victim.read_text(),
        claim_file(durable, STEP).is_symlink(),
    )
    assert [f"a link owned by uid {os.geteuid()}, not a claim (never followed)"] == [
        d["skipped_claim"]["why"] for d in said if "skipped_claim" in d
    ]
    Checkpoint.load(final_dir(durable, STEP)).verify("checksum")


def test_a_step_file_that_is_a_link_is_not_read(tmp_path: Path) -> None:
    source, durable = tmp_path / "ram", tmp_path / "durable"
    source.mkdir()
    durable.mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_bytes(STATE)
    (source / "state.pt").symlink_to(elsewhere)
    with pytest.raises(DrainError) as caught:
        drain(_plan(source, durable), lambda doc: None)
    assert f"{source / 'state.pt'} is a link" in str(caught.value)
    assert not final_dir(durable, STEP).exists()


def test_a_fifo_in_place_of_a_step_file_is_refused_without_blocking(tmp_path: Path) -> None:
    source, durable = tmp_path / "ram", tmp_path / "durable"
    source.mkdir()
    durable.mkdir()
    os.mkfifo(source / "state.pt")
    with pytest.raises(DrainError) as caught:
        drain(_plan(source, durable), lambda doc: None)
    assert f"{source / 'state.pt'} is not a regular file" in str(caught.value)
    assert stat.S_ISFIFO(os.lstat(source / "state.pt").st_mode)


@pytest.mark.parametrize(
    ("nbytes", "timeout_s", "rate_mb_s", "expected"),
    [
        (0, 0.0, 200.0, 90.0),  # the allowance and the claim's stale time
        (10**9, 0.0, 200.0, 130.0),  # twice the bytes at 50 MB/s, not the faster 200
        (10**9, 0.0, 10.0, 290.0),  # at the configured rate when it is slower
        (10**9, 0.0, 0.0, 130.0),  # no rate limit: 50 MB/s
        (10**12, 45.0, 200.0, 45.0),  # drain_timeout_s wins
    ],
)
def test_a_drains_deadline(nbytes: int, timeout_s: float, rate_mb_s: float, expected: float) -> None:
    assert expected == pytest.approx(deadline(nbytes, timeout_s, rate_mb_s)[0])
