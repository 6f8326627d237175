"""Connection limits of a real agent: idle, slowloris and idle keep-alive connections are closed, event
streams are not, a connection past the cap is answered 503 with the reason, and accept failures (out of
descriptors) are logged at a bounded rate."""

from __future__ import annotations

import asyncio
import json
import resource
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from agent.core.notice import Kind
from agent.service.connections import Budget, connection_budget
from tests.support import AgentProcess, SSEClient, cli, eventually, http_json, running_agent

SHORT = {"api.idle_timeout_s": 0.5}


async def closed_by_agent(reader: asyncio.StreamReader, timeout: float = 10.0) -> bytes:
    """Everything the agent sent until it closed the connection (raises TimeoutError if it never does); a
    connection closed while the client was still writing may end in a reset instead of EOF."""
    try:
        return await asyncio.wait_for(reader.read(), timeout)
    except ConnectionError:  # reset, or a broken pipe seen through the shared transport
        return b""


async def test_a_connection_that_never_sends_a_request_is_closed(base: Path) -> None:
    async with running_agent(base, SHORT) as agent:
        reader, writer = await asyncio.open_unix_connection(str(agent.config.socket))
        assert b"" == await closed_by_agent(reader)
        writer.close()


async def test_a_request_head_sent_a_byte_at_a_time_is_cut_off(base: Path) -> None:
    async with running_agent(base, SHORT) as agent:
        reader, writer = await asyncio.open_unix_connection(str(agent.config.socket))

        async def trickle() -> None:
            for byte in b"GET /v1/status HTTP/1.1\r\nX-Slow: " + b"a" * 1000:
                if writer.is_closing():
                    return
                writer.write(bytes([byte]))
                try:
                    await writer.drain()
                except ConnectionError:
                    return
                await asyncio.sleep(0.05)

        sender = asyncio.ensure_future(trickle())
        answer = await closed_by_agent(reader)
        sender.cancel()
        writer.close()
    assert b"" == answer


async def test_an_idle_keep_alive_connection_is_closed_after_its_answer(base: Path) -> None:
    async with running_agent(base, SHORT) as agent:
        reader, writer = await asyncio.open_unix_connection(str(agent.config.socket))
        writer.write(b"GET /v1/status HTTP/1.1\r\nHost: agent\r\n\r\n")
        answer = await closed_by_agent(reader)
        writer.close()
    assert answer.startswith(b"HTTP/1.1 200 OK")


async def test_a_body_that_does_not_arrive_in_time_is_a_408(base: Path) -> None:
    async with running_agent(base, SHORT) as agent:
        reader, writer = await asyncio.open_unix_connection(str(agent.config.socket))
        writer.write(b'POST /v1/reports HTTP/1.1\r\nHost: agent\r\nContent-Length: 100\r\n\r\n{"kind"')
        answer = await asyncio.wait_for(reader.read(65536), 10)
        writer.close()
    assert answer.startswith(b"HTTP/1.1 408")
    assert b"\r\nConnection: close\r\n" in answer
    assert b"the body did not arrive within 0.5s" in answer


@pytest.mark.slow
async def test_an_event_stream_outlives_the_idle_timeout(base: Path) -> None:
    async with running_agent(base, {**SHORT, "api.heartbeat_s": 0.2}) as agent:
        client = await SSEClient.connect(agent.config.socket)
        await client.next()
        await asyncio.sleep(1.5)  # three idle timeouts: the stream must still be there
        agent.drills.drill(Kind.TERMINATION, 60, None, "drill", {})
        event = await client.next()
        await client.close()
    assert "notice" == event["type"]


async def test_past_the_cap_a_connection_is_answered_503_with_the_reason(base: Path) -> None:
    async with running_agent(base, {"api.max_connections": 3, "api.idle_timeout_s": 30}) as agent:
        held = [await asyncio.open_unix_connection(str(agent.config.socket)) for _ in range(3)]
        await eventually(lambda: agent.server.connections()["open"] == 3, what="three connections served")
        with capture_logs() as logs:
            status, body = await http_json(agent.config.socket, "GET", "/v1/status")
        for _, writer in held:
            writer.close()
        await eventually(lambda: agent.server.connections()["open"] == 0, what="held connections gone")
        _, doc = await http_json(agent.config.socket, "GET", "/v1/status")
        _, metrics = await http_json(agent.config.socket, "GET", "/metrics")
    assert 503 == status
    assert "at most 3 connections at once (api.max_connections)" in body["error"]
    assert ["connection_refused"] == [e["event"] for e in logs]
    assert (3, 1) == (doc["connections"]["max"], doc["connections"]["refused"])
    assert "preemptd_connections_refused_total 1.0" in metrics


async def test_status_and_metrics_report_the_descriptor_limit_and_use(base: Path) -> None:
    async with running_agent(base) as agent:
        _, doc = await http_json(agent.config.socket, "GET", "/v1/status")
        _, metrics = await http_json(agent.config.socket, "GET", "/metrics")
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert soft == doc["connections"]["descriptors"]["limit"]
    assert 0 < doc["connections"]["descriptors"]["open"] < soft
    assert f"preemptd_max_fds {float(soft)}" in metrics


