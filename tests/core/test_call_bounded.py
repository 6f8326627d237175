"""agent.core.threads.call_bounded, which SIGHUP's configuration read goes through: the result or the exception
of a call on a thread of its own, or a TimeoutError once the wait is over while the call is still stuck."""

from __future__ import annotations

import threading

import pytest

from agent.core.errors import ConfigError
from agent.core.threads import call_bounded


async def test_the_result_comes_back() -> None:
    assert 42 == await call_bounded(lambda: 42, 10.0, "answering")


async def test_the_exception_comes_back() -> None:
    def refuse() -> None:
        raise ConfigError("config.toml: is a FIFO")

    with pytest.raises(ConfigError, match="is a FIFO"):
        await call_bounded(refuse, 10.0, "reading the configuration")


async def test_a_stuck_call_times_out_and_its_late_result_is_dropped() -> None:
    """The loop is not held: the wait ends with TimeoutError while the call is still blocked."""
    release = threading.Event()

    def stuck() -> int:
        release.wait(30)
        return 1

    try:
        with pytest.raises(TimeoutError, match=r"^reading the configuration took longer than 0\.2 s$"):
            await call_bounded(stuck, 0.2, "reading the configuration")
    finally:
        release.set()
