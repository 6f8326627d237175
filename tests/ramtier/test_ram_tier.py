"""The RAM tier (issue 24 item 1) through a real agent on a temporary Unix socket and its real HTTP API: a
step reserved, written, committed, listed, fetched and freed; the inventory read back at start; the cap; and
each kind of bad input refused with a clear error while the agent keeps running."""

from __future__ import annotations

import asyncio
import json
import os
import zlib
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from structlog.testing import capture_logs

from agent.cli.render import format_status
from agent.config import load_config
from agent.core.errors import ConfigError
from agent.ramtier import RamTierConfig
from tests.ramtier.support import JOB, ME, put_step, request_as, tier_agent, write_step
from tests.support import REPO, agent_config, http_json, running_agent


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("cap_fraction", 2, "key 'ram_tier.cap_fraction': expected a fraction above 0 and at most 1, got 2"),
        ("path", "shm/tier", "ram_tier.path must be an absolute path"),
        ("cap_bytes", -1, "key 'ram_tier.cap_bytes': expected a number of bytes, 0 or more, got -1"),
    ],
)
def test_a_bad_ram_tier_value_is_refused_when_the_configuration_loads(
    base: Path, key: str, value: Any, expected: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        agent_config(base, {f"ram_tier.{key}": value}).table("ram_tier", RamTierConfig)
    assert expected in str(caught.value)


def test_the_packaged_configuration_turns_the_tier_on_with_its_defaults() -> None:
    """The packaged unit gives the agent what the tier needs (tests/ramtier/test_unit.py), so the packaged
    configuration turns it on; every other key of the table keeps its default."""
    config = load_config(REPO / "packaging" / "config.toml", env={}).table("ram_tier", RamTierConfig)
    assert RamTierConfig(enabled=True) == config


async def test_a_disabled_tier_answers_404_saying_how_to_turn_it_on(base: Path) -> None:
    """Off by default: the endpoint exists and says which key turns it on."""
    async with running_agent(base) as agent:
        status, body = await http_json(agent.config.socket, "GET", "/v1/ram-tier")
        _, doc = await http_json(agent.config.socket, "GET", "/v1/status")
    assert 404 == status
    assert "[ram_tier] enabled = true" in body["error"]
    assert {"enabled": False, "state": "off"} == doc["ram_tier"]


async def test_a_committed_step_is_listed_with_its_files_and_bytes(base: Path) -> None:
    """Reserve gives a step directory under the tier; after commit the job and the tier list the step."""
    files = {"__0_0.distcp": b"a" * 100, ".metadata": b"m" * 10}
    async with tier_agent(base) as (agent, _):
        status, committed = await put_step(agent, 7, files)
        _, job = await http_json(agent.config.socket, "GET", f"/v1/ram-tier/jobs/{JOB}")
        _, tier = await http_json(agent.config.socket, "GET", "/v1/ram-tier")
    assert 200 == status, committed
    step_bytes = committed["bytes"]
    assert 110 < step_bytes  # the files and tier.json
    assert (str(base / "ram" / ME / JOB), [7], {"size": 100, "crc32": zlib.crc32(b"a" * 100), "rank": 0}) == (
        job["path"],
        [s["step"] for s in job["steps"]],
        job["steps"][0]["files"]["__0_0.distcp"],
    )
    newest = {"step": 7, "kind": "step", "ranks_here": [0], "placement": {}}
    assert ({JOB: {"steps": [7], "bytes": step_bytes, "newest": newest}}, step_bytes, 0) == (
        tier["jobs"],
        tier["used_bytes"],
        tier["reserved_bytes"],
    )


async def test_steps_of_a_job_are_listed_newest_first(base: Path) -> None:
    async with tier_agent(base) as (agent, _):
        for step in (3, 10, 5):
            await put_step(agent, step, {"__0_0.distcp": b"x"})
        _, job = await http_json(agent.config.socket, "GET", f"/v1/ram-tier/jobs/{JOB}")
    assert [10, 5, 3] == [s["step"] for s in job["steps"]]


async def test_a_reservation_counts_against_the_cap_until_commit(base: Path) -> None:
    async with tier_agent(base, cap_bytes=1000) as (agent, _):
        await http_json(
            agent.config.socket, "POST", f"/v1/ram-tier/jobs/{JOB}/reserve", {"step": 1, "bytes": 600}
        )
        _, tier = await http_json(agent.config.socket, "GET", "/v1/ram-tier")
    assert (1000, 600, 400) == (tier["cap_bytes"], tier["reserved_bytes"], tier["free_bytes"])


async def test_a_full_tier_refuses_a_reservation_with_507_saying_what_is_free(base: Path) -> None:
    async with tier_agent(base, cap_bytes=1000) as (agent, tier):
        sock = agent.config.socket
        first, _ = await http_json(
            sock, "POST", f"/v1/ram-tier/jobs/{JOB}/reserve", {"step": 1, "bytes": 600}
        )
        status, body = await http_json(
            sock, "POST", f"/v1/ram-tier/jobs/{JOB}/reserve", {"step": 2, "bytes": 600}
        )
        _, metrics = await http_json(sock, "GET", "/metrics")
        running, _ = await http_json(sock, "GET", "/v1/status")
    assert (200, 507, 200) == (first, status, running)
    assert body["error"].startswith("ram tier full: need 600 bytes, free 400 of cap 1000")
    assert (600, 400, 1000) == (body["need_bytes"], body["free_bytes"], body["cap_bytes"])
    assert "preemptd_ram_tier_refusals_total 1.0" in metrics
    assert 1 == tier.holdings.refusals


async def test_the_inventory_is_read_back_when_the_agent_starts_again(base: Path) -> None:
    """The tier outlives the agent: a new agent on the same directory holds the same steps."""
    async with tier_agent(base) as (agent, _):
        await put_step(agent, 4, {"__0_0.distcp": b"q" * 50})
        _, before = await http_json(agent.config.socket, "GET", f"/v1/ram-tier/jobs/{JOB}")
    async with tier_agent(base) as (agent, _):
        _, after = await http_json(agent.config.socket, "GET", f"/v1/ram-tier/jobs/{JOB}")
    assert before == after
    assert [4] == [s["step"] for s in after["steps"]]


async def test_an_incomplete_step_is_removed_at_start_with_a_log_event(base: Path) -> None:
    step = base / "ram" / ME / JOB / "9"
    async with tier_agent(base):
        pass
    step.mkdir(parents=True)
    (step / "__0_0.distcp").write_bytes(b"half")
    with capture_logs() as logs:
        async with tier_agent(base) as (agent, _):
            _, job = await http_json(agent.config.socket, "GET", f"/v1/ram-tier/jobs/{JOB}")
    removed = [e for e in logs if e["event"] == "ram_tier_step_removed"]
    assert ([], False) == (job["steps"], step.exists())
    assert [(JOB, 9)] == [(e["job"], e["step"]) for e in removed]
    assert "no tier.json" in removed[0]["why"]


async def test_a_damaged_step_is_removed_at_start_naming_the_file_that_fails_its_crc(base: Path) -> None:
    async with tier_agent(base) as (agent, _):
        await put_step(agent, 2, {"__0_0.distcp": b"good bytes"})
    (base / "ram" / ME / JOB / "2" / "__0_0.distcp").write_bytes(b"evil bytes")  # same size
    with capture_logs() as logs:
        async with tier_agent(base) as (agent, _):
            _, doc = await http_json(agent.config.socket, "GET", "/v1/status")
    removed = [e for e in logs if e["event"] == "ram_tier_step_removed"]
    assert ({}, 1) == (doc["ram_tier"]["jobs"], doc["ram_tier"]["removed_steps"])
    assert "__0_0.distcp fails its CRC32" in removed[0]["why"]


async def test_a_tier_json_that_lies_about_a_size_is_refused_at_commit(base: Path) -> None:
    async with tier_agent(base) as (agent, _):
        sock = agent.config.socket
        _, res = await http_json(sock, "POST", f"/v1/ram-tier/jobs/{JOB}/reserve", {"step": 1, "bytes": 10})
        write_step(Path(res["path"]), 1, {"__0_0.distcp": b"12345"}, sizes={"__0_0.distcp": 9})
        status, body = await http_json(
            sock, "POST", f"/v1/ram-tier/jobs/{JOB}/steps/1/commit", {"reservation": res["reservation"]}
        )
        _, job = await http_json(sock, "GET", f"/v1/ram-tier/jobs/{JOB}")
    assert (409, []) == (status, job["steps"])
    assert "tier.json says __0_0.distcp holds 9 bytes, the file holds 5" in body["error"]


async def test_a_file_name_that_leaves_the_step_directory_is_refused_at_commit(base: Path) -> None:
    async with tier_agent(base) as (agent, _):
        sock = agent.config.socket
        _, res = await http_json(sock, "POST", f"/v1/ram-tier/jobs/{JOB}/reserve", {"step": 1, "bytes": 10})
        (base / "ram" / "outside").write_bytes(b"x")
        doc = {
            "job": JOB,
            "step": 1,
            "run": 1,
            "world_size": 1,
            "complete": True,
            "files": {"../../outside": {"size": 1, "crc32": zlib.crc32(b"x"), "rank": 0}},
        }
        (Path(res["path"]) / "tier.json").write_text(json.dumps(doc))
        status, body = await http_json(
            sock, "POST", f"/v1/ram-tier/jobs/{JOB}/steps/1/commit", {"reservation": res["reservation"]}
        )
    assert 409 == status
    assert "file name '../../outside' is not valid" in body["error"]


async def test_a_file_name_that_is_not_plain_is_refused_at_fetch(base: Path) -> None:
    async with tier_agent(base) as (agent, _):
        await put_step(agent, 1, {"__0_0.distcp": b"x"})
        status, body = await http_json(
            agent.config.socket, "GET", f"/v1/ram-tier/jobs/{JOB}/steps/1/files/tier.json"
        )
    assert 400 == status
    assert "file name 'tier.json' is not valid" in body["error"]


@pytest.mark.parametrize(
    ("path", "body", "expected"),
    [
        ("/v1/ram-tier/jobs/a%20b/reserve", {"step": 1, "bytes": 1}, "job id 'a b' is not valid"),
        (
            "/v1/ram-tier/jobs/" + "j" * 129 + "/reserve",
            {"step": 1, "bytes": 1},
            "is not valid: use 1 to 128",
        ),
        (f"/v1/ram-tier/jobs/{JOB}/reserve", {"step": -1, "bytes": 1}, "step -1 is not valid"),
        (f"/v1/ram-tier/jobs/{JOB}/reserve", {"step": "7", "bytes": 1}, "step '7' is not valid"),
        (f"/v1/ram-tier/jobs/{JOB}/reserve", {"step": True, "bytes": 1}, "step True is not valid"),
        (
            f"/v1/ram-tier/jobs/{JOB}/reserve",
            {"step": 1, "bytes": -5},
            "field 'bytes' must be a whole number",
        ),
        (f"/v1/ram-tier/jobs/{JOB}/reserve", {"step": 1, "bytes": 1, "x": 1}, "unknown field(s) x"),
        (f"/v1/ram-tier/jobs/{JOB}/steps/abc/commit", {"reservation": "r"}, "step 'abc' is not valid"),
        (f"/v1/ram-tier/jobs/{JOB}/steps/1/commit", {"reservation": 5}, "field 'reservation' must be the id"),
    ],
)
async def test_a_bad_job_id_step_or_body_is_a_400_naming_it(
    base: Path, path: str, body: dict[str, Any], expected: str
) -> None:
    async with tier_agent(base) as (agent, _):
        status, answer = await http_json(agent.config.socket, "POST", path, body)
        alive, _ = await http_json(agent.config.socket, "GET", "/v1/status")
    assert (400, 200) == (status, alive)
    assert expected in answer["error"]


async def test_deleting_a_step_frees_its_bytes_and_its_directory(base: Path) -> None:
    async with tier_agent(base) as (agent, _):
        sock = agent.config.socket
        _, committed = await put_step(agent, 1, {"__0_0.distcp": b"x" * 30})
        await put_step(agent, 2, {"__0_0.distcp": b"y" * 30})
        status, freed = await http_json(sock, "DELETE", f"/v1/ram-tier/jobs/{JOB}/steps/1")
        _, tier = await http_json(sock, "GET", "/v1/ram-tier")
        again, _ = await http_json(sock, "DELETE", f"/v1/ram-tier/jobs/{JOB}/steps/1")
    assert (200, [1], committed["bytes"]) == (status, freed["steps"], freed["freed_bytes"])
    newest = {"step": 2, "kind": "step", "ranks_here": [0], "placement": {}}
    assert ({JOB: {"steps": [2], "bytes": tier["used_bytes"], "newest": newest}}, 404) == (
        tier["jobs"],
        again,
    )
    assert not (base / "ram" / ME / JOB / "1").exists()


async def test_deleting_a_job_frees_every_step_and_its_reservations(base: Path) -> None:
    async with tier_agent(base, cap_bytes=10_000) as (agent, _):
        sock = agent.config.socket
        await put_step(agent, 1, {"__0_0.distcp": b"x" * 30})
        await http_json(sock, "POST", f"/v1/ram-tier/jobs/{JOB}/reserve", {"step": 2, "bytes": 500})
        status, freed = await http_json(sock, "DELETE", f"/v1/ram-tier/jobs/{JOB}")
        _, tier = await http_json(sock, "GET", "/v1/ram-tier")
    assert (200, [1]) == (status, freed["steps"])
    assert ({}, 0, 0, 10_000) == (
        tier["jobs"],
        tier["used_bytes"],
        tier["reserved_bytes"],
        tier["free_bytes"],
    )
    assert not (base / "ram" / ME / JOB).exists()


async def test_a_file_is_fetched_with_its_bytes(base: Path) -> None:
    async with tier_agent(base) as (agent, _):
        await put_step(agent, 3, {"__0_0.distcp": b"payload"})
        async with (
            aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(agent.config.socket))) as http,
            http.get(f"http://agent/v1/ram-tier/jobs/{JOB}/steps/3/files/__0_0.distcp") as answer,
        ):
            got = (answer.status, await answer.read())
    assert (200, b"payload") == got


