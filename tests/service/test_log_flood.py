"""A real agent (``python -m agent run``, JSON logs to a file) under a flood of every kind of client
misbehaviour its socket sees, all at once for a few seconds: bodies that stop short of their Content-Length
(the client closes, or half-closes and waits), bodies that arrive too slowly, requests aiohttp cannot parse,
bodies that are not JSON or too large, event streams that connect and go, answers nobody reads, and valid
reports posted in a loop. The log grows by a handful of lines per kind (the rate limit's burst, or one line
of counts an interval), never an error or a traceback, and the agent keeps serving."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from agent.service.clientlog import BURST
from tests.support import AgentProcess, http_json

pytestmark = pytest.mark.slow

FLOOD_S = 3.0
IDLE_TIMEOUT_S = 0.5
REPORT = (
    "POST /v1/reports HTTP/1.1\r\nHost: agent\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n"
)
CUT_SHORT = REPORT.format(100).encode() + b'{"kind": "checkpoint"'
# Lines the agent writes at start and stop whatever happens in between.
OWN_EVENTS = {
    "reactors_built",
    "advisor_loaded",
    "ledger_open",
    "source_disabled",
    "nvml_unavailable",  # the GPU source's start line, which may land after the agent said it started
    "kmsg_unavailable",
    "agent_started",
    "agent_stopping",
    "agent_stopped",
}


async def connect(path: Path) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_unix_connection(str(path))


async def close(writer: asyncio.StreamWriter) -> None:
    writer.close()
    with contextlib.suppress(ConnectionError):
        await writer.wait_closed()


async def answer(reader: asyncio.StreamReader) -> bytes:
    with contextlib.suppress(ConnectionError):
        return await asyncio.wait_for(reader.read(), 10)
    return b""


async def cut_short_then_closed(path: Path) -> bytes:
    _, writer = await connect(path)
    writer.write(CUT_SHORT)
    await writer.drain()
    await close(writer)
    return b""


async def cut_short_then_half_closed(path: Path) -> bytes:
    """The client says it has sent everything (EOF) and waits for an answer."""
    reader, writer = await connect(path)
    writer.write(CUT_SHORT)
    await writer.drain()
    writer.write_eof()
    got = await answer(reader)
    await close(writer)
    return got


async def cut_short_then_reset(path: Path) -> bytes:
    """Gone with the agent's answer to an earlier request unread: on a Unix socket, the agent's next read
    or write fails with ECONNRESET."""
    _, writer = await connect(path)
    writer.write(b"GET /v1/status HTTP/1.1\r\nHost: agent\r\n\r\n" + CUT_SHORT)
    await writer.drain()
    await asyncio.sleep(0.01)  # the status answer arrives and stays unread
    writer.transport.abort()
    return b""


async def slow_body(path: Path) -> bytes:
    reader, writer = await connect(path)
    writer.write(CUT_SHORT)
    await writer.drain()
    got = await answer(reader)  # the agent answers 408 once api.idle_timeout_s has passed
    await close(writer)
    return got


async def request_aiohttp_cannot_parse(path: Path) -> bytes:
    reader, writer = await connect(path)
    writer.write(b"GET /v1/status HTTP/1.1\r\nHost: agent\r\nno colon here\r\n\r\n")
    got = await answer(reader)
    await close(writer)
    return got


async def broken_chunks(path: Path) -> bytes:
    reader, writer = await connect(path)
    writer.write(
        b'POST /v1/reports HTTP/1.1\r\nHost: agent\r\nTransfer-Encoding: chunked\r\n\r\n5\r\n{"kin\r\nzz\r\n'
    )
    got = await answer(reader)
    await close(writer)
    return got


async def not_json(path: Path) -> bytes:
    reader, writer = await connect(path)
    body = b"{not json"
    writer.write(
        REPORT.format(len(body)).encode().replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n") + body
    )
    got = await answer(reader)
    await close(writer)
    return got


async def too_large(path: Path) -> bytes:
    reader, writer = await connect(path)
    writer.write(REPORT.format(10**8).encode() + b"{")
    got = await answer(reader)
    await close(writer)
    return got


VALID = json.dumps(
    {"kind": "checkpoint", "phase": "finished", "step": 1, "duration_s": 0.5, "client": {"job": "flood"}}
).encode()


async def valid_report(path: Path) -> bytes:
    reader, writer = await connect(path)
    writer.write(
        REPORT.format(len(VALID)).encode().replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n") + VALID
    )
    got = await answer(reader)
    await close(writer)
    return got


async def stream_churn(path: Path) -> bytes:
    reader, writer = await connect(path)
    writer.write(b"GET /v1/events HTTP/1.1\r\nHost: agent\r\n\r\n")
    got = b""
    while b"event: snapshot" not in got:
        chunk = await asyncio.wait_for(reader.read(4096), 10)
        if not chunk:
            break
        got += chunk
    await close(writer)
    return got


async def stream_never_read(path: Path) -> bytes:
    _, writer = await connect(path)
    writer.write(b"GET /v1/events HTTP/1.1\r\nHost: agent\r\n\r\n")
    await writer.drain()
    await close(writer)
    return b""


async def answer_never_read(path: Path) -> bytes:
    _, writer = await connect(path)
    writer.write(b"GET /v1/status HTTP/1.1\r\nHost: agent\r\n\r\n")
    await writer.drain()
    await close(writer)
    return b""


Client = Callable[[Path], Awaitable[bytes]]
# Each kind, how many clients at once, and the status of its answer (None: no answer, or none read). Each
# client pauses PAUSE_S between connections: a flood of a few hundred connections a second in all, which the
# agent keeps up with on a loaded two-core machine (a faster one would test the connection cap instead).
PAUSE_S = 0.02
KINDS: dict[str, tuple[Client, int, bytes | None]] = {
    "cut_short_then_closed": (cut_short_then_closed, 2, None),
    "cut_short_then_half_closed": (cut_short_then_half_closed, 2, None),
    "cut_short_then_reset": (cut_short_then_reset, 2, None),
    "slow_body": (slow_body, 8, b"408"),
    "request_aiohttp_cannot_parse": (request_aiohttp_cannot_parse, 2, b"400"),
    "broken_chunks": (broken_chunks, 2, b"400"),
    "not_json": (not_json, 2, b"400"),
    "too_large": (too_large, 2, b"413"),
    "valid_report": (valid_report, 2, b"202"),
    "stream_churn": (stream_churn, 2, b"200"),
    "stream_never_read": (stream_never_read, 2, None),
    "answer_never_read": (answer_never_read, 2, None),
}


# Each kind floods for FLOOD_S, and longer (at most LONGEST_S) until it has made MIN_EACH requests: on a
# busy machine a kind whose answer takes long may not reach that many in FLOOD_S.
MIN_EACH = 10
LONGEST_S = 30.0


async def flood(path: Path, client: Client, workers: int, until: float) -> list[bytes]:
    answers: list[bytes] = []
    last = until - FLOOD_S + LONGEST_S

    async def worker() -> None:
        while time.monotonic() < until or (len(answers) < MIN_EACH and time.monotonic() < last):
            try:
                answers.append(await client(path))
            except OSError as exc:  # what the client sees is told apart from the answers
                answers.append(f"!{type(exc).__name__}".encode())
            await asyncio.sleep(PAUSE_S)

    await asyncio.gather(*(worker() for _ in range(workers)))
    return answers


async def test_a_flood_of_every_kind_of_bad_client_adds_a_handful_of_lines_per_kind(base: Path) -> None:
    agent = AgentProcess(base, ["--set", f"api.idle_timeout_s={IDLE_TIMEOUT_S}"])
    await agent.start()
    try:
        before = len(agent.logs_text().splitlines())
        until = time.monotonic() + FLOOD_S
        results = await asyncio.gather(
            *(flood(agent.socket_path, client, workers, until) for client, workers, _ in KINDS.values())
        )
        status, _ = await http_json(agent.socket_path, "GET", "/v1/status")
    finally:
        await agent.stop()
    assert 200 == status
    answers = dict(zip(KINDS, results, strict=True))
    # Every kind really flooded, and got the answer it should.
    assert dict.fromkeys(KINDS, True) == {kind: len(got) >= MIN_EACH for kind, got in answers.items()}, {
        kind: len(got) for kind, got in answers.items()
    }
    for kind, (_, _, expected) in KINDS.items():
        if expected is not None:  # "HTTP/1.1 400 Bad Request" (aiohttp's parser answers HTTP/1.0)
            assert {expected} == {got[9:12] for got in answers[kind]}, kind
    text = agent.logs_text()
    lines = text.splitlines()
    records = [json.loads(line) for line in lines]  # every line is a JSON object: no bare traceback lines
    assert [] == [r for r in records if r.get("level") in ("error", "critical") or "exception" in r]
    during = Counter(r["event"] for r in records[before:] if r["event"] not in OWN_EVENTS)
    # The rate limit's burst at most, per kind of line: a few seconds of flood is well inside one minute.
    assert {e: n for e, n in during.items() if n > BURST} == {}, during
    assert set(during) <= {
        "bad_request",
        "report_rejected",
        "event_streams",
        "reports_received",
    }, during
    assert len(text.encode()) < 32 * 1024, during
    # Every valid report counted in the one line of counts (written when the agent stops).
    [tally] = [r for r in records if r["event"] == "reports_received"]
    accepted = len(answers["valid_report"])
    assert (accepted, {"checkpoint finished": accepted}, {"flood": accepted}) == (
        tally["total"],
        tally["kinds"],
        tally["jobs"],
    )
