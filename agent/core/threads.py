"""Handing the result of work done on a thread back to the event loop, written once: sources that call
blocking libraries (NVML, psutil on a dead mount) run them on threads of their own and await a future."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    """Complete ``future`` (on its loop) unless it is done already (cancelled by a waiter that gave up)."""
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def deliver(loop: asyncio.AbstractEventLoop, callback: Callable[..., None], *args: Any) -> None:
    """Call ``callback(*args)`` on ``loop`` from a worker thread; the loop may be gone already (a thread
    stuck past shutdown): then nobody waits any more."""
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(callback, *args)


def run_for(
    loop: asyncio.AbstractEventLoop, future: asyncio.Future[T], fn: Callable[..., T], *args: Any
) -> None:
    """Call ``fn(*args)`` on this (worker) thread and hand its result or exception to ``future`` on
    ``loop``. The loop may be gone already (a thread stuck past shutdown): then nobody waits any more."""
    try:
        result, error = fn(*args), None
    except BaseException as exc:  # handed over, re-raised by the awaiting task
        result, error = None, exc
    deliver(loop, settle, future, result, error)


def call_in_thread(fn: Callable[..., T], *args: Any, name: str) -> asyncio.Future[T]:
    """Run ``fn(*args)`` on a new daemon thread named ``name``; its outcome completes the returned future on
    the running loop. Unlike the default executor, a call stuck for ever never delays exit."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()
    threading.Thread(target=run_for, args=(loop, future, fn, *args), name=name, daemon=True).start()
    return future


def drop(future: asyncio.Future[Any]) -> None:
    """Nobody will read ``future``'s outcome: cancel it if it is pending (a late outcome is then skipped by
    :func:`settle`), or mark a failure it already holds as seen — either way asyncio does not report an
    "exception was never retrieved"."""
    if not future.done():
        future.cancel()
    elif not future.cancelled():
        future.exception()


async def wait_or_drop(future: asyncio.Future[Any], timeout: float) -> bool:
    """Wait up to ``timeout`` seconds for ``future`` (completed by a worker thread); True once it is done.
    A waiting task that is cancelled drops the future (:func:`drop`)."""
    try:
        done, _ = await asyncio.wait({future}, timeout=timeout)
    except asyncio.CancelledError:
        drop(future)
        raise
    return bool(done)


async def call_bounded(fn: Callable[[], T], timeout: float, what: str) -> T:
    """``fn()`` on a daemon thread of its own (:func:`call_in_thread`), waited for at most ``timeout``
    seconds; past it, raises TimeoutError ("``what`` took longer than ...") and drops the late outcome."""
    future = call_in_thread(fn, name=f"preemptd: {what}")
    if not await wait_or_drop(future, timeout):
        drop(future)
        raise TimeoutError(f"{what} took longer than {timeout:g} s")
    return future.result()
