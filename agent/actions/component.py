"""The actions component: builds the reactors (the built-in actions and any scheduler bridge, through
:mod:`agent.actions.registry`), hands them the agent's events and client reports, and shows what they did under
``actions`` in ``/v1/status`` (each reactor's own status under ``actions.reactors.<name>``) and as
``preemptd_actions_total`` in metrics.

Reactors only record and spawn owned tasks, so nothing an action does (a hanging hook, an unreachable
webhook) can delay an event on its way to clients.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from agent.actions.builtins import legacy_status
from agent.actions.common import Outcomes, log
from agent.actions.registry import ReactorSet, build_reactors, discover, unused_tables
from agent.config import ActionsConfig, Config
from agent.core.errors import ConfigError
from agent.core.ports import Host

# Metric label of the built-in reactors that count outcomes.
ACTION_LABELS = {"signals": "signal", "hooks": "hook", "webhooks": "webhook"}


class ActionsComponent:
    name = "actions"

    def __init__(self, config: Config) -> None:
        self.config: ActionsConfig = config.actions
        self.reactors = ReactorSet()
        self._host: Host | None = None

    # --- component contract ---------------------------------------------------------------------------

    def setup(self, host: Host) -> None:
        self._host = host
        found = discover()
        self.reactors = ReactorSet(build_reactors(host, found))
        for table in unused_tables(host.config.extension_tables(), found):
            log.warning(
                "config_table_unused",
                table=table,
                available=sorted(item.name for item in found),
                effect="ignored; install the bridge that reads it, or remove the table",
            )
        host.fanout.on_event(self.reactors.handle)
        host.hooks.on_report(self.reactors.on_report)
        host.hooks.on_subscriber(self.reactors.on_subscriber)
        host.hooks.add_report_check(self.reactors.refusal)
        host.hooks.add_status_section("actions", self.status)
        host.hooks.add_metrics_collector(_Collector(self))
        log.info("reactors_built", reactors=[r.name for r in self.reactors])

    async def start(self) -> None:
        await self.reactors.start()

    async def reload(self, config: Config) -> None:
        """Apply a re-read configuration (SIGHUP): every reactor is rebuilt from it and takes over from its
        predecessor; actions already running finish under the old one. An invalid table is logged and the
        running reactors are kept."""
        if self._host is None:
            return
        try:
            reactors = build_reactors(self._host)
        except ConfigError as exc:
            log.error("actions_reload_failed", error=str(exc), effect="keeping the running actions")
            return
        await self.reactors.replace(reactors)
        cfg = config.actions
        self.config = cfg
        log.info(
            "actions_reloaded",
            signals=len(cfg.signals),
            hooks=len(cfg.hooks),
            webhooks=len(cfg.webhooks),
            reactors=[r.name for r in self.reactors],
        )

    async def stop(self) -> None:
        await self.reactors.stop(self.config.stop_timeout_s)

    def status(self) -> dict[str, Any]:
        return {
            **legacy_status(self.reactors.by_name(), self.config.dry_run),
            "running": self.reactors.running(),
            "reactors": self.reactors.status(),
        }

    async def drain(self) -> None:
        """Wait until every action started so far has finished (tests)."""
        await self.reactors.drain()


class _Collector:
    """Prometheus collector over the reactors' outcome counts and the last ready."""

    def __init__(self, component: ActionsComponent) -> None:
        self._component = component

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        counts = CounterMetricFamily(
            "preemptd_actions",
            "Actions taken on notices, by action and outcome",
            labels=["action", "outcome"],
        )
        reactors = self._component.reactors.by_name()
        rows: list[tuple[str, str, int]] = []
        for name, label in ACTION_LABELS.items():
            outcomes = getattr(reactors.get(name), "outcomes", None)
            if isinstance(outcomes, Outcomes):
                rows.extend((label, outcome, value) for outcome, value in outcomes.counts.items())
        for label, outcome, value in sorted(rows):
            counts.add_metric([label, outcome], value)
        yield counts
        last = getattr(reactors.get("ready"), "last_ready", {})
        for key, help_text in (
            ("notice_to_ready_s", "Seconds from the last ready notice's detection to ready"),
            ("margin_s", "Seconds that were left before the deadline when the last notice became ready"),
        ):
            seconds = last.get(key)
            if isinstance(seconds, (int, float)):
                gauge = GaugeMetricFamily(f"preemptd_last_ready_{key.removesuffix('_s')}_seconds", help_text)
                gauge.add_metric([], float(seconds))
                yield gauge
