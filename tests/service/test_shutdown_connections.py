"""Connections that reach the agent while it stops: every connection it accepted is closed by the agent,
none is left for the garbage collector (an ``unclosed transport`` ResourceWarning)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import socket
import threading
import warnings
from pathlib import Path

import pytest

from agent.service.daemon import Agent
from tests.support import agent_config

POST = b"POST /v1/reports HTTP/1.1\r\nHost: agent\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"
# How many times the loop is let run between the last connection and the stop: the stop must be safe
# whichever step of an accept (accepted, its protocol and transport being built, served) it lands on. On
# asyncio's own server one of them lands between the accept and the transport's set-up (CPython gh-109564).
YIELDS = range(4)
ROUNDS = 2
BURST = 3


def post(path: str) -> None:
    """One raw HTTP POST over a blocking socket, answer read to the end; any connection error is fine."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        with contextlib.suppress(OSError):
            sock.connect(path)
            sock.sendall(POST)
            while sock.recv(65536):
                pass


def hammer(path: str, done: threading.Event) -> None:
    while not done.is_set():
        post(path)


async def stop_while_connecting(base: Path, yields: int) -> None:
    agent = Agent(agent_config(base))
    await agent.start()
    path = str(agent.config.socket)
    done = threading.Event()
    thread = threading.Thread(target=hammer, args=(path, done), daemon=True)
    burst = [socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(BURST)]
    try:
        thread.start()
        # Connections queued in the listening socket's backlog as the stop begins (a Unix socket's
        # connect() returns once queued), their requests sent.
        for sock in burst:
            sock.connect(path)
            sock.sendall(POST)
        for _ in range(yields):
            await asyncio.sleep(0)
    finally:
        await agent.stop()
        done.set()
        for sock in burst:
            sock.close()
        await asyncio.to_thread(thread.join)


@pytest.mark.slow
@pytest.mark.timeout(180)  # eight agents started and stopped: about 20 s on a busy 2-core machine, 60 s seen
async def test_connections_accepted_while_the_agent_stops_are_all_closed(base: Path) -> None:
    """An agent stopped while clients connect (a burst queued as the stop begins, one client connecting
    throughout) closes every connection it accepted: no unclosed transport or socket is collected later."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        for yields in YIELDS:
            for n in range(ROUNDS):
                await stop_while_connecting(base / f"{yields}-{n}", yields)
                gc.collect()
    assert [] == [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
