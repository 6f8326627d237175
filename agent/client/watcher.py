"""The watcher: one event stream to the agent kept open on a background thread, so the training loop only reads
a flag (:meth:`Watcher.should_checkpoint`) and never waits on the network.

It starts before the agent does without failing, reconnects with backoff and ``Last-Event-ID``, and can turn
SIGTERM/SIGUSR1 into the same trigger as a notice from the socket.
"""

from __future__ import annotations

import contextlib
import http.client
import logging
import os
import random
import select
import signal
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from datetime import datetime, timezone
from pathlib import Path
from types import FrameType
from typing import Any

from agent.client.events import (
    CLEARED,
    READY,
    Change,
    Notice,
    NoticeState,
    Trigger,
    TriggerPolicy,
    parse_event,
)
from agent.client.preempted import withdraw_gone
from agent.client.reporting import Reporter, client_info
from agent.client.transport import AgentHTTPError, AgentUnavailable, EventStream
from agent.core.paths import client_socket_path
from agent.core.sse import SSEMessage

log = logging.getLogger("agent.client")

DEFAULT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

NoticeCallback = Callable[[Notice], None]
TriggerCallback = Callable[[Trigger], None]
ReadyCallback = Callable[[str, dict[str, Any]], None]
SignalHandler = Callable[[int, FrameType | None], Any] | int | None


def _utcnow() -> datetime:
    return datetime.now(timezone.utc)


class Backoff:
    """Exponential reconnect delays with jitter, reset once a connection has lived long enough."""

    def __init__(self, initial: float = 0.05, maximum: float = 2.0, jitter: float = 0.2) -> None:
        self.initial = initial
        self.maximum = maximum
        self.jitter = jitter
        self._next = initial

    def next(self) -> float:
        delay = self._next
        self._next = min(self.maximum, self._next * 2)
        return delay * (1 + random.uniform(-self.jitter, self.jitter))

    def reset(self) -> None:
        self._next = self.initial


