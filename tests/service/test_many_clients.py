"""A thousand event-stream clients connecting at once: every one gets the snapshot, then a drill notice.

The agent runs as a child process (its sockets and ours do not share one file-descriptor table), and the
clients are raw asyncio connections speaking HTTP/1.1 with chunked transfer decoding, cheap enough that a
thousand of them fit in the test's event loop."""

from __future__ import annotations

import asyncio
import json
import resource
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.core.sse import SSEDecoder, SSEMessage
from tests.support import AgentProcess, http_json

CLIENTS = 1000
# Per process: the clients (or, in the agent, their connections) plus what Python, pytest and the agent hold.
FDS_NEEDED = CLIENTS + 512


class ChunkedSSE:
    """Incremental decoder of an HTTP/1.1 chunked body that carries an event stream."""

    def __init__(self) -> None:
        self.sse = SSEDecoder()
        self._buf = b""
        self._left = 0  # bytes of chunk data still to come
        self._crlf = False  # the CRLF after a chunk's data is due
        self.ended = False

    def feed(self, data: bytes) -> list[SSEMessage]:
        self._buf += data
        messages: list[SSEMessage] = []
        while not self.ended:
            if self._left:
                piece, self._buf = self._buf[: self._left], self._buf[self._left :]
                self._left -= len(piece)
                messages += self.sse.feed(piece)
                if self._left:
                    break
                self._crlf = True
            if self._crlf:
                if len(self._buf) < 2:
                    break
                self._buf, self._crlf = self._buf[2:], False
            end = self._buf.find(b"\r\n")
            if end < 0:
                break
            size = int(self._buf[:end].split(b";")[0], 16)
            self._buf = self._buf[end + 2 :]
            self._left = size
            self.ended = size == 0
        return messages


class RawStream:
    """One ``GET /v1/events`` over a plain Unix-socket connection."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.body = ChunkedSSE()
        self.pending: list[SSEMessage] = []

    @classmethod
    async def open(cls, path: Path) -> RawStream:
        reader, writer = await asyncio.open_unix_connection(str(path))
        writer.write(b"GET /v1/events HTTP/1.1\r\nHost: agent\r\nAccept: text/event-stream\r\n\r\n")
        head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").lower()
        assert head.startswith("http/1.1 200"), head
        assert "transfer-encoding: chunked" in head, head
        return cls(reader, writer)

    async def next(self) -> dict[str, object]:
        while not self.pending:
            chunk = await self.reader.read(65536)
            if not chunk:
                raise ConnectionError("the agent closed the stream")
            self.pending += self.body.feed(chunk)
        doc: dict[str, object] = json.loads(self.pending.pop(0).data)
        return doc

    def close(self) -> None:
        self.writer.close()


@pytest.fixture
def many_fds() -> Iterator[None]:
    """Raise this process's soft RLIMIT_NOFILE for the clients (the agent child inherits it); restored
    afterwards."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < FDS_NEEDED:
        pytest.skip(f"RLIMIT_NOFILE hard limit {hard} < {FDS_NEEDED} needed for {CLIENTS} clients")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, FDS_NEEDED), hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.slow
async def test_thousand_clients_connecting_at_once_all_get_the_snapshot_and_the_drill(
    base: Path, many_fds: None
) -> None:
    proc = AgentProcess(base, extra_args=["--log-level", "warning"])
    await proc.start()
    streams: list[RawStream] = []
    try:

        async def subscribe() -> RawStream:
            stream = await RawStream.open(proc.socket_path)
            streams.append(stream)
            return stream

        async def snapshot(stream: RawStream) -> str:
            return str((await stream.next())["type"])

        async def notice_id(stream: RawStream) -> str:
            event = await stream.next()
            notice = event.get("notice")
            return f"{event['type']}:{notice['id'] if isinstance(notice, dict) else None}"

        async def scenario() -> None:
            # All connects are started before any is awaited: they hit the listen backlog together.
            opened = await asyncio.gather(*(subscribe() for _ in range(CLIENTS)))
            assert ["snapshot"] * CLIENTS == await asyncio.gather(*(snapshot(s) for s in opened))
            _, status = await http_json(proc.socket_path, "GET", "/v1/status")
            assert CLIENTS == status["subscribers"]["connected"]
            code, drill = await http_json(proc.socket_path, "POST", "/v1/drills", {"in_s": 60})
            assert 201 == code
            expected = f"notice:{drill['notice']['id']}"
            assert [expected] * CLIENTS == await asyncio.gather(*(notice_id(s) for s in opened))

        await asyncio.wait_for(scenario(), 45)
    finally:
        for stream in streams:
            stream.close()
        assert 0 == await proc.stop()
