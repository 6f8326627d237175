"""The Unix-socket API against a real agent: endpoints, bad input, slow and vanishing clients."""

from __future__ import annotations

import asyncio
import json
import os
import socket
from pathlib import Path

from structlog.testing import capture_logs

from agent.core.notice import Kind, Observation
from tests.support import SSEClient, eventually, http_json, running_agent


async def raw_exchange(path: Path, data: bytes, read: bool = True) -> bytes:
    reader, writer = await asyncio.open_unix_connection(str(path))
    writer.write(data)
    await writer.drain()
    if not read:
        writer.close()
        await writer.wait_closed()
        return b""
    answer = await asyncio.wait_for(reader.read(65536), 5)
    writer.close()
    await writer.wait_closed()
    return answer


async def test_status_describes_agent_notices_sources_and_subscribers(base: Path) -> None:
    async with running_agent(base) as agent:
        agent.drills.drill(Kind.TERMINATION, 60, None, "drill", {})
        status, doc = await http_json(agent.config.socket, "GET", "/v1/status")
    assert 200 == status
    assert ("critical", 1, "none", {"connected": 0, "max": 4096, "disconnected_slow": 0}) == (
        doc["overall"],
        len(doc["notices"]),
        doc["agent"]["cloud"],
        doc["subscribers"],
    )


async def test_garbage_on_the_socket_gets_a_400_and_the_agent_keeps_serving(base: Path) -> None:
    async with running_agent(base) as agent:
        answer = await raw_exchange(agent.config.socket, b"\x16\x03\x01\x02\x00garbage\r\n\r\n")
        status, _ = await http_json(agent.config.socket, "GET", "/v1/status")
    assert b" 400 Bad Request" in answer.split(b"\r\n", 1)[0]
    assert 200 == status


async def test_truncated_request_then_hangup_leaves_the_agent_serving(base: Path) -> None:
    async with running_agent(base) as agent:
        await raw_exchange(agent.config.socket, b"GET /v1/stat", read=False)
        await raw_exchange(
            agent.config.socket, b"POST /v1/reports HTTP/1.1\r\nContent-Length: 100\r\n\r\n{", read=False
        )
        status, _ = await http_json(agent.config.socket, "GET", "/v1/status")
    assert 200 == status


async def test_oversized_report_is_refused_with_413(base: Path) -> None:
    async with running_agent(base, {"api.max_body_bytes": 1024}) as agent:
        status, body = await http_json(
            agent.config.socket, "POST", "/v1/reports", raw=b"{" + b" " * 5000 + b"}"
        )
    assert (413, "body too large: the limit is 1024 bytes") == (status, body["error"])


async def test_malformed_report_json_is_a_400_that_says_why(base: Path) -> None:
    async with running_agent(base) as agent:
        status, body = await http_json(
            agent.config.socket, "POST", "/v1/reports", raw=b'{"kind": "checkpoint",'
        )
    assert 400 == status
    assert body["error"].startswith("body is not valid JSON")


async def test_report_with_a_wrong_field_is_a_400_naming_the_field(base: Path) -> None:
    async with running_agent(base) as agent:
        status, body = await http_json(
            agent.config.socket,
            "POST",
            "/v1/reports",
            {"kind": "checkpoint", "phase": "finished", "duration_s": "slow"},
        )
    assert (400, "field 'duration_s' must be a finite number of seconds, got 'slow'") == (
        status,
        body["error"],
    )


async def test_valid_report_is_accepted_counted_and_kept_in_history(base: Path) -> None:
    """At info the report is counted in the interval's ``reports_received`` line (written at the latest when
    the agent stops); the report's own line is at debug."""
    report = {
        "kind": "checkpoint",
        "phase": "finished",
        "step": 40,
        "duration_s": 12.5,
        "bytes": 1000,
        "emergency": True,
        "client": {"job": "llm"},
    }
    with capture_logs() as logs:
        async with running_agent(base) as agent:
            status, body = await http_json(agent.config.socket, "POST", "/v1/reports", report)
            await agent.keeper.flush()
            history = [r for r in agent.history.records() if r["type"] == "report"]
    assert (202, os.getpid()) == (status, body["report"]["peer_pid"])
    tally = [e for e in logs if e["event"] == "reports_received"]
    assert [(1, {"checkpoint finished": 1}, {"llm": 1})] == [
        (e["total"], e["kinds"], e["jobs"]) for e in tally
    ]
    assert 12.5 == history[0]["report"]["duration_s"]