class WatcherBase:
    """State, queries and callbacks shared by the threaded :class:`Watcher` and the asyncio watcher.

    Callbacks run on the watcher's thread (or its event loop): keep them short, never block in them.
    ``on_notice`` sees new and updated notices, ``on_cleared`` cleared ones, ``on_trigger`` each new trigger
    from the socket (a signal only sets the flag: a signal handler must not run user code).

    ``participant`` (default True): each connection registers this process as a participant of the agent's
    ready step, named by ``client`` (:func:`~agent.client.reporting.client_info` by default, the name the
    store's reports use), so a notice waits for its emergency checkpoint even before its first save. Pass
    False for a process that only watches (a dashboard, a sidecar).
    """

    def __init__(
        self,
        socket_path: str | Path | None = None,
        *,
        policy: TriggerPolicy | None = None,
        on_notice: NoticeCallback | None = None,
        on_cleared: NoticeCallback | None = None,
        on_trigger: TriggerCallback | None = None,
        on_ready: ReadyCallback | None = None,
        signals: Iterable[int] | None = None,
        backoff: Backoff | None = None,
        connect_timeout: float = 2.0,
        read_timeout: float = 45.0,
        clock: Callable[[], datetime] = _utcnow,
        participant: bool = True,
        client: Mapping[str, Any] | None = None,
    ) -> None:
        self.socket_path = Path(socket_path) if socket_path is not None else client_socket_path()
        self._signals = tuple(signals) if signals is not None else ()
        self._backoff = backoff or Backoff()
        self._connect_timeout = connect_timeout
        self._read_timeout = read_timeout
        # The watcher starts with the job: a notice whose deadline passed before then does not trigger it.
        self._state = NoticeState(policy, started_at=clock())
        self._lock = threading.Lock()
        self._clock = clock
        self._on_notice = [on_notice] if on_notice else []
        self._on_cleared = [on_cleared] if on_cleared else []
        self._on_trigger = [on_trigger] if on_trigger else []
        self._on_ready = [on_ready] if on_ready else []
        self.last_event_id: str | None = None
        # Written by signal handlers without a lock: a single attribute store is atomic in CPython.
        self._signal_trigger: Trigger | None = None
        self._previous_handlers: dict[int, SignalHandler] = {}
        self.connects = 0
        self.last_error: str | None = None
        # A training process counts from its first connection: each one registers it as a participant (again
        # after the agent restarted), under the name its checkpoint reports use (``client_info()``).
        self.participant = participant
        self._client = dict(client) if client is not None else None
        self._registrar: Reporter | None = None
        self._init_runtime()

    def _init_runtime(self) -> None:
        """Per-instance state of the thread or asyncio runner; subclasses set it up here."""

    def _opened(self) -> None:
        """The stream is open: register this process as a participant (on the reporter's thread)."""
        if not self.participant:
            return
        if self._registrar is None:
            client = self._client if self._client is not None else client_info()
            self._registrar = Reporter(self.socket_path, client={**client, "participant": True})
        self._registrar.register()

    def _close_registrar(self, timeout: float) -> None:
        if self._registrar is not None:
            self._registrar.close(timeout)

    # -- queries (any thread) ---------------------------------------------------------------------------

    @property
    def policy(self) -> TriggerPolicy:
        """Which notices call for a checkpoint (the others may still raise the hazard: agent.client.hazard)."""
        return self._state.policy

    @property
    def notices(self) -> tuple[Notice, ...]:
        """Every active notice."""
        with self._lock:
            return tuple(self._state.notices.values())

    @property
    def notice(self) -> Notice | None:
        """The most urgent active notice, or None."""
        with self._lock:
            return self._state.most_urgent()

    @property
    def deadline(self) -> datetime | None:
        """The earliest deadline among the active notices that call for a checkpoint, or None."""
        with self._lock:
            return self._state.earliest_deadline()

    def time_left(self) -> float | None:
        """Seconds until :attr:`deadline`; None when no notice with a deadline is active."""
        deadline = self.deadline
        if deadline is None:
            return None
        return max(0.0, (deadline - self._clock()).total_seconds())

    def should_checkpoint(self) -> bool:
        """True while a trigger (notice or signal) has not been acknowledged. Cheap: no I/O, no waiting."""
        return self._signal_trigger is not None or bool(self._state.pending)

    @property
    def trigger(self) -> Trigger | None:
        """The most urgent unacknowledged trigger; a signal comes first (it usually means "now")."""
        signalled = self._signal_trigger
        if signalled is not None:
            return signalled
        with self._lock:
            return self._state.first_trigger()

    def acknowledge(self) -> None:
        """Mark the current triggers handled (call after the checkpoint they asked for is durable)."""
        self._signal_trigger = None
        with self._lock:
            self._state.acknowledge()

    def mark_handled(self, notice_ids: Iterable[str | None]) -> None:
        """These notices already have their emergency checkpoint (a resumed run passes the notice id of the
        checkpoint it resumed from): they do not trigger again while they stay active."""
        with self._lock:
            self._state.mark_handled(n for n in notice_ids if n)

    # -- callbacks --------------------------------------------------------------------------------------

    def add_callback(
        self,
        *,
        on_notice: NoticeCallback | None = None,
        on_cleared: NoticeCallback | None = None,
        on_trigger: TriggerCallback | None = None,
        on_ready: ReadyCallback | None = None,
    ) -> None:
        if on_notice:
            self._on_notice.append(on_notice)
        if on_cleared:
            self._on_cleared.append(on_cleared)
        if on_trigger:
            self._on_trigger.append(on_trigger)
        if on_ready:
            self._on_ready.append(on_ready)

    # -- stream handling --------------------------------------------------------------------------------

    def _handle(self, message: SSEMessage) -> bool:
        """Apply one SSE message; True when it raised a new trigger."""
        if message.id is not None:
            self.last_event_id = message.id
        doc = parse_event(message.data)
        if doc is None:
            log.debug("preemptd client: ignoring a non-JSON event %r", message.event)
            return False
        event_type = str(doc.get("type") or message.event)
        if event_type == READY:
            self._ready(doc)
            return False
        with self._lock:
            before = set(self._state.pending)
            changes = self._state.apply(event_type, doc, self._clock())
            new = [t for nid, t in self._state.pending.items() if nid not in before]
        for change in changes:
            self._dispatch(change)
        for trig in new:
            for callback in self._on_trigger:
                self._call(callback, trig)
        return bool(new)

    def _ready(self, doc: Any) -> None:
        data = doc.get("data") if isinstance(doc.get("data"), dict) else {}
        notice = doc.get("notice") if isinstance(doc.get("notice"), dict) else {}
        notice_id = str(data.get("notice_id") or notice.get("id") or "")
        for callback in self._on_ready:
            self._call(callback, notice_id, dict(data))

    def _dispatch(self, change: Change) -> None:
        callbacks = self._on_cleared if change.type == CLEARED else self._on_notice
        for callback in callbacks:
            self._call(callback, change.notice)

    @staticmethod
    def _call(callback: Callable[..., None], *args: Any) -> None:
        try:
            callback(*args)
        except Exception:  # a user callback must never kill the watcher
            log.exception("preemptd client: a watcher callback raised")

    # -- signals ----------------------------------------------------------------------------------------

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._signal_trigger = Trigger("signal", self._clock(), signum=signum)
        self._wake_from_signal()
        previous = self._previous_handlers.get(signum)
        if callable(previous):
            previous(signum, frame)

    def _wake_from_signal(self) -> None:
        """Wake anyone blocked in ``wait``; must be safe inside a signal handler."""

    def _restore_signal_handlers(self) -> None:
        for signum, previous in self._previous_handlers.items():
            # ValueError: not the main thread any more; nothing better to do then.
            with contextlib.suppress(ValueError, OSError):
                signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        self._previous_handlers.clear()


