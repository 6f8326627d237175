"""Handing the result of work done on a thread back to the event loop, written once: sources that call
blocking libraries (NVML, psutil on a dead mount) run them on threads of their own and await a future."""

from __future__ import annotations

import asyncio
import contextlib
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
