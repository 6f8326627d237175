"""Test helpers: a real agent on a short temporary Unix socket (in-process or as a child process), and a real
SSE client. Nothing here mocks the agent; waits are bounded and driven by events."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import sys
import tempfile
import threading
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp

from agent.client import EXIT_PREEMPTED
from agent.config import load_config
from agent.core.sse import SSEDecoder
from agent.service.daemon import Agent, Component
from agent.sources.base import Source

REPO = Path(__file__).resolve().parent.parent
FAULT_TOLERANT_EXAMPLE = REPO / "examples" / "fault_tolerant_training.py"


def short_tmp(prefix: str = "pd-") -> Path:
    """A short directory under /tmp: Unix socket paths are limited to 108 bytes."""
    return Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))


def agent_config(base: Path, settings: Mapping[str, Any] | None = None) -> Any:
    overrides: dict[str, Any] = {
        "socket": str(base / "a.sock"),
        "state_dir": str(base / "state"),
        "cloud": "none",
        "log_format": "json",
    }
    overrides.update(settings or {})
    return load_config(path=None, env={}, overrides=overrides)


@asynccontextmanager
async def running_agent(
    base: Path | None = None,
    settings: Mapping[str, Any] | None = None,
    sources: list[Source] | None = None,
    components: list[Component] | None = None,
) -> AsyncIterator[Agent]:
    """Start an agent in this event loop; ``sources``/``components`` None means what the config builds.

    ``settings`` maps dotted config keys to values (``{"api.heartbeat_s": 0.2}``).
    """
    base = base or short_tmp()
    agent = Agent(agent_config(base, settings), sources=sources, components=components)
    await agent.start()
    try:
        yield agent
    finally:
        await agent.stop()


class SSEClient:
    """A real event-stream client over the Unix socket (aiohttp's client and our SSE decoder)."""

    def __init__(self, session: aiohttp.ClientSession, response: aiohttp.ClientResponse) -> None:
        self.session = session
        self.response = response
        self.decoder = SSEDecoder()
        self._pending: list[dict[str, Any]] = []
        self.received: list[dict[str, Any]] = []

    @classmethod
    async def connect(
        cls, socket_path: Path | str, last_event_id: str | None = None, timeout: float = 10.0
    ) -> SSEClient:
        session = aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(socket_path)))
        headers = {"Last-Event-ID": last_event_id} if last_event_id is not None else {}
        try:
            response = await asyncio.wait_for(session.get("http://agent/v1/events", headers=headers), timeout)
        except BaseException:
            await session.close()
            raise
        if response.status != 200:
            body = await response.text()
            await session.close()
            raise AssertionError(f"events answered {response.status}: {body}")
        return cls(session, response)

    @property
    def last_event_id(self) -> str | None:
        return self.decoder.last_event_id

    async def next(self, timeout: float = 10.0) -> dict[str, Any]:
        """The next event as its JSON document; raises TimeoutError if none arrives in time."""
        async with asyncio.timeout(timeout) if sys.version_info >= (3, 11) else _timeout(timeout):
            while not self._pending:
                chunk = await self.response.content.readany()
                if not chunk:
                    raise ConnectionError("event stream closed")
                for message in self.decoder.feed(chunk):
                    doc = json.loads(message.data)
                    doc["_id"] = message.id
                    self._pending.append(doc)
        event = self._pending.pop(0)
        self.received.append(event)
        return event

    async def until(
        self, predicate: Callable[[dict[str, Any]], bool], timeout: float = 10.0
    ) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while True:
            event = await self.next(max(0.01, end - loop.time()))
            if predicate(event):
                return event

    async def close(self) -> None:
        self.response.close()
        await self.session.close()


@contextlib.asynccontextmanager
async def _timeout(seconds: float) -> AsyncIterator[None]:  # Python 3.10 stand-in for asyncio.timeout
    task = asyncio.current_task()
    assert task is not None
    handle = asyncio.get_running_loop().call_later(seconds, task.cancel)
    try:
        yield
    except asyncio.CancelledError as exc:
        raise TimeoutError from exc
    finally:
        handle.cancel()


