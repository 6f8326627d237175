"""The actions component: hears the agent's events and client reports and drives the signal, hook,
webhook, ready and Azure-acknowledgement engines; shows what they did under ``actions`` in ``/v1/status``
and as ``preemptd_actions_total`` in metrics.

Every listener here only records and spawns owned tasks, so nothing an action does (a hanging hook, an
unreachable webhook) can delay an event on its way to clients.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from agent.actions.common import Recent, TaskSet, log
from agent.actions.hooks import HookEngine
from agent.actions.ready import AzureAcknowledger, ReadyEngine
from agent.actions.signals import CGROUP_ROOTS, SignalEngine, SignalRule, TargetError, call_gpu_pids
from agent.actions.webhooks import WebhookEngine
from agent.config import ActionsConfig, Config
from agent.errors import ConfigError
from agent.notice import Event, EventType, Notice
from agent.reports import Report


class AgentHooks(Protocol):
    """What this component uses of :class:`agent.daemon.Agent` (docs/internals.md)."""

    @property
    def sources(self) -> Mapping[str, Any]: ...

    def add_status_section(self, name: str, fn: Callable[[], Any]) -> None: ...

    def add_metrics_collector(self, collector: Any) -> None: ...

    def on_event(self, fn: Callable[[Event], None]) -> None: ...

    def on_report(self, fn: Callable[[Report], None]) -> None: ...

    def publish_ready(self, notice_id: str, data: Mapping[str, Any] | None = None) -> Any: ...


class ActionsComponent:
    name = "actions"

    def __init__(
        self,
        config: Config,
        *,
        cgroup_roots: Iterable[Path] = CGROUP_ROOTS,
        base_env: Mapping[str, str] | None = None,
    ) -> None:
        cfg = config.actions
        self.config = cfg
        self._agent: AgentHooks | None = None
        self.tasks = TaskSet("actions")
        # Grace timers live apart from the actions, so that waiting for the actions (drain) does not wait
        # out every grace.
        self.timers = TaskSet("actions-ready")
        self.counts: Counter[tuple[str, str]] = Counter()
        self._notices: dict[str, Notice] = {}
        self._last_ready: dict[str, Any] = {}
        self._retired: list[WebhookEngine] = []
        self.signal_log = Recent(cfg.history_size)
        self.hook_log = Recent(cfg.history_size)
        self.webhook_log = Recent(cfg.history_size)
        self.ack_log = Recent(cfg.history_size)
        self._env = dict(os.environ if base_env is None else base_env)
        self._env.setdefault("PREEMPTD_SOCKET", str(config.socket))
        self._cgroup_roots = tuple(cgroup_roots)
        self.signals, self.hooks, self.webhooks = self._engines(cfg)
        self.ready = ReadyEngine(
            cfg.ready, publish=self._publish_ready, tasks=self.timers, history=cfg.history_size
        )
        self.azure = AzureAcknowledger(
            cfg.ready.azure_acknowledge, source=self._azure_source, tasks=self.tasks, recent=self.ack_log
        )

    def _engines(self, cfg: ActionsConfig) -> tuple[SignalEngine, HookEngine, WebhookEngine]:
        """The engines for ``cfg``; ConfigError (naming the key) if a rule is invalid."""
        signals = SignalEngine(
            (SignalRule.from_config(rule, i) for i, rule in enumerate(cfg.signals)),
            dry_run=cfg.dry_run,
            tasks=self.tasks,
            recent=self.signal_log,
            gpu_pids=self._gpu_pids,
            cgroup_roots=self._cgroup_roots,
            count=self._counter("signal"),
        )
        hooks = HookEngine(
            cfg.hooks,
            concurrency=cfg.hook_concurrency,
            output_max_bytes=cfg.hook_output_max_bytes,
            tasks=self.tasks,
            recent=self.hook_log,
            base_env=self._env,
            count=self._counter("hook"),
        )
        webhooks = WebhookEngine(
            cfg.webhooks, tasks=self.tasks, recent=self.webhook_log, count=self._counter("webhook")
        )
        return signals, hooks, webhooks

    # --- component contract ---------------------------------------------------------------------------

    def setup(self, agent: AgentHooks) -> None:
        self._agent = agent
        agent.on_event(self.on_event)
        agent.on_report(self.on_report)
        agent.add_status_section("actions", self.status)
        agent.add_metrics_collector(_Collector(self))

    async def start(self) -> None:
        await self.webhooks.start()

    async def reload(self, config: Config) -> None:
        """Apply a re-read configuration (SIGHUP). Actions already running finish under the old one; an
        invalid actions section is logged and the running actions are kept."""
        cfg = config.actions
        try:
            signals, hooks, webhooks = self._engines(cfg)
        except ConfigError as exc:
            log.error("actions_reload_failed", error=str(exc), effect="keeping the running actions")
            return
        signals.carry_over(self.signals)  # a notice already signalled is not signalled again
        await webhooks.start()
        old_webhooks = self.webhooks
        self.signals, self.hooks, self.webhooks = signals, hooks, webhooks
        self.ready.config = cfg.ready
        self.azure.mode = cfg.ready.azure_acknowledge
        self.config = cfg
        self._retired.append(old_webhooks)  # deliveries in flight keep their session until stop
        log.info(
            "actions_reloaded", signals=len(cfg.signals), hooks=len(cfg.hooks), webhooks=len(cfg.webhooks)
        )

    async def stop(self) -> None:
        await self.timers.close(0)
        await self.tasks.close(self.config.stop_timeout_s)
        for webhooks in (*self._retired, self.webhooks):
            await webhooks.close()

    # --- listeners ------------------------------------------------------------------------------------

    def on_event(self, event: Event) -> None:
        if event.type is EventType.SNAPSHOT:
            return
        notice = event.notice
        if notice is None:
            notice = self._notices.get(str(event.data.get("notice_id", "")))
        elif event.type in (EventType.NOTICE, EventType.UPDATE):
            self._notices[notice.id] = notice
        doc = event.to_json()
        if "notice" not in doc and notice is not None:
            doc["notice"] = notice.to_json(event.time)
        if event.type is EventType.READY:
            self._last_ready = dict(event.data)
        self.signals.handle(event)
        self.ready.on_event(event)
        self.azure.handle(event, notice)
        self.hooks.handle(event, notice, doc)
        self.webhooks.handle(event, notice, doc)
        if event.type is EventType.CLEARED and notice is not None:
            self._notices.pop(notice.id, None)

    def on_report(self, report: Report) -> None:
        self.ready.on_report(report)

    def status(self) -> dict[str, Any]:
        return {
            "dry_run": self.config.dry_run,
            "rules": {
                "signals": len(self.signals.rules),
                "hooks": len(self.hooks.hooks),
                "webhooks": len(self.webhooks.hooks),
            },
            "running": len(self.tasks),
            "signals": self.signal_log.to_json(),
            "hooks": self.hook_log.to_json(),
            "webhooks": self.webhook_log.to_json(),
            "azure_acknowledgements": self.ack_log.to_json(),
            "ready": self.ready.status(),
        }

    async def drain(self) -> None:
        """Wait until every action started so far has finished (tests)."""
        await self.tasks.drain()

    # --- helpers --------------------------------------------------------------------------------------

    def _counter(self, action: str) -> Callable[[str], None]:
        def count(outcome: str) -> None:
            self.counts[(action, outcome)] += 1

        return count

    def _publish_ready(self, notice_id: str, data: Mapping[str, Any]) -> Any:
        if self._agent is None:
            return None
        return self._agent.publish_ready(notice_id, data)

    def _azure_source(self, name: str) -> Any:
        return self._agent.sources.get(name) if self._agent is not None else None

    async def _gpu_pids(self) -> Mapping[str, Iterable[int]]:
        source = self._agent.sources.get("nvml") if self._agent is not None else None
        if source is None:
            raise TargetError("no NVML source is running, so GPU compute processes are unknown")
        return await call_gpu_pids(source)


class _Collector:
    """Prometheus collector over the component's counters."""

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
        for (action, outcome), value in sorted(self._component.counts.items()):
            counts.add_metric([action, outcome], value)
        yield counts
        last = self._component._last_ready
        for key, help_text in (
            ("notice_to_ready_s", "Seconds from the last ready notice's detection to ready"),
            ("margin_s", "Seconds that were left before the deadline when the last notice became ready"),
        ):
            seconds = last.get(key)
            if isinstance(seconds, (int, float)):
                gauge = GaugeMetricFamily(f"preemptd_last_ready_{key.removesuffix('_s')}_seconds", help_text)
                gauge.add_metric([], float(seconds))
                yield gauge