class Watcher(WatcherBase):
    """Keeps ``GET /v1/events`` open on a daemon thread. Use as a context manager or ``start()``/``stop()``.

    >>> with Watcher() as watcher:          # doctest: +SKIP
    ...     for step in range(start, steps):
    ...         train(step)
    ...         if watcher.should_checkpoint():
    ...             store.save(step + 1, writer, emergency=True, notice_id=watcher.trigger.notice_id)
    ...             watcher.acknowledge()
    """

    def _init_runtime(self) -> None:
        self._stop = threading.Event()
        self._connected = threading.Event()
        self._thread: threading.Thread | None = None
        self._stream: EventStream | None = None
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    def wait_connected(self, timeout: float | None = None) -> bool:
        """Block until the stream is open (the snapshot may still be on its way)."""
        return self._connected.wait(timeout)

    def start(self) -> Watcher:
        """Start following the agent (a thread). Under ``preemptd exec``, a process of the job starting means
        the job went on: records that earlier processes stopped for a notice are withdrawn first
        (:func:`agent.client.preempted.withdraw_gone`)."""
        if self._thread is not None:
            return self
        withdraw_gone()
        if self._signals:
            self.install_signal_handlers(self._signals)
        self._thread = threading.Thread(target=self._run, name="preemptd-watcher", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Close the stream, end the thread (bounded wait) and restore signal handlers."""
        self._stop.set()
        with self._lock:
            stream = self._stream
        if stream is not None:
            stream.interrupt()
        self._wake()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        self._close_registrar(timeout)
        self._restore_signal_handlers()
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._wake_r = self._wake_w = -1

    def __enter__(self) -> Watcher:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def install_signal_handlers(self, signals: Iterable[int] = DEFAULT_SIGNALS) -> None:
        """Make these signals raise a trigger (main thread only). Earlier Python handlers are still called;
        the default action (terminate) is not: the training loop decides when to exit."""
        for signum in signals:
            previous = signal.signal(signum, self._on_signal)
            self._previous_handlers.setdefault(signum, previous)

    def wait(self, timeout: float | None = None) -> Trigger | None:
        """Block until a trigger is pending (or ``timeout`` passes); returns it, or None."""
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            trig = self.trigger
            if trig is not None or self._stop.is_set():
                return trig
            remaining = None if end is None else end - time.monotonic()
            if remaining is not None and remaining <= 0:
                return None
            try:
                select.select([self._wake_r], [], [], remaining)
                os.read(self._wake_r, 4096)
            except (BlockingIOError, InterruptedError):
                continue
            except (OSError, ValueError):  # the watcher was stopped under us
                return self.trigger

    def _wake(self) -> None:
        # OSError: the pipe is full (a wake-up is pending anyway) or closed (stopped).
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"\0")

    def _wake_from_signal(self) -> None:
        self._wake()

    def _run(self) -> None:
        while not self._stop.is_set():
            opened = time.monotonic()
            try:
                stream = EventStream(
                    self.socket_path,
                    last_event_id=self.last_event_id,
                    connect_timeout=self._connect_timeout,
                    read_timeout=self._read_timeout,
                )
            except (AgentUnavailable, AgentHTTPError, OSError, http.client.HTTPException) as exc:
                error = f"{type(exc).__name__}: {exc}"
                if not isinstance(exc, AgentUnavailable) and error != self.last_error:
                    # Not "no agent yet" (normal before it starts) but something to fix: say it once.
                    log.warning("preemptd client: cannot follow %s: %s", self.socket_path, error)
                self.last_error = error
                self._stop.wait(self._backoff.next())
                continue
            with self._lock:
                self._stream = stream
            self.connects += 1
            self._connected.set()
            self._opened()
            try:
                if not self._stop.is_set():
                    for message in stream:
                        if self._handle(message):
                            self._wake()
                self.last_error = "the agent closed the stream"
            except (OSError, http.client.HTTPException, ValueError) as exc:
                self.last_error = f"{type(exc).__name__}: {exc}"
            finally:
                self._connected.clear()
                with self._lock:
                    self._stream = None
                stream.close()
            if time.monotonic() - opened > 5 * self._backoff.maximum:
                self._backoff.reset()
            self._stop.wait(self._backoff.next())