def connect_as(path: Path, uid: int) -> socket.socket:
    """Connect with another effective uid: SO_PEERCRED records the credentials in effect at connect()."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    os.seteuid(uid)
    try:
        sock.connect(str(path))
    finally:
        os.seteuid(0)
    return sock


async def test_drill_by_a_non_admin_user_is_refused_with_403(base: Path) -> None:
    os.chmod(base, 0o755)
    async with running_agent(base, {"socket_mode": 0o666}) as agent:
        sock = connect_as(agent.config.socket, 65534)
        reader, writer = await asyncio.open_unix_connection(sock=sock)
        body = b'{"in_s": 5}'
        writer.write(
            b"POST /v1/drills HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        length = int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0])
        answer = json.loads(await reader.readexactly(length))
        writer.close()
        await writer.wait_closed()
        assert 0 == len(agent.board)
    assert head.startswith(b"HTTP/1.1 403")
    assert "uid 65534 is not root" in answer["error"]


async def test_drill_with_an_unknown_kind_is_a_400(base: Path) -> None:
    async with running_agent(base) as agent:
        status, body = await http_json(agent.config.socket, "POST", "/v1/drills", {"kind": "meteor"})
    assert 400 == status
    assert body["error"].startswith("field 'kind' must be one of termination")


async def test_clearing_a_drill_sends_cleared(base: Path) -> None:
    async with running_agent(base) as agent:
        client = await SSEClient.connect(agent.config.socket)
        try:
            await client.next()
            _, created = await http_json(agent.config.socket, "POST", "/v1/drills", {"in_s": 60})
            await client.next()
            status, _ = await http_json(
                agent.config.socket, "DELETE", f"/v1/drills/{created['notice']['id']}"
            )
            event = await client.next()
        finally:
            await client.close()
    assert (200, "cleared", created["notice"]["id"]) == (status, event["type"], event["notice"]["id"])


async def test_unknown_path_and_wrong_method_get_json_errors(base: Path) -> None:
    async with running_agent(base) as agent:
        missing = await http_json(agent.config.socket, "GET", "/v2/nothing")
        wrong = await http_json(agent.config.socket, "DELETE", "/v1/status")
    assert (404, 405) == (missing[0], wrong[0])
    assert "no endpoint GET /v2/nothing" in missing[1]["error"]


async def test_metrics_are_prometheus_text(base: Path) -> None:
    async with running_agent(base) as agent:
        agent.drills.drill(Kind.TERMINATION, 60, None, "drill", {})
        status, text = await http_json(agent.config.socket, "GET", "/metrics")
    assert 200 == status
    assert 'preemptd_notices_active{kind="termination",severity="critical"} 1.0' in text
    assert 'preemptd_events_total{type="notice"} 1.0' in text


async def test_reconnect_with_last_event_id_gets_exactly_the_missed_events(base: Path) -> None:
    async with running_agent(base) as agent:
        first = await SSEClient.connect(agent.config.socket)
        await first.next()
        agent.drills.drill(Kind.TERMINATION, 60, None, "one", {})
        await first.next()
        last_id = first.last_event_id
        await first.close()
        agent.drills.drill(Kind.REBALANCE, 60, None, "two", {})
        agent.drills.drill(Kind.MAINTENANCE, 60, None, "three", {})
        second = await SSEClient.connect(agent.config.socket, last_event_id=last_id)
        try:
            missed = [await second.next(), await second.next()]
        finally:
            await second.close()
    assert [("notice", "two"), ("notice", "three")] == [(e["type"], e["notice"]["reason"]) for e in missed]


async def test_idle_stream_receives_heartbeats(base: Path) -> None:
    async with running_agent(base, {"api.heartbeat_s": 0.1}) as agent:
        reader, writer = await asyncio.open_unix_connection(str(agent.config.socket))
        writer.write(b"GET /v1/events HTTP/1.1\r\nHost: x\r\n\r\n")
        data = b""
        while b": heartbeat" not in data:
            data += await asyncio.wait_for(reader.read(4096), 5)
        writer.close()
        await writer.wait_closed()
    assert b"event: snapshot" in data


async def test_client_that_disconnects_mid_stream_is_removed(base: Path) -> None:
    """The hub lets the stream go, and the streams' tally (info; each disconnect itself is at debug) counts it."""
    with capture_logs() as logs:
        async with running_agent(base) as agent:
            client = await SSEClient.connect(agent.config.socket)
            await client.next()
            await client.close()
            agent.drills.drill(Kind.TERMINATION, 60, None, "after", {})
            await eventually(lambda: len(agent.hub) == 0, what="subscriber removed")
    tally = [e for e in logs if e["event"] == "event_streams"]
    assert 0 == len(agent.hub)
    assert [(1, 1, 0)] == [(e["connected"], e["disconnected"], e["open"]) for e in tally]


async def test_client_that_never_reads_is_dropped_and_others_still_get_every_notice(base: Path) -> None:
    async with running_agent(base, {"api.queue_size": 8}) as agent:
        stuck = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        stuck.connect(str(agent.config.socket))
        # A small reader limit: once it holds a few KiB it stops reading from the socket.
        stuck_reader, stuck_writer = await asyncio.open_unix_connection(sock=stuck, limit=1024)
        stuck_writer.write(b"GET /v1/events HTTP/1.1\r\nHost: x\r\n\r\n")
        await stuck_reader.readuntil(b"event: snapshot")  # subscribed; from here on it never reads again
        healthy = await SSEClient.connect(agent.config.socket)
        await healthy.next()
        big = {"blob": "x" * 16384}
        with capture_logs() as logs:
            for i in range(400):
                agent.inject(
                    "test", Observation(key=f"k{i}", kind=Kind.REBALANCE, reason=f"n{i}", detail=big)
                )
                event = await healthy.next()
                assert f"n{i}" == event["notice"]["reason"]
        stuck_writer.close()
        await healthy.close()
    assert 1 == agent.hub.kicked_total
    assert ["subscriber_disconnected_slow"] == [
        e["event"] for e in logs if e["event"] == "subscriber_disconnected_slow"
    ]
