"""One background job of a store in flight at a time (a background save, a peer snapshot): the handle both
keep, and the thread that finishes the job, started and joined the same way for both."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar


@dataclass
class InFlight:
    """A job begun on the training thread: ``blocked_s`` is how long it blocked training (staging); ``error``
    is set if it failed, ``thread`` is the one finishing it."""

    step: int
    started: float
    blocked_s: float = 0.0
    error: BaseException | None = None
    thread: threading.Thread | None = None


class _Worker(Protocol):
    worker: threading.Thread | None


H = TypeVar("H", bound=InFlight)


class OneInFlight(Generic[H]):
    """At most one job in flight: :meth:`_launch` starts its thread, :meth:`_join` waits for it."""

    what = "the background job"  # as a person reads it in a TimeoutError: "<what> of step N is still running"

    def __init__(self) -> None:
        self.inflight: H | None = None

    def _launch(
        self, ranks: _Worker, handle: H, finish: Callable[..., None], args: tuple[Any, ...], name: str
    ) -> None:
        """Run ``finish(handle, *args)`` on a daemon thread of its own, which the store's ranks know as their
        worker (their collectives on it use the store's second group)."""
        handle.thread = threading.Thread(target=finish, args=(handle, *args), name=name, daemon=True)
        self.inflight = handle
        ranks.worker = handle.thread
        handle.thread.start()

    def _join(self, timeout: float | None) -> H | None:
        """Wait for the job in flight; it (done, failed or not), or None when none was in flight.
        TimeoutError when it is still running after ``timeout`` seconds."""
        handle = self.inflight
        if handle is None or handle.thread is None:
            return None
        handle.thread.join(timeout)
        if handle.thread.is_alive():
            raise TimeoutError(f"{self.what} of step {handle.step} is still running")
        self.inflight = None
        return handle