async def test_a_damaged_file_is_refused_at_fetch(base: Path) -> None:
    """CRCs are checked lazily at fetch: a file changed after its commit is not served."""
    async with tier_agent(base) as (agent, _):
        await put_step(agent, 3, {"__0_0.distcp": b"payload"})
        (base / "ram" / ME / JOB / "3" / "__0_0.distcp").write_bytes(b"PAYLOAD")
        status, body = await http_json(
            agent.config.socket, "GET", f"/v1/ram-tier/jobs/{JOB}/steps/3/files/__0_0.distcp"
        )
    assert 409 == status
    assert "__0_0.distcp fails its CRC32" in body["error"]


async def test_a_path_that_is_not_tmpfs_is_used_with_a_not_ram_warning(base: Path) -> None:
    """Tests keep the tier under /tmp, which is a disk here: the agent says so and still serves."""
    with capture_logs() as logs:
        async with tier_agent(base) as (agent, tier):
            _, doc = await http_json(agent.config.socket, "GET", "/v1/status")
    warned = [e for e in logs if e["event"] == "ram_tier_not_ram"]
    assert tier.root is not None and not tier.root.in_ram
    assert ("ready", False) == (doc["ram_tier"]["state"], doc["ram_tier"]["in_ram"])
    assert 1 == len(warned) and "not RAM" in warned[0]["effect"]


