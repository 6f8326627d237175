"""The server: the agent's lifecycle, after uvicorn's ``Server`` — the lock, the socket (bound here or handed
over by systemd), the aiohttp runner and site, the signal loop, sd_notify, and the one bounded start and stop
order that every part runs in:

Start: descriptor limit → socket bound (or taken from systemd) and locked → the agent's state loaded and its
parts built and set up (``open``) → runner and site serve → loops, sources and components started
(``start_parts``) → ``READY=1``.
Stop (SIGTERM/SIGINT): ``STOPPING=1`` → stop accepting → sources, then components in reverse, then the event
streams (``stop_parts``) → server cleanup (bounded) → the agent's tasks and final state save (``close``) →
socket and lock released.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import grp
import os
import signal
import socket
import stat
from pathlib import Path
from typing import Any, Protocol

from aiohttp import web

from agent.config import Config
from agent.core.errors import AlreadyRunningError, ConfigError
from agent.core.ports import Tasks
from agent.service.clientlog import ClientMistakes
from agent.service.connections import (
    AcceptFailures,
    Budget,
    CappedSockSite,
    ConnectionCap,
    connection_budget,
    descriptor_limit,
    open_connections,
    open_descriptors,
    raise_descriptor_limit,
)
from agent.service.sdnotify import Notifier, listen_fds


class Served(Protocol):
    """What the server runs (``agent.service.daemon.Agent``), in the order in the module's docstring."""

    @property
    def config(self) -> Config: ...

    @property
    def opened(self) -> bool:
        """Whether ``open`` began: a start that failed before it leaves everything untouched at stop."""
        ...

    async def open(self) -> web.Application: ...

    async def start_parts(self) -> None: ...

    async def stop_parts(self, timeout: float) -> None: ...

    async def close(self, timeout: float) -> None: ...

    async def reload(self) -> None: ...


