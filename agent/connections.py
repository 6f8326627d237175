"""Connection limits of the API socket: a cap on concurrent connections with a 503 refusal past it, the
process's descriptor limit and use, and accept failures logged at a bounded rate.

Idle, slow (slowloris) and idle keep-alive connections are closed by aiohttp's keep-alive timeout, which
also runs from the moment a connection is accepted until its first complete request head; a request being
handled (an event stream) is exempt. This module adds what aiohttp leaves to the application.
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import socket
from collections.abc import Callable
from typing import Any

from aiohttp import web

from agent.clientlog import ClientMistakes

# Descriptors kept for everything but client connections: state and history files, the journal, cloud
# metadata requests, hooks and webhooks, the listening socket.
RESERVED_FDS = 256
# How long a refused connection may take to send its request before it is closed anyway.
REFUSAL_WAIT_S = 1.0


def descriptor_limit() -> tuple[int, int]:
    """The soft and hard RLIMIT_NOFILE."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft, hard


def raise_descriptor_limit() -> int:
    """Raise the soft descriptor limit to the hard one (what systemd's LimitNOFILE= grants); returns the
    soft limit in force."""
    soft, hard = descriptor_limit()
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft


def open_descriptors() -> int | None:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return None


class _Refusal(asyncio.Protocol):
    """Answers one request with 503 and the reason, then closes: the cap is reached."""

    def __init__(self, body: bytes) -> None:
        self._answer = (
            b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            b"Connection: close\r\nRetry-After: 1\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        self._transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        self._timer = asyncio.get_running_loop().call_later(REFUSAL_WAIT_S, self._answer_and_close)

    def data_received(self, data: bytes) -> None:
        # Answering after the request has arrived lets the client read the answer instead of a reset.
        self._answer_and_close()

    def eof_received(self) -> bool:
        self._answer_and_close()
        return False

    def _answer_and_close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        transport, self._transport = self._transport, None
        if transport is not None and not transport.is_closing():
            transport.write(self._answer)
            transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._transport = None


class CappedSockSite(web.SockSite):
    """A :class:`aiohttp.web.SockSite` that serves at most ``max_connections`` connections at once and
    answers the next ones with 503 and the reason."""

    def __init__(
        self,
        runner: web.AppRunner,
        sock: socket.socket,
        *,
        backlog: int,
        max_connections: int,
        on_refuse: Callable[[int], None],
    ) -> None:
        super().__init__(runner, sock, backlog=backlog)
        self.max_connections = max_connections
        self.refused_total = 0
        self._on_refuse = on_refuse
        self._sock_ref = sock
        self._backlog_ref = backlog

    @property
    def open_connections(self) -> int:
        server = self._runner.server
        return len(server.connections) if server is not None else 0

    async def start(self) -> None:
        # SockSite.start() with a protocol factory that counts first (aiohttp has no hook for this).
        await web.BaseSite.start(self)
        server = self._runner.server
        assert server is not None
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: self._protocol(server), sock=self._sock_ref, backlog=self._backlog_ref
        )

    def _protocol(self, server: web.Server) -> asyncio.BaseProtocol:
        open_now = len(server.connections)
        if open_now < self.max_connections:
            return server()
        self.refused_total += 1
        self._on_refuse(open_now)
        reason = (
            f"the agent serves at most {self.max_connections} connections at once "
            "(api.max_connections) and all are in use; retry shortly"
        )
        return _Refusal(json.dumps({"error": reason}).encode())


class AcceptFailures:
    """A loop exception handler that turns asyncio's accept failures (out of descriptors, which repeat for
    as long as the condition lasts) into rate-limited warnings and passes everything else on."""

    def __init__(self, mistakes: ClientMistakes) -> None:
        self._mistakes = mistakes
        self._previous: Any = None
        self.total = 0

    def install(self, loop: asyncio.AbstractEventLoop) -> None:
        self._previous = loop.get_exception_handler()
        loop.set_exception_handler(self._handle)

    def uninstall(self, loop: asyncio.AbstractEventLoop) -> None:
        loop.set_exception_handler(self._previous)

    def _handle(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        message = str(context.get("message", ""))
        if message.startswith("socket.accept() out of system resource"):
            self.total += 1
            exc = context.get("exception")
            self._mistakes.warning(
                "accept_failed",
                error=str(exc) if exc is not None else message,
                open_descriptors=open_descriptors(),
                limit=descriptor_limit()[0],
            )
            return
        if self._previous is not None:
            self._previous(loop, context)
        else:
            loop.default_exception_handler(context)