async def test_a_path_that_cannot_be_written_leaves_the_agent_serving_and_says_why(base: Path) -> None:
    (base / "file").write_text("not a directory")
    with capture_logs() as logs:
        async with tier_agent(base, path=str(base / "file" / "ram")) as (agent, _):
            status, body = await http_json(agent.config.socket, "GET", "/v1/ram-tier")
            alive, doc = await http_json(agent.config.socket, "GET", "/v1/status")
    assert (503, 200, "unavailable") == (status, alive, doc["ram_tier"]["state"])
    assert f"ram_tier.path {base / 'file' / 'ram'} cannot be used" in body["error"]
    assert ["ram_tier_unavailable"] == [e["event"] for e in logs if e["event"].startswith("ram_tier_un")]


async def test_a_directory_holding_files_of_someone_else_is_not_used(base: Path) -> None:
    """Without the tier's marker a non-empty directory is not the agent's: it removes nothing from it."""
    (base / "ram").mkdir()
    (base / "ram" / "precious").write_text("keep me")
    async with tier_agent(base) as (agent, _):
        status, body = await http_json(agent.config.socket, "GET", "/v1/ram-tier")
    assert 503 == status
    assert "holds files that preemptd did not put there" in body["error"]
    assert (base / "ram" / "precious").exists()