async def eventually(predicate: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    """Wait, bounded, for a condition that no event announces (a peer's hang-up seen by the agent)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    for _ in range(1_000_000):
        if predicate():
            return
        if loop.time() > end:
            break
        await asyncio.sleep(0.01)
    raise TimeoutError(f"{what} not reached within {timeout}s")


def threads_named(prefix: str) -> set[threading.Thread]:
    """The live threads whose name starts with ``prefix`` (the agent names its worker threads)."""
    return {t for t in threading.enumerate() if t.name.startswith(prefix)}


async def threads_ended(threads: set[threading.Thread], timeout: float = 10.0) -> None:
    """Wait, bounded, until ``threads`` have ended. A worker thread hands its outcome to the loop
    (``call_soon_threadsafe``) before it ends, and the join's own result reaches the loop after that: when
    this returns, the callbacks those threads handed over have run."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    for thread in threads:
        await asyncio.to_thread(thread.join, max(0.0, end - loop.time()))
    alive = sorted(t.name for t in threads if t.is_alive())
    if alive:
        raise TimeoutError(f"threads {alive} still running after {timeout}s")


async def http_json(
    socket_path: Path | str, method: str, path: str, body: Any = None, raw: bytes | None = None
) -> tuple[int, Any]:
    async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(socket_path))) as session:
        kwargs: dict[str, Any] = {}
        if raw is not None:
            kwargs["data"] = raw
        elif body is not None:
            kwargs["json"] = body
        async with session.request(method, f"http://agent{path}", **kwargs) as response:
            text = await response.text()
            try:
                return response.status, json.loads(text)
            except ValueError:
                return response.status, text


class AgentProcess:
    """``python -m agent run`` as a child process, with a NOTIFY_SOCKET we listen on for READY=1."""

    def __init__(
        self,
        base: Path,
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        wrapper: Sequence[str] = (),
        notify_socket: str | None = None,
    ) -> None:
        """``wrapper`` is put before the agent's command line (``systemd-socket-activate -l …``); its
        stderr is then a pipe that :meth:`wrapper_line` reads. ``notify_socket`` is the ``NOTIFY_SOCKET``
        value to listen on, ``@name`` for an abstract socket; by default a file in ``base``."""
        self.base = base
        self.socket_path = base / "a.sock"
        self.state_dir = base / "state"
        self.extra_args = list(extra_args)
        self.env = dict(env or {})
        self.wrapper = list(wrapper)
        self.proc: asyncio.subprocess.Process | None = None
        self.notify_path = base / "notify.sock"
        self.notify_socket = notify_socket or str(self.notify_path)
        self.notifications: list[str] = []
        self._notify: socket.socket | None = None
        self.log_path = base / "agent.log"

    async def start(self, timeout: float = 20.0, wait_ready: bool = True) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.notify_path.unlink()
        self._notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        abstract = self.notify_socket.startswith("@")
        self._notify.bind("\0" + self.notify_socket[1:] if abstract else self.notify_socket)
        self._notify.setblocking(False)
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("PREEMPTD_", "NOTIFY_SOCKET", "LISTEN_", "JOURNAL_STREAM"))
        }
        env.update({"NOTIFY_SOCKET": self.notify_socket, "PYTHONPATH": str(REPO)})
        env.update(self.env)
        args = [
            *self.wrapper, sys.executable, "-m", "agent", "run",
            "--socket", str(self.socket_path), "--state-dir", str(self.state_dir),
            "--cloud", "none", "--log-format", "json", *self.extra_args,
        ]  # fmt: skip
        log = self.log_path.open("ab")
        stderr = asyncio.subprocess.PIPE if self.wrapper else asyncio.subprocess.STDOUT
        self.proc = await asyncio.create_subprocess_exec(
            *args, env=env, stdout=log, stderr=stderr, cwd=str(REPO)
        )
        log.close()
        if wait_ready:
            await self.wait_notification("READY=1", timeout)

    async def wait_notification(self, needle: str, timeout: float = 20.0, after: int = 0) -> str:
        """The first notification with the line ``needle``, among those after the first ``after`` ones
        (``after=len(proc.notifications)`` waits for a new one)."""
        assert self._notify is not None
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        for message in self.notifications[after:]:
            if needle in message.split("\n"):
                return message
        while True:
            remaining = end - loop.time()
            if remaining <= 0:
                raise TimeoutError(f"no {needle} from the agent; log:\n{self.logs_text()}")
            if self.proc is not None and self.proc.returncode is not None:
                raise AssertionError(f"agent exited with {self.proc.returncode}; log:\n{self.logs_text()}")
            try:
                data = await asyncio.wait_for(loop.sock_recv(self._notify, 65536), min(remaining, 0.5))
            except asyncio.TimeoutError:
                continue
            message = data.decode()
            self.notifications.append(message)
            if needle in message.split("\n"):
                return message

    async def wrapper_line(self, needle: str, timeout: float = 20.0) -> str:
        """The first line the wrapper writes to stderr that contains ``needle``."""
        assert self.proc is not None and self.proc.stderr is not None
        stderr = self.proc.stderr
        async with asyncio.timeout(timeout) if sys.version_info >= (3, 11) else _timeout(timeout):
            while True:
                line = (await stderr.readline()).decode(errors="replace")
                if not line:
                    raise AssertionError(f"the wrapper closed stderr before {needle!r}:\n{self.logs_text()}")
                if needle in line:
                    return line

    def logs_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def logs(self) -> list[dict[str, Any]]:
        records = []
        for line in self.logs_text().splitlines():
            with contextlib.suppress(ValueError):
                records.append(json.loads(line))
        return records

    async def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int:
        assert self.proc is not None
        if self.proc.returncode is None:
            self.proc.send_signal(sig)
            try:
                await asyncio.wait_for(self.proc.wait(), timeout)
            except asyncio.TimeoutError:
                self.proc.kill()
                await self.proc.wait()
                raise
        if self._notify is not None:
            while True:  # keep what arrived unread (STOPPING=1, the last STATUS=)
                try:
                    self.notifications.append(self._notify.recv(65536).decode())
                except BlockingIOError:
                    break
            self._notify.close()
            self._notify = None
        assert self.proc.returncode is not None
        return self.proc.returncode


