"""Connection limits of the agent's listeners (the API socket and the TCP metrics listener): a cap on
concurrent connections with a 503 refusal past it, how the descriptor limit divides into connections and
event streams, the process's descriptor use, and accept failures logged at a bounded rate.

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
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from agent.service.clientlog import ClientMistakes

# Descriptors kept for everything but client connections: state and history files, the journal, cloud
# metadata requests, hooks and webhooks, the listening socket. Under a low descriptor limit, a quarter of it.
RESERVED_FDS = 256
# Connections served at once however low the descriptor limit: one held stream must never lock everyone out.
MIN_CONNECTIONS = 32
# How long a refused connection may take to send its request before it is closed anyway.
REFUSAL_WAIT_S = 1.0


@dataclass(frozen=True)
class Budget:
    """What a descriptor limit allows: ``connections`` at once, of which at most ``streams`` event streams,
    so that status, reports and drills (answered at once) always find a free connection."""

    connections: int
    streams: int


def connection_budget(fd_limit: int, wanted: int, others: int = 0) -> Budget:
    """The connection cap for a descriptor limit of ``fd_limit`` when ``wanted`` connections were asked
    for and ``others`` descriptors go to other listeners (the metrics listener): the limit less the
    reserve, never below :data:`MIN_CONNECTIONS` (nor above ``wanted``); an eighth of it (1 to 256) is
    kept from event streams."""
    reserved = min(RESERVED_FDS, fd_limit // 4)
    connections = min(wanted, max(MIN_CONNECTIONS, fd_limit - reserved - others))
    room = max(1, min(256, connections // 8)) if connections > 1 else 0
    return Budget(connections, connections - room)


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


class ConnectionCap:
    """At most ``limit`` connections served at once by one listener; the next ones are answered 503 with
    the reason (which names ``setting``, the key that sets the limit) and counted."""

    def __init__(self, limit: int, setting: str, on_refuse: Callable[[int], None]) -> None:
        self.limit = limit
        self.setting = setting
        self.refused_total = 0
        self._on_refuse = on_refuse

    def protocol(self, server: web.Server) -> asyncio.BaseProtocol:
        """A protocol for the connection just accepted: aiohttp's, or the refusal past the cap."""
        open_now = len(server.connections)
        if open_now < self.limit:
            return server()
        self.refused_total += 1
        self._on_refuse(open_now)
        reason = (
            f"the agent serves at most {self.limit} connections at once ({self.setting}) and all are in "
            "use; retry shortly"
        )
        return _Refusal(json.dumps({"error": reason}).encode())


async def stop_accepting(server: asyncio.AbstractServer | None) -> None:
    """Stop a listener accepting, then let the connections it has already accepted be set up: what a site
    does before its ``close()``, so that the runner's shutdown finds and closes every one of them.

    Works around CPython's gh-109564 (``asyncio.Server.close()`` races the accept; still open upstream):
    the accept callback takes a connection off the listening socket at once but builds its transport in
    a task that runs a loop iteration later. A ``close()`` in between makes that transport's
    ``Server._attach()`` fail (``assert self._sockets is not None``), which asyncio swallows: the accepted
    connection is neither served nor closed, its client waits, and its socket is closed only when
    collected, with an ``unclosed transport`` ResourceWarning.
    """
    if not isinstance(server, asyncio.Server):  # another loop's server (uvloop): not known to race
        return
    loop = asyncio.get_running_loop()
    for sock in server.sockets:
        loop.remove_reader(sock.fileno())
    # Callbacks run in the order they were scheduled: the accept tasks scheduled so far take their first
    # step (transport built and attached, connection_made scheduled) before the first yield returns, and
    # their connection_made (the connection registered with aiohttp's server) runs before the second does.
    await asyncio.sleep(0)
    await asyncio.sleep(0)


class CappedSockSite(web.SockSite):
    """A :class:`aiohttp.web.SockSite` (the API socket) whose connections go through a
    :class:`ConnectionCap`."""

    def __init__(
        self, runner: web.AppRunner, sock: socket.socket, *, backlog: int, cap: ConnectionCap
    ) -> None:
        super().__init__(runner, sock, backlog=backlog)
        self.cap = cap
        self._sock_ref = sock
        self._backlog_ref = backlog

    async def start(self) -> None:
        # SockSite.start() with a protocol factory that counts first (aiohttp has no hook for this).
        await web.BaseSite.start(self)
        server = self._runner.server
        assert server is not None
        self._server = await asyncio.get_running_loop().create_server(
            lambda: self.cap.protocol(server), sock=self._sock_ref, backlog=self._backlog_ref
        )

    async def stop(self) -> None:
        await stop_accepting(self._server)
        await super().stop()


class CappedTCPSite(web.TCPSite):
    """A :class:`aiohttp.web.TCPSite` (the metrics listener) whose connections go through a
    :class:`ConnectionCap`."""

    def __init__(self, runner: web.AppRunner, host: str, port: int, *, cap: ConnectionCap) -> None:
        super().__init__(runner, host, port, backlog=min(128, cap.limit), reuse_address=True)
        self.cap = cap
        self._address = (host, port)

    async def start(self) -> None:
        # TCPSite.start() with the counting protocol factory, as CappedSockSite.start().
        await web.BaseSite.start(self)
        server = self._runner.server
        assert server is not None
        self._server = await asyncio.get_running_loop().create_server(
            lambda: self.cap.protocol(server),
            *self._address,
            backlog=self._backlog,
            reuse_address=True,
        )

    async def stop(self) -> None:
        await stop_accepting(self._server)
        await super().stop()


def open_connections(runner: web.AppRunner) -> int:
    server = runner.server
    return len(server.connections) if server is not None else 0


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
