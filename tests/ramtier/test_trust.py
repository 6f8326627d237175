"""The RAM tier against a hostile second user on the agent's socket (issue "Trust II"): a real agent running as
root with its tier in a temporary directory, and throwaway uids playing the job's own user and an intruder.
Each case is an attack that worked before; its outcome now is a refusal or a clear error, and nothing is read
for the attacker, written for it, or lost to it. Needs root (it acts as other users)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
import zlib
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from tests.ramtier.support import JOB, as_user, connect_as, request_as, tier_agent, write_step
from tests.support import http_json

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as other users")

VICTIM = 65534
INTRUDER = 65533
OPEN = {"socket_mode": 0o666}
# The job's user runs programs too; the project's virtual environment may be out of its reach.
SYSTEM_PYTHON = shutil.which("python3", path="/usr/bin:/bin") or sys.executable


@pytest.fixture
def base(base: Path) -> Path:
    os.chmod(base, 0o755)  # the job users reach their directories in the tier under it
    return base


async def raw_as(sock: Path, uid: int, method: str, target: str) -> tuple[int, bytes]:
    """One request as ``uid``; the status and the body's raw bytes."""
    reader, writer = await asyncio.open_unix_connection(sock=connect_as(sock, uid))
    writer.write(f"{method} {target} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    body = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    await writer.wait_closed()
    return int(head.split()[1]), body


async def hold_as(sock: Path, uid: int, step: int, files: dict[str, bytes], job: str = JOB) -> Path:
    """``uid`` reserves, writes (as itself) and commits a step; its directory."""
    need = sum(map(len, files.values()))
    status, res = await request_as(
        sock, uid, "POST", f"/v1/ram-tier/jobs/{job}/reserve", {"step": step, "bytes": need}
    )
    assert 200 == status, res
    with as_user(uid):
        write_step(Path(res["path"]), step, files, job)
    status, answer = await request_as(
        sock, uid, "POST", f"/v1/ram-tier/jobs/{job}/steps/{step}/commit", {"reservation": res["reservation"]}
    )
    assert 200 == status, answer
    return Path(res["path"])


SWAPPER = """
import os, sys, time
step, name, secret, seconds = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
real, link = os.path.join(step, ".real"), os.path.join(step, ".link")
os.link(os.path.join(step, name), real)
os.symlink(secret, link)
end = time.monotonic() + seconds
swaps = 0
print("ready", flush=True)
while time.monotonic() < end:
    os.rename(link, os.path.join(step, name)); os.symlink(secret, link)
    os.rename(real, os.path.join(step, name)); os.link(os.path.join(step, name), real)
    swaps += 2
print(swaps, flush=True)
"""


@pytest.mark.slow
async def test_a_file_swapped_for_a_link_while_it_is_fetched_never_serves_the_links_target(
    base: Path,
) -> None:
    """Row "fetch race": the job's owner swaps a committed file between its bytes and a link to a file only
    root may read, while fetching it hundreds of times: every answer is the file's own bytes or a 409."""
    data = b"d" * 64
    secret = base / "secret"
    secret.write_bytes(b"S" * 64)  # as long as the file: a size check alone cannot tell them apart
    os.chmod(secret, 0o600)
    async with tier_agent(base, agent_settings=OPEN) as (agent, _):
        sock = agent.config.socket
        step = await hold_as(sock, VICTIM, 1, {"__0_0.distcp": data})
        swapper = await asyncio.create_subprocess_exec(
            SYSTEM_PYTHON, "-c", SWAPPER, str(step), "__0_0.distcp", str(secret), "60",
            user=VICTIM, group=VICTIM, stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        assert swapper.stdout is not None
        assert b"ready\n" == await asyncio.wait_for(swapper.stdout.readline(), 30)
        answers = [
            await raw_as(sock, VICTIM, "GET", f"/v1/ram-tier/jobs/{JOB}/steps/1/files/__0_0.distcp")
            for _ in range(400)
        ]
        swapper.kill()
        await swapper.wait()
    served = {body for status, body in answers if status == 200}
    refused = [json.loads(body)["error"] for status, body in answers if status == 409]
    assert set() == served - {data}
    assert 400 == sum(1 for status, _ in answers if status in (200, 409))
    assert refused, "the swap never landed between a check and a read: the race was not exercised"
    assert all("symbolic link" in e or "not in the directory" in e for e in refused), refused[:3]


async def test_a_tier_path_made_by_another_user_is_refused_naming_its_owner_and_mode(base: Path) -> None:
    """Row "pre-made tier path": a user made ram_tier.path (mode 0777) before the tier was turned on."""
    os.mkdir(base / "ram")
    os.chown(base / "ram", VICTIM, VICTIM)
    os.chmod(base / "ram", 0o777)
    with capture_logs() as logs:
        async with tier_agent(base) as (agent, _):
            status, body = await http_json(agent.config.socket, "GET", "/v1/ram-tier")
    assert 503 == status
    assert f"ram_tier.path {base / 'ram'} belongs to uid {VICTIM}, not to the agent's uid 0" in body["error"]
    assert "mode 0777" in body["error"] and "chown 0" in body["error"]
    assert ["ram_tier_unavailable"] == [e["event"] for e in logs if e["event"] == "ram_tier_unavailable"]


@pytest.mark.parametrize(
    ("link", "expected"),
    [
        (False, "is writable by other users (mode 0777, owner uid 0)"),
        (True, "is a symbolic link, not a directory"),
    ],
)
async def test_a_tier_path_that_is_a_link_or_writable_by_others_is_refused(
    base: Path, link: bool, expected: str
) -> None:
    (base / "elsewhere").mkdir()
    if link:
        (base / "ram").symlink_to(base / "elsewhere")
    else:
        (base / "ram").mkdir()
        os.chmod(base / "ram", 0o777)
    async with tier_agent(base) as (agent, _):
        status, body = await http_json(agent.config.socket, "GET", "/v1/ram-tier")
    assert 503 == status
    assert expected in body["error"]
    assert [] == list((base / "elsewhere").iterdir())


async def test_the_tier_and_uid_directories_are_the_agents_and_a_job_cannot_move_its_own_directory(
    base: Path,
) -> None:
    """Row "drain as root": the drain's user came from stat'ing a directory its owner could swap for a link.
    Now the directories above a job's are the agent's (0711), so its user cannot swap its job directory, and
    a step directory swapped for a link is refused at commit."""
    async with tier_agent(base, agent_settings=OPEN) as (agent, _):
        sock = agent.config.socket
        step = await hold_as(sock, VICTIM, 1, {"__0_0.distcp": b"x"})
        status, res = await request_as(
            sock, VICTIM, "POST", f"/v1/ram-tier/jobs/{JOB}/reserve", {"step": 2, "bytes": 1}
        )
        two = Path(res["path"])
        modes = [
            (p.stat().st_uid, oct(p.stat().st_mode & 0o777))
            for p in (base / "ram", step.parents[1], step.parent)
        ]
        with as_user(VICTIM):
            with pytest.raises(PermissionError):
                os.rename(step.parent, step.parent.with_name("moved"))
            os.rmdir(two)
            os.symlink(base, two)  # the commit must not read through it
        committed, answer = await request_as(
            sock,
            VICTIM,
            "POST",
            f"/v1/ram-tier/jobs/{JOB}/steps/2/commit",
            {"reservation": res["reservation"]},
        )
    assert [(0, "0o711"), (0, "0o711"), (VICTIM, "0o700")] == modes
    assert (200, 409) == (status, committed)
    assert "the directory of job job-1 step 2 is not a directory (a link or a file)" in answer["error"]


async def test_another_uid_cannot_reserve_a_job_id_away_from_its_owner(base: Path) -> None:
    """Row "job-id squatting": the intruder reserves the next job ids first; the real job's reserve and
    commit under the same id work, in a directory of its own."""
    async with tier_agent(base, agent_settings=OPEN) as (agent, _):
        sock = agent.config.socket
        for job in ("1001", "1002"):
            status, _ = await request_as(
                sock, INTRUDER, "POST", f"/v1/ram-tier/jobs/{job}/reserve", {"step": 1, "bytes": 1}
            )
            assert 200 == status
        step = await hold_as(sock, VICTIM, 1, {"__0_0.distcp": b"x"}, job="1001")
    assert base / "ram" / str(VICTIM) / "1001" / "1" == step


async def test_one_uid_reserving_everything_free_does_not_starve_another(base: Path) -> None:
    """Row "cap squatting": the intruder takes all free bytes again before each of the victim's eight
    emergency saves; each save gets its room (the intruder's reservations above its fair share are
    revoked), and when the tier is contended the intruder is told 507 as it asks past its share."""
    cap = 8000
    async with tier_agent(base, cap_bytes=cap, agent_settings=OPEN) as (agent, tier):
        sock = agent.config.socket
        got = []
        with capture_logs() as logs:
            for attempt in range(8):
                free = tier.holdings.free_bytes
                squat, _ = await request_as(
                    sock,
                    INTRUDER,
                    "POST",
                    "/v1/ram-tier/jobs/squat/reserve",
                    {"step": attempt, "bytes": free},
                )
                status, _ = await request_as(
                    sock, VICTIM, "POST", f"/v1/ram-tier/jobs/{JOB}/reserve", {"step": attempt, "bytes": 400}
                )
                got.append((squat, status))
                await request_as(sock, VICTIM, "DELETE", f"/v1/ram-tier/jobs/{JOB}/steps/{attempt}")
            await request_as(
                sock, VICTIM, "POST", f"/v1/ram-tier/jobs/{JOB}/reserve", {"step": 50, "bytes": 4000}
            )
            greedy, refused = await request_as(
                sock, INTRUDER, "POST", "/v1/ram-tier/jobs/squat/reserve", {"step": 99, "bytes": 4001}
            )
    assert [(200, 200)] * 8 == got
    assert 507 == greedy
    assert f"uid {INTRUDER} holds" in refused["error"] and "fair share of 4000" in refused["error"]
    revoked = [e for e in logs if e["event"] == "ram_tier_reservation_revoked"]
    assert {(INTRUDER, VICTIM)} == {(e["uid"], e["for_uid"]) for e in revoked}


async def test_bytes_written_into_a_committed_step_count_against_the_cap_and_are_evicted_over_it(
    base: Path,
) -> None:
    """Row "cap is advisory": a step that grows past what was committed counts at once (a reservation that no
    longer fits is refused), and the agent evicts it while the tier is over its cap."""
    cap = 64 * 1024
    async with tier_agent(base, cap_bytes=cap, usage_interval_s=3600, agent_settings=OPEN) as (agent, tier):
        sock = agent.config.socket
        step = await hold_as(sock, VICTIM, 1, {"__0_0.distcp": b"x" * 100})
        with as_user(VICTIM):
            (step / "extra").write_bytes(b"y" * 96 * 1024)
        full, body = await request_as(
            sock, INTRUDER, "POST", "/v1/ram-tier/jobs/j/reserve", {"step": 1, "bytes": 1}
        )
        with capture_logs() as logs:
            evicted = await tier.enforce_cap()
        after, _ = await request_as(
            sock, INTRUDER, "POST", "/v1/ram-tier/jobs/j/reserve", {"step": 1, "bytes": 1024}
        )
        _, listed = await request_as(sock, VICTIM, "GET", f"/v1/ram-tier/jobs/{JOB}")
        gone = not await asyncio.to_thread(step.exists)
    assert (507, 200) == (full, after)
    assert 0 == body["free_bytes"]
    assert "ram tier full: need 1 bytes, free 0 of cap 65536" in body["error"]
    assert [(VICTIM, JOB, 1)] == [(o.uid, o.job, o.step) for o in evicted]
    assert ([], True) == (listed["steps"], gone)
    event = next(e for e in logs if e["event"] == "ram_tier_overrun_evicted")
    assert (VICTIM, JOB, "1") == (event["uid"], event["job"], event["entry"])


async def test_a_fifo_in_place_of_tier_json_or_a_file_is_refused_at_once(base: Path) -> None:
    """Row "FIFO / huge file": a FIFO never holds a worker thread (opened without waiting for a writer, then
    refused as not a regular file)."""
    async with tier_agent(base, agent_settings=OPEN) as (agent, _):
        sock = agent.config.socket
        answers = []
        for step, fifo in ((1, "tier.json"), (2, "__0_0.distcp")):
            _, res = await request_as(
                sock, VICTIM, "POST", f"/v1/ram-tier/jobs/{JOB}/reserve", {"step": step, "bytes": 9}
            )
            path = Path(res["path"])
            with as_user(VICTIM):
                write_step(path, step, {"__0_0.distcp": b"x"})
                os.unlink(path / fifo)
                os.mkfifo(path / fifo)
            answers += [
                await asyncio.wait_for(
                    request_as(
                        sock,
                        VICTIM,
                        "POST",
                        f"/v1/ram-tier/jobs/{JOB}/steps/{step}/commit",
                        {"reservation": res["reservation"]},
                    ),
                    10,
                )
                for _ in range(20)
            ]
    assert [409] * 40 == [status for status, _ in answers]
    assert "tier.json is a FIFO, not a regular file" in answers[0][1]["error"]
    assert "__0_0.distcp is a FIFO, not a regular file" in answers[-1][1]["error"]


async def test_one_uid_may_hold_only_so_many_live_reservations(base: Path) -> None:
    """Row "reservation flood": past ``max_reservations_per_uid`` a uid gets 429 saying why; another uid is
    served as before."""
    async with tier_agent(base, max_reservations_per_uid=5, agent_settings=OPEN) as (agent, _):
        sock = agent.config.socket
        statuses = [
            (
                await request_as(
                    sock, INTRUDER, "POST", "/v1/ram-tier/jobs/f/reserve", {"step": n, "bytes": 0}
                )
            )[0]
            for n in range(6)
        ]
        _, body = await request_as(
            sock, INTRUDER, "POST", "/v1/ram-tier/jobs/f/reserve", {"step": 9, "bytes": 0}
        )
        other, _ = await request_as(
            sock, VICTIM, "POST", f"/v1/ram-tier/jobs/{JOB}/reserve", {"step": 1, "bytes": 0}
        )
    assert ([200] * 5 + [429], 200) == (statuses, other)
    assert f"uid {INTRUDER} holds 5 live reservations" in body["error"]


async def test_another_uid_sees_none_of_a_jobs_files_sizes_or_crcs(base: Path) -> None:
    """Row "metadata read": naming another uid's job is refused (403) for its listing, metadata and files;
    the tier's listing shows the asker its own jobs only."""
    async with tier_agent(base, agent_settings=OPEN) as (agent, _):
        sock = agent.config.socket
        await hold_as(sock, VICTIM, 1, {"__0_0.distcp": b"secret-bytes"})
        named, _ = await request_as(sock, INTRUDER, "GET", f"/v1/ram-tier/jobs/{JOB}?uid={VICTIM}")
        fetched, _ = await raw_as(
            sock, INTRUDER, "GET", f"/v1/ram-tier/jobs/{JOB}/steps/1/files/__0_0.distcp?uid={VICTIM}"
        )
        freed, _ = await request_as(sock, INTRUDER, "DELETE", f"/v1/ram-tier/jobs/{JOB}?uid={VICTIM}")
        _, own = await request_as(sock, INTRUDER, "GET", f"/v1/ram-tier/jobs/{JOB}")
        _, listing = await request_as(sock, INTRUDER, "GET", "/v1/ram-tier")
        _, mine = await request_as(sock, VICTIM, "GET", "/v1/ram-tier")
        _, admin = await http_json(sock, "GET", "/v1/ram-tier")
    assert (403, 403, 403) == (named, fetched, freed)
    assert ([], {}, [JOB]) == (own["steps"], listing["jobs"], list(mine["jobs"]))
    assert [f"{VICTIM}/{JOB}"] == list(admin["all_jobs"])
    assert "secret" not in json.dumps(listing)


async def test_a_hard_link_to_a_file_of_another_user_is_not_served(base: Path) -> None:
    """A step's files must be the job's own: a hard link to root's file (where the kernel lets a user make
    one) fails the owner check at commit and at fetch."""
    secret = base / "secret"
    secret.write_bytes(b"S" * 8)
    async with tier_agent(base, agent_settings=OPEN) as (agent, _):
        sock = agent.config.socket
        _, res = await request_as(
            sock, VICTIM, "POST", f"/v1/ram-tier/jobs/{JOB}/reserve", {"step": 1, "bytes": 8}
        )
        path = Path(res["path"])
        os.link(secret, path / "__0_0.distcp")  # root makes it, as protected_hardlinks would stop the user
        with as_user(VICTIM):
            doc = {"job": JOB, "step": 1, "run": 1, "world_size": 1, "complete": True,
                   "files": {"__0_0.distcp": {"size": 8, "crc32": zlib.crc32(b"S" * 8), "rank": 0}}}  # fmt: skip
            (path / "tier.json").write_text(json.dumps(doc))
        status, body = await request_as(
            sock,
            VICTIM,
            "POST",
            f"/v1/ram-tier/jobs/{JOB}/steps/1/commit",
            {"reservation": res["reservation"]},
        )
    assert 409 == status
    assert f"__0_0.distcp belongs to uid 0, not to the job's uid {VICTIM}" in body["error"]


async def test_a_flood_of_refused_requests_logs_a_bounded_number_of_lines(base: Path) -> None:
    """Any socket user can ask for refusals in a loop (another uid's job, a bad step): the log gets a burst
    of ``ram_tier_refused`` lines and then nothing more for a while, the next line counting what it left out."""
    async with tier_agent(base, agent_settings=OPEN) as (agent, _):
        sock = agent.config.socket
        with capture_logs() as logs:
            statuses = {
                (await request_as(sock, INTRUDER, "GET", f"/v1/ram-tier/jobs/{JOB}?uid={VICTIM}"))[0]
                for _ in range(200)
            }
    refused = [e for e in logs if e["event"] == "ram_tier_refused"]
    assert {403} == statuses
    assert 1 <= len(refused) <= 11, len(refused)
