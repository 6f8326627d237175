"""The ledger as an agent component: every notice (from the events) and every client report goes into the
SQLite ledger on a writer thread of its own; ``GET /v1/ledger`` hands the facts and the ``[cost]`` prices to
``preemptd report``; the ``ledger`` and ``goodput`` status sections; the ``preemptd_ledger_*`` counters and
the goodput gauge (since this start), all from one report document recomputed soon after the facts change.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, Protocol

from aiohttp import web
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from agent.core.errors import ConfigError
from agent.core.notice import Event, format_time
from agent.core.ports import Clocked, Configured, ConfigView, HasFanout, HasHooks, Logged, Tasked
from agent.core.reports import Report
from agent.core.threads import deliver, settle
from agent.ledger import store
from agent.ledger.config import CostConfig, LedgerConfig
from agent.ledger.facts import Facts, notice_fact, report_fact
from agent.ledger.report import Prices, build_report, prices_of, prices_to_json
from agent.ledger.tally import DEADLINE_SLACK_S, Rules

# How often old facts are pruned. The counters are recomputed COALESCE_S after new facts (a burst of reports
# is one recomputation), just after each notice's deadline (a deadline passing turns a notice into an
# interruption without a new fact) and at the latest every MAX_REFRESH_S; never more often than
# BUSY_FACTOR times the last recomputation took (a big ledger under a stream of reports takes a tenth of a
# core at most).
PRUNE_S = 3600.0
COALESCE_S = 1.0
MAX_REFRESH_S = 600.0
BUSY_FACTOR = 10.0
# How long a request waits for the facts queued before it to be written.
SYNC_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 5.0
# What the goodput status section shows beside the ratio (figures of the report's total).
GOODPUT_PARTS = (
    "gpu_hours",
    "useful_gpu_hours",
    "checkpoint_gpu_hours",
    "flush_gpu_hours",
    "redone_gpu_hours",
    "restart_gpu_hours",
)


class LedgerHost(Configured, Logged, Tasked, Clocked, HasHooks, HasFanout, Protocol):
    """What the ledger uses of the agent (``agent.service.daemon.Agent`` has it all)."""


def ledger_path(config: LedgerConfig, state_dir: Path) -> Path:
    return config.path if config.path is not None else state_dir / "ledger.sqlite"


class LedgerComponent:
    name = "ledger"

    def __init__(self) -> None:
        self._host: LedgerHost | None = None
        self._writer: store.Writer | None = None
        self._path: Path | None = None
        self._prices = Prices()
        self._rules = Rules()
        self._started_at: datetime | None = None
        self._state = "starting"
        self._moved_to: Path | None = None
        self._last_error: str | None = None
        self._counters: dict[str, Any] | None = None
        self._task: asyncio.Task[Any] | None = None
        self._changed = asyncio.Event()
        self._deadlines: set[float] = set()  # of notices seen, until they pass

    def setup(self, host: LedgerHost) -> None:
        self._host = host
        config = host.config.table("ledger", LedgerConfig)
        # Prices are read once here: a bad [cost] table or prices file stops the start-up, naming the key.
        self._prices = prices_of(host.config.table("cost", CostConfig).merged())
        self._rules = Rules(interrupting_kinds=config.interrupting_kinds, active_s=config.active_s)
        self._path = ledger_path(config, host.config.state_dir)
        self._writer = store.Writer(
            self._path,
            config.retention_days * 86400.0,
            host.now,
            self._opened,
            self._failed,
        )
        self._started_at = host.now()
        host.fanout.on_event(self._on_event)
        host.hooks.on_report(self._on_report)
        host.hooks.add_route("GET", "/v1/ledger", self.handle_ledger)
        host.hooks.add_status_section("ledger", self.status)
        host.hooks.add_status_section("goodput", self.status_goodput)
        host.hooks.add_metrics_collector(LedgerCollector(self))

    async def start(self) -> None:
        host = self._require()
        assert self._writer is not None
        await asyncio.to_thread(self._writer.open)
        self._writer.start()
        self._task = host.tasks.spawn(self._loop(), "ledger")

    async def stop(self) -> None:
        host = self._require()
        if self._task is not None:
            await host.tasks.cancel(self._task, timeout=1.0)
            self._task = None
        if self._writer is not None and not await asyncio.to_thread(self._writer.close, STOP_TIMEOUT_S):
            host.log.warning("ledger_stop_slow", path=str(self._path), waited_s=STOP_TIMEOUT_S)

    async def reload(self, config: ConfigView) -> None:
        """SIGHUP: new prices and counting rules (the file stays where it is until a restart); a prices file
        that cannot be read keeps the old ones."""
        host = self._require()
        try:
            ledger = config.table("ledger", LedgerConfig)
            cost = await asyncio.to_thread(lambda: config.table("cost", CostConfig).merged())
        except ConfigError as exc:
            host.log.error("ledger_reload_failed", error=str(exc), effect="keeping the prices and rules")
            return
        self._prices = prices_of(cost)
        self._rules = Rules(interrupting_kinds=ledger.interrupting_kinds, active_s=ledger.active_s)

    def _require(self) -> LedgerHost:
        if self._host is None:
            raise RuntimeError("the ledger component was not set up")
        return self._host

    # ----- inputs (on the loop: queue and return) -----

    def _on_event(self, event: Event) -> None:
        fact = notice_fact(event)
        if fact is not None and self._writer is not None:
            self._writer.put(fact)
            if fact.deadline is not None:
                self._deadlines.add(fact.deadline)
            self._changed.set()

    def _on_report(self, report: Report) -> None:
        if self._writer is not None:
            self._writer.put(report_fact(report))
            self._changed.set()

    # ----- the writer thread's news -----

    def _opened(self, moved_to: Path | None, error: str | None) -> None:
        log = self._require().log
        if moved_to is not None:
            self._state, self._moved_to = "ok", moved_to
            log.error(
                "ledger_corrupt",
                path=str(self._path),
                moved_to=str(moved_to),
                error=error,
                effect="the damaged ledger was moved aside and a fresh one started; its facts are not reported",
            )
        else:
            self._state = "ok"
            log.info("ledger_open", path=str(self._path))

    def _failed(self, error: str) -> None:
        self._last_error = error
        if self._state == "starting":
            self._state = "unavailable"
        self._require().log.error("ledger_write_failed", path=str(self._path), error=error)

    # ----- reading -----

    async def sync(self) -> None:
        """Wait until the facts queued so far are written (so a report sees what was just posted)."""
        if self._writer is None:
            return
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        self._writer.barrier(lambda: deliver(loop, settle, done, None, None))
        await asyncio.wait_for(done, SYNC_TIMEOUT_S)

    async def facts(self, since: datetime | None = None, job: str | None = None) -> Facts:
        assert self._path is not None
        await self.sync()
        start = since.timestamp() if since is not None else None
        return await asyncio.to_thread(store.read, self._path, start, job)

    async def handle_ledger(self, request: web.Request) -> web.Response:
        host = self._require()
        since: datetime | None = None
        raw = request.query.get("since_s")
        if raw is not None:
            try:
                seconds = float(raw)
                if not 0 <= seconds <= 1e10:
                    raise ValueError
            except ValueError:
                return web.json_response(
                    {"error": f"query 'since_s' must be a number of seconds >= 0, got {raw[:40]!r}"},
                    status=400,
                )
            since = host.now() - timedelta(seconds=seconds)
        job = request.query.get("job") or None
        try:
            facts = await self.facts(since, job)
        except (FileNotFoundError, store.LedgerCorrupt, TimeoutError) as exc:
            return web.json_response({"error": f"the ledger cannot be read: {exc}"}, status=503)
        return web.json_response(
            {
                "now": format_time(host.now()),
                "since": format_time(since) if since is not None else None,
                "job": job,
                "path": str(self._path),
                "prices": prices_to_json(self._prices),
                "rules": {
                    "interrupting_kinds": list(self._rules.interrupting_kinds),
                    "active_s": self._rules.active_s,
                },
                **facts.to_json(),
            }
        )

    def status(self) -> dict[str, Any]:
        writer = self._writer
        return {
            "state": self._state,
            "path": str(self._path),
            "written": writer.written if writer is not None else 0,
            "moved_aside_to": str(self._moved_to) if self._moved_to is not None else None,
            "last_error": self._last_error,
        }

    # ----- background -----

    async def _loop(self) -> None:
        host = self._require()
        pruned_at = host.now()
        loop = asyncio.get_running_loop()
        while True:
            self._changed.clear()
            began = loop.time()
            try:
                await self.refresh()
            except Exception as exc:  # the counters wait for the next round; the ledger keeps writing
                host.log.warning("ledger_refresh_failed", error=repr(exc))
            took = loop.time() - began
            if (host.now() - pruned_at).total_seconds() >= PRUNE_S and self._writer is not None:
                self._writer.prune_now()
                pruned_at = host.now()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._changed.wait(), self._wait_s())
            await asyncio.sleep(min(MAX_REFRESH_S, max(COALESCE_S, BUSY_FACTOR * took)))

    def _wait_s(self) -> float:
        """Until just after the next deadline of a notice seen, at most MAX_REFRESH_S."""
        now = self._require().now().timestamp()
        self._deadlines = {d for d in self._deadlines if d + DEADLINE_SLACK_S >= now}
        soonest = min(self._deadlines, default=now + MAX_REFRESH_S) + DEADLINE_SLACK_S - now
        return min(MAX_REFRESH_S, max(0.0, soonest))

    async def refresh(self) -> dict[str, Any]:
        """Recompute the counters: the report's totals over the facts since this agent started."""
        host = self._require()
        facts = await self.facts(self._started_at)
        now = host.now()
        doc = await asyncio.to_thread(build_report, facts, now, self._started_at, None, None, self._rules)
        self._counters = doc
        return doc

    def counters(self) -> Mapping[str, Any] | None:
        return self._counters

    def status_goodput(self) -> dict[str, Any] | None:
        """The goodput since this agent started (docs/ledger.md): the ``preemptd_ledger_goodput_ratio`` value,
        with the GPU-hours it is the share of; None until first computed."""
        doc = self._counters
        if doc is None:
            return None
        total = doc["total"]
        return {
            "ratio": total["goodput"],
            "since": doc["since"],
            "computed_at": doc["generated_at"],
            **{key: total[key] for key in GOODPUT_PARTS},
        }