async def test_a_reservation_not_committed_in_time_is_released_and_its_step_removed(base: Path) -> None:
    now = [datetime(2026, 12, 3, 21, 0, tzinfo=timezone.utc)]
    async with tier_agent(base, clock=lambda: now[0], cap_bytes=1000, reservation_ttl_s=600) as (agent, tier):
        sock = agent.config.socket
        _, res = await http_json(sock, "POST", f"/v1/ram-tier/jobs/{JOB}/reserve", {"step": 1, "bytes": 900})
        (Path(res["path"]) / "__0_0.distcp").write_bytes(b"partial")
        now[0] += timedelta(seconds=601)
        status, _ = await http_json(
            sock, "POST", f"/v1/ram-tier/jobs/{JOB}/reserve", {"step": 2, "bytes": 900}
        )
        gone = not await asyncio.to_thread(Path(res["path"]).exists)
    assert (200, True) == (status, gone)
    assert 0 == tier.removed  # removed by expiry, not by a read-back


def test_preemptd_status_shows_the_tier_in_one_line() -> None:
    doc: dict[str, Any] = {
        "agent": {"version": "x", "uptime_s": 1},
        "ram_tier": {
            "enabled": True,
            "state": "ready",
            "path": "/dev/shm/preemptd",
            "filesystem": "tmpfs",
            "in_ram": True,
            "cap_bytes": 4 * 1024**3,
            "used_bytes": 1024**3,
            "reserved_bytes": 0,
            "free_bytes": 3 * 1024**3,
            "jobs": {"a": {"steps": [1, 2], "bytes": 1024**3}},
        },
    }
    shown = format_status(doc)
    line = shown[shown.index("RAM tier") :].split("\n")[:2]  # wrapped at 80 columns
    assert [
        "RAM tier: 1.0 GiB used of 4.0 GiB, 0 B reserved; 2 steps of 1 job in",
        "    /dev/shm/preemptd (tmpfs)",
    ] == line