async def cli(*args: str, socket: Path | None = None, timeout: float = 30.0) -> tuple[int, str, str]:
    """``preemptd ARGS`` as a child process (this repository, no PREEMPTD_ settings but ``socket``): its exit
    status, standard output and standard error."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREEMPTD_")}
    env["PYTHONPATH"] = str(REPO)
    if socket is not None:
        env["PREEMPTD_SOCKET"] = str(socket)
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "agent",
        *args,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), timeout)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


class ExampleRun:
    """The example as a child process; its JSON-lines progress is read as it comes."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.events: list[dict[str, Any]] = []
        self._seen = 0

    @classmethod
    async def start(cls, *args: str, env: Mapping[str, str] | None = None) -> ExampleRun:
        environ = {k: v for k, v in os.environ.items() if not k.startswith("PREEMPTD_")}
        environ.update({"PYTHONPATH": str(REPO), **(env or {})})
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            str(FAULT_TOLERANT_EXAMPLE),
            *args,
            env=environ,
            cwd=str(REPO),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        return cls(proc)

    async def until(self, event: str, timeout: float = 60.0) -> dict[str, Any]:
        """The next progress line of this kind (earlier unread lines are skipped over)."""
        return await asyncio.wait_for(self._until(event), timeout)

    async def _until(self, event: str) -> dict[str, Any]:
        assert self.proc.stdout is not None
        while True:
            while self._seen < len(self.events):
                doc = self.events[self._seen]
                self._seen += 1
                if doc["event"] == event:
                    return doc
            line = await self.proc.stdout.readline()
            if not line:
                stderr = await self.proc.stderr.read() if self.proc.stderr else b""
                raise AssertionError(f"example ended before {event!r}: {stderr.decode()[-3000:]}")
            self.events.append(json.loads(line))

    async def finish(self, timeout: float = 60.0) -> int:
        assert self.proc.stdout is not None and self.proc.stderr is not None
        rest, stderr = await asyncio.wait_for(self.proc.communicate(), timeout)
        self.events.extend(json.loads(line) for line in rest.decode().splitlines() if line.strip())
        assert self.proc.returncode is not None
        if self.proc.returncode not in (0, EXIT_PREEMPTED):
            raise AssertionError(f"example failed with {self.proc.returncode}: {stderr.decode()[-3000:]}")
        return self.proc.returncode

    def of(self, event: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["event"] == event]


async def drill(socket_path: Path, in_s: float = 30.0) -> str:
    status, body = await http_json(socket_path, "POST", "/v1/drills", {"kind": "termination", "in_s": in_s})
    assert status == 201, body
    return str(body["notice"]["id"])


async def hup_and_wait_ready(proc: AgentProcess) -> None:
    """SIGHUP, then wait for RELOADING=1 and the READY=1 that ends the reload (either way)."""
    assert proc.proc is not None
    seen = len(proc.notifications)
    proc.proc.send_signal(signal.SIGHUP)
    await proc.wait_notification("RELOADING=1", after=seen)
    reloading = next(
        i for i in range(seen, len(proc.notifications)) if "RELOADING=1" in proc.notifications[i]
    )
    await proc.wait_notification("READY=1", after=reloading + 1)