class LedgerCollector:
    """The ledger's totals since this agent started, as counters (a restart is a counter reset)."""

    def __init__(self, component: LedgerComponent) -> None:
        self.component = component

    def collect(self) -> list[Metric]:
        doc = self.component.counters()
        total: Mapping[str, Any] = doc["total"] if doc is not None else {}
        notices: Mapping[str, Any] = doc["notices"] if doc is not None else {}
        interruptions = CounterMetricFamily(
            "preemptd_ledger_interruptions",
            "Interruptions of training jobs on this host (drills not counted)",
            labels=["announced"],
        )
        flushes = CounterMetricFamily(
            "preemptd_ledger_flushes", "Emergency checkpoints at notices, by outcome", labels=["outcome"]
        )
        gpu_seconds = CounterMetricFamily(
            "preemptd_ledger_gpu_seconds",
            "GPU time of training jobs on this host, and where the preemption overhead went",
            labels=["category"],
        )
        saved_bytes = CounterMetricFamily(
            "preemptd_ledger_checkpoint_bytes", "Bytes of checkpoints written (periodic and emergency)"
        )
        steps = CounterMetricFamily(
            "preemptd_ledger_steps_redone", "Training steps done again after interruptions"
        )
        seen = CounterMetricFamily(
            "preemptd_ledger_notices", "Notices recorded in the ledger", labels=["kind"]
        )
        goodput = GaugeMetricFamily(
            "preemptd_ledger_goodput_ratio",
            "Goodput: useful share of the training GPU time since this agent started (as preemptd report)",
        )
        counts = total.get("interruptions") or {}
        interruptions.add_metric(["true"], float(counts.get("announced", 0)))
        interruptions.add_metric(["false"], float(counts.get("unannounced", 0)))
        outcomes = total.get("flushes") or {}
        for outcome in ("in_time", "late", "lost"):
            flushes.add_metric([outcome], float(outcomes.get(outcome, 0)))
        for category, key in (
            ("total", "gpu_hours"),
            ("checkpoint", "checkpoint_gpu_hours"),
            ("flush", "flush_gpu_hours"),
            ("redone", "redone_gpu_hours"),
            ("restart", "restart_gpu_hours"),
        ):
            gpu_seconds.add_metric([category], 3600.0 * float(total.get(key) or 0.0))
        saved_bytes.add_metric([], float(total.get("checkpoint_bytes") or 0))
        steps.add_metric([], float(total.get("steps_redone") or 0))
        for kind, count in sorted((notices.get("by_kind") or {}).items()):
            seen.add_metric([kind], float(count))
        ratio = total.get("goodput")
        goodput.add_metric([], float(ratio) if ratio is not None else float("nan"))
        return [interruptions, flushes, gpu_seconds, saved_bytes, steps, seen, goodput]