def test_preemptd_status_says_when_the_tier_is_unavailable() -> None:
    doc: dict[str, Any] = {
        "agent": {},
        "ram_tier": {"enabled": True, "state": "unavailable", "error": "ram_tier.path /x cannot be used"},
    }
    assert "RAM tier: UNAVAILABLE: ram_tier.path /x cannot be used" in format_status(doc)


async def test_a_job_is_its_uids_own_and_another_uid_with_the_same_job_id_gets_its_own(base: Path) -> None:
    """Peer credentials decide whose job it is (``<root>/<uid>/<job>``): a second uid that reserves, frees or
    reads the same job id acts on a job of its own, and naming the first uid's job (``?uid=``) is refused."""
    if os.geteuid() != 0:
        pytest.skip("needs root to connect as other users")
    os.chmod(base, 0o755)
    async with tier_agent(base, agent_settings={"socket_mode": 0o666}) as (agent, _):
        sock = agent.config.socket
        reserve = f"/v1/ram-tier/jobs/{JOB}/reserve"
        status, first = await request_as(sock, 65534, "POST", reserve, {"step": 1, "bytes": 10})
        again, second = await request_as(sock, 65533, "POST", reserve, {"step": 1, "bytes": 10})
        owners = [os.stat(Path(p).parent).st_uid for p in (first["path"], second["path"])]
        freed, _ = await request_as(sock, 65533, "DELETE", f"/v1/ram-tier/jobs/{JOB}")
        named, refused = await request_as(sock, 65533, "DELETE", f"/v1/ram-tier/jobs/{JOB}?uid=65534")
        kept = await asyncio.to_thread(os.path.isdir, first["path"])
    assert (200, 200, 200, 403) == (status, again, freed, named)
    assert ([65534, 65533], True) == (owners, kept)
    assert str(base / "ram" / "65534" / JOB / "1") == first["path"]
    assert "uid 65533 may see and act on its own jobs only" in refused["error"]


async def test_steps_reserved_committed_and_freed_in_a_loop_are_one_info_line_of_counts(base: Path) -> None:
    """Any socket user may do this in a loop: each request is a debug line, and at info one
    ``ram_tier_requests`` line per interval (written at the latest when the agent stops) counts them."""
    rounds = 12
    with capture_logs() as logs:
        async with tier_agent(base) as (agent, _):
            for step in range(1, rounds + 1):
                status, _ = await put_step(agent, step, {"__0_0.distcp": b"x" * 30})
                assert 200 == status
                freed, _ = await http_json(
                    agent.config.socket, "DELETE", f"/v1/ram-tier/jobs/{JOB}/steps/{step}"
                )
                assert 200 == freed
    info = [e for e in logs if e["log_level"] == "info" and e["event"].startswith("ram_tier_")]
    [tally] = [e for e in info if e["event"] == "ram_tier_requests"]
    assert ["ram_tier_ready", "ram_tier_requests"] == [e["event"] for e in info]
    assert (
        3 * rounds,
        {"reserved": rounds, "committed": rounds, "freed": rounds},
        {f"{ME}/{JOB}": 3 * rounds},
    ) == (
        tally["total"],
        tally["requests"],
        tally["jobs"],
    )
    # A committed step's bytes include its tier.json; what was committed is what was freed.
    assert (30 * rounds, tally["committed_bytes"]) == (tally["reserved_bytes"], tally["freed_bytes"])