CLIENTS = textwrap.dedent(
    """
    import socket, sys, time
    held = []
    for _ in range(int(sys.argv[2])):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(sys.argv[1])
        held.append(s)
    print("connected", flush=True)
    sys.stdin.read()
    """
)


@pytest.mark.slow
async def test_accept_failures_out_of_descriptors_are_logged_at_a_bounded_rate(base: Path) -> None:
    """The agent runs in this process: lowering this process's descriptor limit makes its accepts fail."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    async with running_agent(base, {"api.idle_timeout_s": 30}) as agent:
        clients = subprocess.Popen(  # noqa: ASYNC220 - started once, before the descriptors run out
            [sys.executable, "-c", CLIENTS, str(agent.config.socket), "40"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        try:
            with capture_logs() as logs:
                resource.setrlimit(
                    resource.RLIMIT_NOFILE, (agent.server.connections()["descriptors"]["open"], hard)
                )
                try:
                    assert clients.stdout is not None
                    await asyncio.wait_for(asyncio.to_thread(clients.stdout.readline), 20)
                    await eventually(lambda: agent.server.connections()["accept_failures"] >= 3, timeout=20)
                finally:
                    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        finally:
            clients.kill()
            clients.communicate()
        status, doc = await http_json(agent.config.socket, "GET", "/v1/status")
    warned = [e for e in logs if e["event"] == "accept_failed"]
    assert 200 == status
    assert 1 <= len(warned) <= 10
    assert {"warning"} == {e["log_level"] for e in warned}
    assert "Too many open files" in warned[0]["error"]
    assert doc["connections"]["accept_failures"] >= 3
    assert all(len(json.dumps(e)) < 1000 for e in warned)


async def test_preemptd_status_shows_connections_and_descriptors(base: Path) -> None:
    async with running_agent(base, {"api.max_connections": 100}) as agent:
        code, out, _ = await cli("status", socket=agent.config.socket)
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    line = next(line for line in out.splitlines() if line.startswith("Connections:"))
    assert 0 == code
    assert line.startswith("Connections: 1 open of 100, 0 refused; descriptors ")
    assert line.endswith(f" of {soft}")


async def open_stream(path: Path) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """An event stream on a raw connection, once its answer head arrived (200) or the connection closed."""
    reader, writer = await asyncio.open_unix_connection(str(path))
    writer.write(b"GET /v1/events HTTP/1.1\r\nHost: agent\r\n\r\n")
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    if not head.startswith(b"HTTP/1.1 200"):
        writer.close()
        raise AssertionError(f"no event stream: {head!r}")
    return reader, writer


async def test_under_a_low_descriptor_limit_streams_leave_room_for_status_and_drills(base: Path) -> None:
    """An agent started with RLIMIT_NOFILE 128 (hard, so it cannot raise it): the connection cap keeps a
    floor instead of dropping to 1, and event streams cannot take every connection: with all the streams
    it allows held open, one more is refused 503 while status and a drill are still answered."""
    proc = AgentProcess(base, wrapper=["prlimit", "--nofile=128:128", "--"])
    await proc.start()
    held: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    try:
        _, before = await http_json(proc.socket_path, "GET", "/v1/status")
        held = [await open_stream(proc.socket_path) for _ in range(before["subscribers"]["max"])]
        refused, why = await http_json(proc.socket_path, "GET", "/v1/events")
        status, _ = await http_json(proc.socket_path, "GET", "/v1/status")
        drill, _ = await http_json(proc.socket_path, "POST", "/v1/drills", {"in_s": 60})
    finally:
        for _, writer in held:
            writer.close()
        assert 0 == await proc.stop()
    assert (128, 96, 84) == (
        before["connections"]["descriptors"]["limit"],
        before["connections"]["max"],
        before["subscribers"]["max"],
    )
    assert (503, 200, 201) == (refused, status, drill)
    assert "84 subscribers connected, the limit is 84" in why["error"]


@pytest.mark.parametrize(
    ("fd_limit", "wanted", "others", "expected"),
    [
        (65536, 8192, 0, Budget(8192, 7936)),
        (1024, 8192, 0, Budget(768, 672)),
        (1024, 8192, 64, Budget(704, 616)),
        (128, 8192, 0, Budget(96, 84)),
        (40, 8192, 0, Budget(32, 28)),
        (1024, 3, 0, Budget(3, 2)),
    ],
    ids=["plenty", "1024", "1024-with-metrics", "128", "floor", "asked-for-3"],
)
def test_the_descriptor_limit_divides_into_connections_and_event_streams(
    fd_limit: int, wanted: int, others: int, expected: Budget
) -> None:
    """The cap is the limit less a reserve, never below 32 unless fewer were asked for; an eighth of it (1 to
    256) is kept from event streams."""
    assert expected == connection_budget(fd_limit, wanted, others)
