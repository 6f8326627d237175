"""What a notice source is: a long-running task that reports observations and its own health.

A source turns one external signal (a cloud's metadata service, NVML, the host) into
:class:`~agent.core.notice.Observation` values and hands them to a :class:`Sink` that the agent gives it. Sources
parse with pure functions and keep their I/O loops thin. Sink methods must be called from the event loop
thread; a source that works on a thread hands results back with ``loop.call_soon_threadsafe``.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

from agent.core.notice import Observation
from agent.core.reports import Report


class Sink(Protocol):
    """How a source talks to the agent. All methods are cheap and never block."""

    def replace(self, observations: Iterable[Observation]) -> None:
        """Everything the source sees now (after a successful read): the rest of its notices clear."""

    def observe(self, obs: Observation) -> None:
        """Raise or update one observation without touching the source's other notices."""

    def clear(self, key: str, reason: str | None = None) -> None:
        """The condition under ``key`` is over."""

    def ok(self, **detail: Any) -> None:
        """A read succeeded; ``detail`` replaces the health detail shown in status."""

    def error(self, message: str, **fields: Any) -> None:
        """A read failed: the source is degraded, one ``source_error`` log event is written. Active notices
        of the source are kept: an error never clears a notice."""

    def identify(self, cloud: str, instance: Mapping[str, Any]) -> None:
        """The source found which cloud and instance this host is (shown as ``agent.cloud`` and
        ``agent.instance`` in status)."""

    def disable(self, why: str) -> None:
        """The source cannot work on this host (no driver, not this cloud); it should then return."""


class Source(abc.ABC):
    """A notice source. Subclasses set ``name`` (unique per agent) and implement :meth:`run`."""

    name: str = "source"

    @abc.abstractmethod
    async def run(self, sink: Sink) -> None:
        """Watch until cancelled. Returning early (after ``sink.disable``) ends the source for this run;
        raising is logged and the source is restarted with backoff."""

    def on_report(self, report: Report) -> None:
        """Called on the loop for every accepted client report (the host monitor uses checkpoint sizes)."""

    def status(self) -> Mapping[str, Any]:
        """Extra fields for ``/v1/status`` under this source (e.g. the GPUs a monitor sees)."""
        return {}

    def capabilities(self) -> Mapping[str, Callable[..., Any]]:
        """Named capabilities this source offers to reactors now (``agent.core.ports.GPU_PIDS``,
        ``agent.core.ports.AZURE_ACK``); asked each time one is needed."""
        return {}
