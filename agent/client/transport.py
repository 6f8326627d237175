"""HTTP over the agent's Unix socket with the standard library only (``http.client``).

Used by the CLI and by the training-side client; every call has an explicit timeout.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from agent.core.paths import client_socket_path
from agent.core.sse import SSEDecoder, SSEMessage

DEFAULT_TIMEOUT_S = 5.0


class AgentUnavailable(ConnectionError):
    """The agent's socket is missing or refuses connections."""


class AgentHTTPError(RuntimeError):
    """The agent answered with an error status; ``status`` and ``body`` hold what it said."""

    def __init__(self, status: int, body: Any) -> None:
        message = body.get("error") if isinstance(body, Mapping) else body
        super().__init__(f"agent answered {status}: {message}")
        self.status = status
        self.body = body


class UnixHTTPConnection(http.client.HTTPConnection):
    """An ``HTTPConnection`` whose transport is a Unix stream socket."""

    def __init__(self, path: str | Path, timeout: float | None = DEFAULT_TIMEOUT_S) -> None:
        super().__init__("localhost", timeout=timeout)
        self.socket_path = str(path)

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self.socket_path)
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            sock.close()
            raise AgentUnavailable(f"no agent at {self.socket_path}: {exc.strerror or exc}") from exc
        except OSError:
            sock.close()
            raise
        self.sock = sock


def request_json(
    method: str,
    path: str,
    body: Any = None,
    socket_path: str | Path | None = None,
    timeout: float = DEFAULT_TIMEOUT_S,
) -> Any:
    """Send one request and return the decoded JSON answer; error statuses raise AgentHTTPError."""
    conn = UnixHTTPConnection(socket_path or client_socket_path(), timeout=timeout)
    try:
        headers = {"Accept": "application/json"}
        payload = None
        if body is not None:
            payload = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        conn.request(method, path, body=payload, headers=headers)
        response = conn.getresponse()
        raw = response.read()
    finally:
        conn.close()
    try:
        decoded: Any = json.loads(raw) if raw else None
    except ValueError:
        decoded = raw.decode("utf-8", errors="replace")
    if response.status >= 400:
        raise AgentHTTPError(response.status, decoded)
    return decoded


def request_text(path: str, socket_path: str | Path | None = None, timeout: float = DEFAULT_TIMEOUT_S) -> str:
    conn = UnixHTTPConnection(socket_path or client_socket_path(), timeout=timeout)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        raw = response.read()
    finally:
        conn.close()
    if response.status >= 400:
        raise AgentHTTPError(response.status, raw.decode("utf-8", errors="replace"))
    return raw.decode("utf-8", errors="replace")


class EventStream:
    """One open ``GET /v1/events`` stream. Iterate to get messages; ``close()`` ends it.

    ``read_timeout`` bounds the wait for the next bytes (heartbeats arrive every few seconds); a timeout raises
    ``TimeoutError`` so callers can reconnect.
    """

    def __init__(
        self,
        socket_path: str | Path | None = None,
        last_event_id: str | None = None,
        connect_timeout: float = DEFAULT_TIMEOUT_S,
        read_timeout: float | None = 60.0,
    ) -> None:
        self._conn = UnixHTTPConnection(socket_path or client_socket_path(), timeout=connect_timeout)
        headers = {"Accept": "text/event-stream"}
        if last_event_id is not None:
            headers["Last-Event-ID"] = last_event_id
        try:
            self._conn.request("GET", "/v1/events", headers=headers)
            self._response = self._conn.getresponse()
        except BaseException:
            self._conn.close()
            raise
        if self._response.status != 200:
            body = self._response.read()
            self._conn.close()
            raise AgentHTTPError(self._response.status, body.decode("utf-8", errors="replace"))
        if self._conn.sock is not None:
            self._conn.sock.settimeout(read_timeout)
        self.decoder = SSEDecoder()

    def __iter__(self) -> Iterator[SSEMessage]:
        while True:
            chunk = self._response.read1(65536)
            if not chunk:
                return
            yield from self.decoder.feed(chunk)

    def interrupt(self) -> None:
        """Wake a reader blocked in another thread (it sees the end of the stream); that thread closes.

        ``close()`` from a second thread races with ``http.client``'s own cleanup in the reading one."""
        sock = self._conn.sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        try:
            if self._conn.sock is not None:
                self._conn.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._conn.close()

    def __enter__(self) -> EventStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
