"""The watcher for asyncio programs: the same state and queries as :class:`agent.client.Watcher`, but the
stream is read by a task on the caller's event loop (stdlib ``asyncio`` streams, no thread, no aiohttp).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from agent.client.events import Trigger
from agent.client.watcher import (
    DEFAULT_SIGNALS,
    WatcherBase,
)
from agent.core.sse import SSEDecoder

MAX_HEADER_BYTES = 64 * 1024


class StreamError(Exception):
    """The agent's answer to ``GET /v1/events`` was not an event stream."""


class AsyncWatcher(WatcherBase):
    """``async with AsyncWatcher() as watcher: ... await watcher.wait()``; or ``start()`` / ``await stop()``."""

    def _init_runtime(self) -> None:
        self._task: asyncio.Task[None] | None = None
        self._changed: asyncio.Event | None = None
        self._connected: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def connected(self) -> bool:
        return self._connected is not None and self._connected.is_set()

    def start(self) -> AsyncWatcher:
        """Start the reader task on the running loop (and the signal handlers, if asked for)."""
        if self._task is not None:
            return self
        self._loop = asyncio.get_running_loop()
        self._changed = asyncio.Event()
        self._connected = asyncio.Event()
        for signum in self._signals:
            self._loop.add_signal_handler(signum, self._on_loop_signal, signum)
        self._task = self._loop.create_task(self._run(), name="preemptd-watcher")
        return self

    async def stop(self, timeout: float = 5.0) -> None:
        """Cancel the reader task and wait for it (bounded), then remove the signal handlers."""
        if self._loop is not None:
            for signum in self._signals:
                self._loop.remove_signal_handler(signum)
        task, self._task = self._task, None
        if task is not None:
            task.cancel("watcher stopping")
            with contextlib.suppress(asyncio.CancelledError, asyncio.TimeoutError):
                await asyncio.wait_for(task, timeout)
        await asyncio.to_thread(self._close_registrar, timeout)

    async def __aenter__(self) -> AsyncWatcher:
        return self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def wait_connected(self, timeout: float | None = None) -> bool:
        assert self._connected is not None, "start() the watcher first"
        try:
            await asyncio.wait_for(self._connected.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True

    async def wait(self, timeout: float | None = None) -> Trigger | None:
        """Wait until a trigger (notice or signal) is pending; returns it, or None after ``timeout``."""
        assert self._changed is not None, "start() the watcher first"
        loop = asyncio.get_running_loop()
        end = None if timeout is None else loop.time() + timeout
        while True:
            trig = self.trigger
            if trig is not None:
                return trig
            self._changed.clear()
            remaining = None if end is None else end - loop.time()
            if remaining is not None and remaining <= 0:
                return None
            try:
                await asyncio.wait_for(self._changed.wait(), remaining)
            except asyncio.TimeoutError:
                return self.trigger

    def _on_loop_signal(self, signum: int) -> None:
        self._on_signal(signum, None)

    def _wake_from_signal(self) -> None:
        # Loop signal handlers run as ordinary callbacks on the loop, where touching the Event is safe.
        if self._changed is not None:
            self._changed.set()

    async def _run(self) -> None:
        assert self._changed is not None and self._connected is not None
        loop = asyncio.get_running_loop()
        while True:
            opened = loop.time()
            try:
                async with self._open() as lines:
                    self.connects += 1
                    self._connected.set()
                    self._opened()
                    decoder = SSEDecoder()
                    async for chunk in lines:
                        for message in decoder.feed(chunk):
                            if self._handle(message):
                                self._changed.set()
                self.last_error = "the agent closed the stream"
            except (
                OSError,
                asyncio.TimeoutError,
                StreamError,
                ValueError,
                asyncio.IncompleteReadError,
                asyncio.LimitOverrunError,
            ) as exc:
                self.last_error = f"{type(exc).__name__}: {exc}"
            finally:
                self._connected.clear()
            if loop.time() - opened > 5 * self._backoff.maximum:
                self._backoff.reset()
            await asyncio.sleep(self._backoff.next())

    @contextlib.asynccontextmanager
    async def _open(self) -> AsyncIterator[AsyncIterator[bytes]]:
        reader, writer = await asyncio.wait_for(
            asyncio.open_unix_connection(str(self.socket_path)), self._connect_timeout
        )
        try:
            headers = ["GET /v1/events HTTP/1.1", "Host: localhost", "Accept: text/event-stream"]
            if self.last_event_id is not None:
                headers.append(f"Last-Event-ID: {self.last_event_id}")
            writer.write(("\r\n".join(headers) + "\r\n\r\n").encode("latin-1"))
            await writer.drain()
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), self._connect_timeout)
            status, fields = _parse_head(head)
            if status != 200:
                raise StreamError(f"GET /v1/events answered {status}")
            chunked = "chunked" in fields.get("transfer-encoding", "").lower()
            yield _body(reader, chunked, self._read_timeout)
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()


def _parse_head(head: bytes) -> tuple[int, dict[str, str]]:
    if len(head) > MAX_HEADER_BYTES:
        raise StreamError("response headers too long")
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/") or not parts[1].isdigit():
        raise StreamError(f"not an HTTP response: {lines[0]!r:.80}")
    fields: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if sep:
            fields[name.strip().lower()] = value.strip()
    return int(parts[1]), fields


async def _body(reader: asyncio.StreamReader, chunked: bool, read_timeout: float) -> AsyncIterator[bytes]:
    """The response body as it arrives; each read waits at most ``read_timeout`` (heartbeats keep it fed)."""
    while True:
        if not chunked:
            data = await asyncio.wait_for(reader.read(65536), read_timeout)
            if not data:
                return
            yield data
            continue
        size_line = await asyncio.wait_for(reader.readuntil(b"\r\n"), read_timeout)
        size = int(size_line.split(b";", 1)[0].strip() or b"0", 16)
        if size == 0:
            return
        data = await asyncio.wait_for(reader.readexactly(size + 2), read_timeout)
        yield data[:-2]


__all__ = ["DEFAULT_SIGNALS", "AsyncWatcher", "StreamError"]
