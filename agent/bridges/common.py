"""What the scheduler bridges share: the drain reason they leave on a node (who drained it, for which notice,
from which source, until when — administrators read it in ``sinfo -R`` or ``ray list nodes``, and the Slurm
bridge compares it to know whether a drain is still the agent's own), and their metrics collector."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from typing import Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from agent.core.notice import Notice, format_time
from agent.core.ports import Host

# Every reason the agent writes starts with this, so that an administrator sees who drained the node.
REASON_PREFIX = "preemptd:"


def drain_reason(notice: Notice) -> str:
    """``preemptd: termination from aws, deadline 2026-12-03T07:40:00Z (notice aws-…)``; drills say so."""
    deadline = format_time(notice.deadline) if notice.deadline else "none"
    drill = " drill" if notice.drill else ""
    return (
        f"{REASON_PREFIX} {notice.kind.value}{drill} from {notice.source}, deadline {deadline} "
        f"(notice {notice.id})"
    )


class Bridge(Protocol):
    """What the collector reads of a bridge: its outcome counts and why it is degraded (None: it is not)."""

    # Read-only: the collector only reads them (an attribute or a property will do).
    @property
    def counts(self) -> Counter[tuple[str, str]]: ...

    @property
    def degraded(self) -> str | None: ...


class BridgeCollector:
    """``preemptd_<name>_actions_total{action,outcome}`` and ``preemptd_<name>_degraded`` of the bridge that
    ``current()`` returns, read at scrape time (a reload replaces the bridge, not the collector)."""

    def __init__(self, name: str, label: str, current: Callable[[], Bridge]) -> None:
        self._name = name
        self._label = label
        self._current = current

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        bridge = self._current()
        counts = CounterMetricFamily(
            f"preemptd_{self._name}_actions",
            f"{self._label} calls made on notices, by action and outcome",
            labels=["action", "outcome"],
        )
        for (action, outcome), value in sorted(bridge.counts.items()):
            counts.add_metric([action, outcome], value)
        yield counts
        degraded = GaugeMetricFamily(
            f"preemptd_{self._name}_degraded", f"1 while the {self._label} bridge cannot act"
        )
        degraded.add_metric([], 1.0 if bridge.degraded else 0.0)
        yield degraded


def register_metrics(host: Host, name: str, label: str, bridge: Bridge) -> None:
    """Show ``bridge``'s metrics: the first build registers a collector, a reload's new bridge takes the old
    one's place in it (a collector registered twice would repeat its metric names)."""
    key = f"bridges.{name}.metrics"
    slot: list[Bridge] | None = host.hooks.capability(key)
    if slot is None:
        slot = [bridge]
        host.hooks.provide(key, slot)
        host.hooks.add_metrics_collector(BridgeCollector(name, label, lambda: slot[0]))
    else:
        slot[0] = bridge
