"""Who may say what about participants, against a real agent with peers of other uids (SO_PEERCRED): a
participant's name lives in the namespace of the uid that registered it (nobody can take it first),
registrations are bounded, lapse with their process, and status summarises them."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from agent.core.notice import Kind
from tests.support import REPO, SSEClient, http_json, running_agent

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to connect as other uids")

ALICE, MALLORY = 64001, 64002
OPEN = {"socket_mode": 0o666, "actions.ready.grace_s": 60.0}


def report(phase: str, rank: int = 0, participant: bool = True, emergency: bool = False) -> dict[str, Any]:
    doc: dict[str, Any] = {"kind": "checkpoint", "phase": phase, "emergency": emergency}
    if phase == "finished":
        doc["duration_s"] = 1.0
    doc["client"] = {"job": "train", "rank": rank, "participant": participant}
    return doc


async def post_as(path: Path, uid: int, doc: Mapping[str, Any]) -> tuple[int, Any]:
    """POST a report over a connection opened by ``uid`` (the agent reads that uid from SO_PEERCRED)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    os.seteuid(uid)
    try:
        sock.connect(str(path))
    finally:
        os.seteuid(0)
    reader, writer = await asyncio.open_unix_connection(sock=sock)
    body = json.dumps(doc).encode()
    writer.write(
        b"POST /v1/reports HTTP/1.1\r\nHost: agent\r\nConnection: close\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    answer = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    await writer.wait_closed()
    head, _, payload = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(payload)


@pytest.fixture
def shared(base: Path) -> Path:
    os.chmod(base, 0o755)  # other uids reach the socket
    return base


async def test_another_uids_checkpoint_report_is_refused_and_ready_waits_for_the_owner(shared: Path) -> None:
    async with running_agent(shared, OPEN) as agent:
        sock = agent.config.socket
        client = await SSEClient.connect(sock)
        await client.next()
        registered = await post_as(sock, ALICE, report("started"))
        notice = agent.drills.drill(Kind.TERMINATION, 600, None, "drill", {})
        forged = await post_as(sock, MALLORY, report("finished", participant=False, emergency=True))
        _, status = await http_json(sock, "GET", "/v1/status")
        owner = await post_as(sock, ALICE, report("finished", emergency=True))
        ready = await client.until(lambda e: e["type"] == "ready")
        await client.close()
    assert (202, 403, 202) == (registered[0], forged[0], owner[0])
    assert "belongs to uid 64001; uid 64002 may not report for it" in forged[1]["error"]
    assert "waiting" == status["actions"]["ready"]["notices"][notice.id]["state"]
    assert ("all_participants", ["train#0"]) == (ready["data"]["reason"], ready["data"]["finished"])


async def test_a_name_registered_first_by_another_uid_does_not_take_it_from_its_owner(shared: Path) -> None:
    """Squatting: Mallory registers ``train#0`` before Alice's job starts. Alice's registration is still
    accepted, in her own namespace: her report finishes her participant, and Mallory's stays Mallory's."""
    async with running_agent(shared, OPEN) as agent:
        sock = agent.config.socket
        squat = await post_as(sock, MALLORY, report("started"))
        owner = await post_as(sock, ALICE, report("started"))
        notice = agent.drills.drill(Kind.TERMINATION, 600, None, "drill", {})
        finished = await post_as(sock, ALICE, report("finished", emergency=True))
        _, status = await http_json(sock, "GET", "/v1/status")
    ready = status["actions"]["ready"]
    waiting = ready["notices"][notice.id]
    assert (202, 202, 202) == (squat[0], owner[0], finished[0])
    assert [("train#0", ALICE), ("train#0", MALLORY)] == sorted(
        (p["key"], p["uid"]) for p in ready["participants"]
    )
    assert (["train#0 (uid 64001)"], ["train#0 (uid 64002)"]) == (waiting["finished"], waiting["missing"])


async def test_root_may_report_for_another_uids_participant(shared: Path) -> None:
    async with running_agent(shared, OPEN) as agent:
        sock = agent.config.socket
        client = await SSEClient.connect(sock)
        await client.next()
        await post_as(sock, ALICE, report("started"))
        agent.drills.drill(Kind.TERMINATION, 600, None, "drill", {})
        status, _ = await post_as(sock, 0, report("finished", participant=False, emergency=True))
        ready = await client.until(lambda e: e["type"] == "ready")
        await client.close()
    assert (202, "all_participants", ["train#0"]) == (
        status,
        ready["data"]["reason"],
        ready["data"]["finished"],
    )


async def test_roots_report_for_a_name_two_uids_hold_is_refused_as_ambiguous(shared: Path) -> None:
    async with running_agent(shared, OPEN) as agent:
        sock = agent.config.socket
        await post_as(sock, ALICE, report("started"))
        await post_as(sock, MALLORY, report("started"))
        status, body = await post_as(sock, 0, report("finished", participant=False, emergency=True))
    assert 409 == status
    assert "participant 'train#0' is registered by uids 64001, 64002" in body["error"]


async def test_registrations_are_capped_per_uid_and_in_all(shared: Path) -> None:
    settings = {**OPEN, "actions.ready.max_participants_per_uid": 2, "actions.ready.max_participants": 3}
    async with running_agent(shared, settings) as agent:
        sock = agent.config.socket
        alice = [(await post_as(sock, ALICE, report("started", rank)))[0] for rank in range(3)]
        per_uid = await post_as(sock, ALICE, report("started", 9))
        mallory = [(await post_as(sock, MALLORY, report("started", rank)))[0] for rank in (10, 11)]
        total = await post_as(sock, MALLORY, report("started", 12))
    assert ([202, 202, 429], [202, 429]) == (alice, mallory)
    assert "uid 64001 has 2 participants registered, the limit is 2" in per_uid[1]["error"]
    assert "3 participants are registered, the limit is 3" in total[1]["error"]


async def test_a_participant_whose_process_exited_stops_counting(shared: Path) -> None:
    settings = {
        **OPEN,
        "actions.ready.without_participants": "immediately",
        "actions.ready.max_participants": 1,
    }
    script = (
        "import json, sys\n"
        "from agent.client.transport import request_json\n"
        "request_json('POST', '/v1/reports', json.loads(sys.argv[1]), socket_path=sys.argv[2])\n"
    )
    async with running_agent(shared, settings) as agent:
        sock = agent.config.socket
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", script, json.dumps(report("started")), str(sock),
            env={"PYTHONPATH": str(REPO)}, cwd="/",
        )  # fmt: skip
        assert 0 == await proc.wait()
        _, before = await http_json(sock, "GET", "/v1/status")
        client = await SSEClient.connect(sock)
        await client.next()
        agent.drills.drill(Kind.TERMINATION, 600, None, "drill", {})
        ready = await client.until(lambda e: e["type"] == "ready")
        await client.close()
        other = await post_as(sock, MALLORY, report("started", 5))  # the slot it held is free again
    assert 1 == before["actions"]["ready"]["participants_total"]
    assert ("no_participants", []) == (ready["data"]["reason"], ready["data"]["participants"])
    assert 202 == other[0]


async def test_status_summarises_many_participants(shared: Path) -> None:
    async with running_agent(shared, OPEN) as agent:
        for rank in range(60):
            await post_as(agent.config.socket, ALICE, report("started", rank))
        _, status = await http_json(agent.config.socket, "GET", "/v1/status")
    ready = status["actions"]["ready"]
    assert (20, 60, {str(ALICE): 60}) == (
        len(ready["participants"]),
        ready["participants_total"],
        ready["participants_by_uid"],
    )