class Server:
    def __init__(
        self, served: Served, notifier: Notifier, tasks: Tasks, mistakes: ClientMistakes, log: Any
    ) -> None:
        self.served = served
        self.notifier = notifier
        self.tasks = tasks
        self.log = log
        self.socket_path: Path | None = None
        self.activated = False
        self.shutdown_event = asyncio.Event()
        self._mistakes = mistakes
        self._accept_failures = AcceptFailures(mistakes)
        wanted = served.config.api.max_connections
        # What the descriptor limit allows, once the socket is bound (_listen): connections and streams.
        self.budget = Budget(wanted, wanted)
        self._cap = ConnectionCap(wanted, "api.max_connections", self._on_refused)
        self._runner: web.AppRunner | None = None
        self._site: CappedSockSite | None = None
        self._listen_sock: socket.socket | None = None
        self._lock_fd: int | None = None
        self._created_socket = False
        self._stopping = False

    @property
    def serving(self) -> bool:
        """The API socket is served: its site started, and no stop begun."""
        return self._site is not None and not self._stopping

    @property
    def stopping(self) -> bool:
        return self._stopping

    # ----- start and stop -----

    async def startup(self) -> None:
        config = self.served.config
        sock = self._listen()
        app = await self.served.open()
        self._runner = web.AppRunner(
            app,
            handle_signals=False,
            access_log=None,
            shutdown_timeout=config.api.shutdown_timeout_s,
            # A client that hangs up cancels its handler at once, so its stream is dropped without waiting
            # for the next event to fail to write.
            handler_cancellation=True,
            # Also closes a connection that never completes a request head (idle or slowloris).
            keepalive_timeout=config.api.idle_timeout_s,
            # How long the unread rest of a refused body is drained before the connection is closed.
            lingering_time=config.api.idle_timeout_s,
        )
        await self._runner.setup()
        self._accept_failures.install(asyncio.get_running_loop())
        # asyncio's create_server calls listen() again with the site's backlog (aiohttp's default: 128),
        # also on a socket from systemd: pass ours, or clients connecting at once get EAGAIN. No longer than
        # the connection cap: what waits beyond it would only be refused.
        self._site = CappedSockSite(
            self._runner, sock, backlog=min(config.api.backlog, self._cap.limit), cap=self._cap
        )
        await self._site.start()
        if self.notifier.watchdog_s:
            self.tasks.spawn(self._watchdog_loop(self.notifier.watchdog_s), "watchdog")
        await self.served.start_parts()
        self.notifier.notify(ready=1, mainpid=os.getpid())

    async def shutdown(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        if not self.served.opened:  # start-up failed before anything ran: touch nothing
            self._release()
            return
        timeout = self.served.config.api.shutdown_timeout_s
        self.notifier.notify(stopping=1)
        if self._site is not None:
            # Stops accepting, lets the connections already accepted be set up, then closes the listener
            # (CappedSockSite.stop, around CPython gh-109564): the runner's cleanup below closes them all.
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._site.stop(), timeout)
        await self.served.stop_parts(timeout)
        if self._runner is not None:
            await self._runner.cleanup()
        await self.served.close(timeout)
        self._release()
        self._accept_failures.uninstall(asyncio.get_running_loop())
        self.notifier.close()

    async def run(self) -> None:
        """Start, serve until SIGTERM/SIGINT, stop. SIGHUP reloads the configuration."""
        loop = asyncio.get_running_loop()
        reloads: set[asyncio.Task[Any]] = set()

        def on_hup() -> None:
            if self.shutdown_event.is_set():
                self.log.info("reload_ignored", why="the agent is stopping")
                return
            task = loop.create_task(self.served.reload(), name="reload")
            reloads.add(task)
            task.add_done_callback(reloads.discard)

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.shutdown_event.set)
        loop.add_signal_handler(signal.SIGHUP, on_hup)
        try:
            await self.startup()
            await self.shutdown_event.wait()
        finally:
            # The handlers stay until shutdown() returns: a second SIGTERM (or a `systemctl reload`) during
            # the bounded shutdown must not kill the agent before its final state save.
            self.shutdown_event.set()
            try:
                for task in list(reloads):
                    await self.tasks.cancel(task, timeout=2.0)
                await self.shutdown()
            finally:
                for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                    loop.remove_signal_handler(sig)

    async def _watchdog_loop(self, interval_s: float) -> None:
        # Pinged from the event loop itself: a wedged loop misses the pings and systemd restarts the agent.
        while True:
            self.notifier.notify(watchdog=1)
            await asyncio.sleep(interval_s / 2)

    # ----- connections -----

    def connections(self) -> dict[str, Any]:
        """Connections served and refused, and the process's descriptors (status and metrics)."""
        return {
            "open": open_connections(self._runner) if self._runner is not None else 0,
            "max": self._cap.limit,
            "refused": self._cap.refused_total,
            "accept_failures": self._accept_failures.total,
            "idle_timeout_s": self.served.config.api.idle_timeout_s,
            "descriptors": {"open": open_descriptors(), "limit": descriptor_limit()[0]},
        }

    def _on_refused(self, open_now: int) -> None:
        self._mistakes.warning("connection_refused", open=open_now, max=self._cap.limit)

    # ----- the socket and the lock -----

    def _listen(self) -> socket.socket:
        config = self.served.config
        fd_limit = raise_descriptor_limit()
        wanted = config.api.max_connections
        metrics = config.metrics.max_connections if config.metrics.listen else 0
        self.budget = connection_budget(fd_limit, wanted, metrics)
        self._cap.limit = self.budget.connections
        if self.budget.connections < wanted:
            self.log.warning(
                "connection_cap_lowered",
                wanted=wanted,
                max_connections=self.budget.connections,
                event_streams=self.budget.streams,
                descriptor_limit=fd_limit,
                fix="raise LimitNOFILE= in the unit (or ulimit -n)",
            )
        activated = listen_fds()
        if activated:
            sock = activated[0]
            sock.setblocking(False)
            self.activated = True
            with contextlib.suppress(OSError):
                name = sock.getsockname()
                self.socket_path = Path(name) if isinstance(name, str) and name else config.socket
        else:
            # Bound (and locked) before the state is touched: a second agent must leave the first one's
            # state alone.
            sock = self._bind()
            self.socket_path = config.socket
        self._listen_sock = sock
        return sock

    def _take_lock(self, path: Path) -> None:
        lock_path = path.with_name(path.name + ".lock")
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise AlreadyRunningError(
                    f"another preemptd (pid {holder}) is serving {path}; stop it first"
                ) from exc
            raise
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self._lock_fd = fd

    def _bind(self) -> socket.socket:
        config = self.served.config
        path = config.socket
        path.parent.mkdir(mode=0o755 if os.geteuid() == 0 else 0o700, parents=True, exist_ok=True)
        self._take_lock(path)
        if path.exists() or path.is_symlink():
            if not stat.S_ISSOCK(path.lstat().st_mode):
                raise AlreadyRunningError(f"{path} exists and is not a socket; refusing to replace it")
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            probe.settimeout(1.0)
            try:
                probe.connect(str(path))
            except OSError:
                path.unlink()
                self.log.warning("stale_socket_replaced", socket=str(path))
            else:
                raise AlreadyRunningError(f"an agent is answering on {path}; refusing to start a second one")
            finally:
                probe.close()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(str(path))
        self._created_socket = True
        os.chmod(path, config.socket_mode)
        if config.socket_group:
            try:
                gid = grp.getgrnam(config.socket_group).gr_gid
            except KeyError as exc:
                sock.close()
                raise ConfigError(
                    f"key 'socket_group': no group named {config.socket_group!r} on this host"
                ) from exc
            os.chown(path, -1, gid)
        sock.listen(config.api.backlog)
        sock.setblocking(False)
        return sock

    def _release(self) -> None:
        if self._listen_sock is not None:
            self._listen_sock.close()
            self._listen_sock = None
        if self._created_socket and self.socket_path is not None:
            with contextlib.suppress(FileNotFoundError):
                self.socket_path.unlink()
            self._created_socket = False
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
