"""The advisor as an agent component: ``GET /v1/advice``, the ``advice`` status section and its metrics, fed
by the history log at start-up and by live events and reports afterwards. (The ``goodput`` section and gauge
are the ledger's: agent/ledger/component.py.)

The estimate is recomputed in a worker thread (the history can hold tens of thousands of records), when the
records changed and someone asks, and at least every ``REFRESH_S`` so that uptime keeps counting.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections import deque
from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

from aiohttp import web
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from agent.advisor.advice import CONFIDENCE_LEVELS, advise
from agent.advisor.estimate import Observations, check_config, observe
from agent.config import AdvisorConfig, Config
from agent.core.errors import ConfigError
from agent.core.notice import Event, EventType, format_time
from agent.core.ports import AdvisorHost
from agent.core.reports import Report

REFRESH_S = 120.0
# An answer older than this is recomputed even without new records: notices reach their deadlines.
MAX_AGE_S = 30.0
MAX_RECORDS = 200_000
_NOTICE_KEYS = ("id", "kind", "drill", "detected_at", "deadline", "cleared_at")
_REPORT_KEYS = ("kind", "phase", "received_at", "step", "duration_s", "emergency", "notice_id", "peer_pid")
_CLIENT_KEYS = ("job", "name", "host")
_FLUSH_KEYS = ("tier", "complete_s")  # a peer snapshot and its completion time (two-level advice)


def compact(record: Mapping[str, Any]) -> dict[str, Any] | None:
    """The part of a history record the advisor reads (memory: the history may be large)."""
    kind = record.get("type")
    out: dict[str, Any] = {"time": record.get("time"), "type": kind}
    if kind == "agent_start":
        out["previous_clean"] = record.get("previous_clean")
    elif kind in ("notice", "update", "cleared"):
        doc = record.get("notice")
        if not isinstance(doc, Mapping):
            return None
        out["notice"] = {k: doc.get(k) for k in _NOTICE_KEYS}
    elif kind == "report":
        doc = record.get("report")
        if not isinstance(doc, Mapping):
            return None
        report = {k: doc.get(k) for k in _REPORT_KEYS}
        client = doc.get("client")
        if isinstance(client, Mapping):
            report["client"] = {k: client[k] for k in _CLIENT_KEYS if k in client}
        flush = doc.get("flush")
        if isinstance(flush, Mapping) and any(k in flush for k in _FLUSH_KEYS):
            report["flush"] = {k: flush[k] for k in _FLUSH_KEYS if k in flush}
        out["report"] = report
    return out


def _read_prefix(path: Path, size: int) -> list[dict[str, Any]]:
    """Records in the first ``size`` bytes of a history file (what was there when the component was set up)."""
    records: list[dict[str, Any]] = []
    try:
        with path.open("rb") as handle:
            data = handle.read(size)
    except OSError:
        return records
    for raw in data.splitlines():
        try:
            record = json.loads(raw)
        except ValueError:
            continue  # a torn line from a crash
        if isinstance(record, dict) and (small := compact(record)) is not None:
            records.append(small)
    return records


class AdvisorComponent:
    name = "advisor"

    def __init__(self, config: AdvisorConfig | None = None) -> None:
        self._config = config
        self._agent: AdvisorHost | None = None
        self._records: deque[dict[str, Any]] = deque(maxlen=MAX_RECORDS)
        self._version = 0
        self._computed_version = -1
        self._computed_at: datetime | None = None
        self._observations: Observations | None = None
        self._advice: dict[str, Any] | None = None
        self._lock = asyncio.Lock()
        self._changed = asyncio.Event()
        self._snapshot: list[tuple[Path, int]] = []
        self._task: asyncio.Task[Any] | None = None
        self._record_task: asyncio.Task[Any] | None = None
        self._flush_risk: dict[str, Any] | None = None
        self._emergency_save: dict[str, Any] | None = None

    @property
    def config(self) -> AdvisorConfig:
        if self._config is not None:
            return self._config
        return (
            self._agent.config.table("advisor", AdvisorConfig) if self._agent is not None else AdvisorConfig()
        )

    # ----- component contract -----

    def setup(self, agent: AdvisorHost) -> None:
        self._agent = agent
        if self._config is None:
            self._config = agent.config.table("advisor", AdvisorConfig)
        check_config(self._config)
        agent.hooks.add_route("GET", "/v1/advice", self.handle_advice)
        agent.hooks.add_status_section("advice", self.status_advice)
        agent.hooks.add_status_section("flush_risk", self.status_flush_risk)
        agent.hooks.add_status_section("emergency_save", lambda: self._emergency_save)
        agent.hooks.add_metrics_collector(AdvisorCollector(self))
        agent.fanout.on_event(self._on_event)
        agent.hooks.on_report(self._on_report)
        # What the history holds now is read at start() in a thread; what comes later arrives through the
        # listeners. Remember the sizes so nothing is read twice.
        history = agent.history.path
        rotated = history.with_name(history.name + ".1")
        for path in (rotated, history):
            with contextlib.suppress(OSError):
                self._snapshot.append((path, os.stat(path).st_size))

    async def start(self) -> None:
        agent = self._require_agent()
        loaded: list[dict[str, Any]] = []
        for path, size in self._snapshot:
            loaded.extend(await asyncio.to_thread(_read_prefix, path, size))
        live = list(self._records)
        self._records.clear()
        self._records.extend(loaded)
        self._records.extend(live)
        self._version += 1
        agent.log.info("advisor_loaded", records=len(loaded))
        self._task = agent.tasks.spawn(self._refresh_loop(), "advisor-refresh")
        if self.config.record_interval_s > 0:
            self._record_task = agent.tasks.spawn(self._record_loop(), "advisor-record")

    async def stop(self) -> None:
        agent = self._require_agent()
        for task in (self._record_task, self._task):
            if task is not None:
                await agent.tasks.cancel(task, timeout=1.0)
        self._task = self._record_task = None

    async def reload(self, config: Config) -> None:
        try:
            check_config(config.advisor)
        except ConfigError as exc:
            self._require_agent().log.error(
                "advisor_reload_failed", error=str(exc), effect="keeping the advisor settings"
            )
            return
        self._config = config.advisor
        self._version += 1
        self._changed.set()

    def _require_agent(self) -> AdvisorHost:
        if self._agent is None:
            raise RuntimeError("the advisor component was not set up")
        return self._agent

    # ----- inputs -----

    def _add(self, record: dict[str, Any]) -> None:
        small = compact(record)
        if small is not None:
            self._records.append(small)
            self._version += 1
            self._changed.set()

    def _on_event(self, event: Event) -> None:
        if event.type in (EventType.NOTICE, EventType.UPDATE, EventType.CLEARED) and event.notice is not None:
            self._add(
                {
                    "time": format_time(event.time),
                    "type": event.type.value,
                    "notice": event.notice.to_json(event.time),
                }
            )

    def _on_report(self, report: Report) -> None:
        self._add({"time": format_time(report.received_at), "type": "report", "report": report.to_json()})
        self._track_flush_risk(report)
        self._track_emergency_save(report)

    def _track_emergency_save(self, report: Report) -> None:
        """The newest emergency save a client reported ended, for status: the tier it went to (and why not
        the peer tier), the predicted and the actual duration, and the slack before the deadline."""
        if report.kind != "checkpoint" or not report.emergency or report.phase == "started":
            return
        keys = ("tier", "fallback", "fallback_step", "predicted_s", "time_left_s", "slack_s")
        self._emergency_save = {
            "time": format_time(report.received_at),
            "step": report.step,
            "phase": report.phase,
            "notice_id": report.notice_id,
            "duration_s": report.duration_s,
            **{key: report.flush.get(key) for key in keys},
            "client": {
                k: report.client.get(k) for k in ("job", "host", "rank") if report.client.get(k) is not None
            },
        }

    def _track_flush_risk(self, report: Report) -> None:
        """The newest save a client predicted to miss its deadline (the client's ``flush`` budget), shown in
        status while it is the newest; its outcome is added when the same client reports it finished."""
        who = {
            k: report.client.get(k)
            for k in ("job", "host", "rank", "pid")
            if report.client.get(k) is not None
        }
        if report.phase == "started" and report.flush.get("predicted_miss"):
            self._flush_risk = {
                "time": format_time(report.received_at),
                "step": report.step,
                "notice_id": report.notice_id,
                "predicted_s": report.flush.get("predicted_s"),
                "time_left_s": report.flush.get("time_left_s"),
                "world_size": report.flush.get("world_size"),
                "client": who,
                "outcome": None,
            }
        elif (
            self._flush_risk is not None
            and report.phase in ("finished", "failed")
            and report.step == self._flush_risk["step"]
            and who == self._flush_risk["client"]
        ):
            self._flush_risk["outcome"] = {"phase": report.phase, "duration_s": report.duration_s}

    # ----- computing -----

    async def refresh(self, force: bool = False) -> dict[str, Any]:
        """The current advice, recomputed in a thread when the records changed (or when ``force``)."""
        agent = self._require_agent()
        async with self._lock:
            now = agent.now()
            stale = self._computed_at is None or (now - self._computed_at).total_seconds() > MAX_AGE_S
            if force or stale or self._advice is None or self._computed_version != self._version:
                version = self._version
                records = list(self._records)
                config = self.config
                obs, doc = await asyncio.to_thread(self._compute, records, now, config)
                self._observations, self._advice = obs, doc
                self._computed_version, self._computed_at = version, now
            assert self._advice is not None
            return self._advice

    @staticmethod
    def _compute(
        records: list[dict[str, Any]], now: datetime, config: AdvisorConfig
    ) -> tuple[Observations, dict[str, Any]]:
        obs = observe(records, now, config)
        return obs, advise(obs, config, now)

    async def _refresh_loop(self) -> None:
        while True:
            self._changed.clear()
            try:
                await self.refresh(force=True)
            except Exception as exc:  # a bug in the estimate must not stop the refreshes
                self._require_agent().log.error("advisor_failed", error=repr(exc), exc_info=True)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._changed.wait(), timeout=REFRESH_S)
            await asyncio.sleep(1.0)  # coalesce a burst of reports into one recomputation

    async def _record_loop(self) -> None:
        agent = self._require_agent()
        while True:
            await asyncio.sleep(self.config.record_interval_s)
            record: dict[str, Any] = {"type": "advice"}
            try:
                doc = await self.refresh()
                record.update(
                    interval_s=doc.get("interval_s"),
                    confidence=doc.get("confidence"),
                    save_time_s=doc["save_time"]["value_s"],
                    mtbp_s=doc["mtbp"]["unannounced"]["value_s"],
                )
            except Exception as exc:  # the mark of uptime matters even when the estimate fails
                agent.log.error("advisor_failed", error=repr(exc), exc_info=True)
            agent.keeper.record(record)  # it also marks this run as alive in the history
            self._add({"time": format_time(agent.now()), **record})

    # ----- outputs -----

    async def handle_advice(self, request: web.Request) -> web.Response:
        return web.json_response(await self.refresh())

    def status_advice(self) -> dict[str, Any] | None:
        doc = self._advice
        if doc is None:
            return None
        section = {
            "interval_s": doc.get("interval_s"),
            "confidence": doc.get("confidence"),
            "save_time_s": doc["save_time"]["value_s"],
            "mtbp_unannounced_s": doc["mtbp"]["unannounced"]["value_s"],
            "mtbp_announced_s": doc["mtbp"]["announced"]["value_s"],
            "expected_waste": doc.get("expected_waste"),
            "reason": doc.get("reason"),
            "computed_at": doc.get("computed_at"),
        }
        if "two_level" in doc:
            section["two_level"] = _two_level_summary(doc["two_level"])
        return section

    def status_flush_risk(self) -> dict[str, Any] | None:
        return self._flush_risk


def _two_level_summary(doc: dict[str, Any]) -> dict[str, Any]:
    """The two intervals and what the peer level saves, for status (the whole: ``GET /v1/advice``)."""
    peer, durable = doc.get("peer") or {}, doc.get("durable") or {}
    waste = doc.get("expected_waste") or {}
    return {
        "levels": doc.get("levels"),
        "peer_interval_s": peer.get("interval_s"),
        "peer_steps": peer.get("steps"),
        "durable_interval_s": durable.get("interval_s"),
        "every_snapshots": durable.get("every_snapshots"),
        "waste": waste.get("two_level"),
        "durable_only_waste": waste.get("durable_only"),
        "saves": doc.get("saves"),
        "ram_loss_share": doc["assumption"]["ram_loss_share"],
        "reason": doc.get("reason"),
    }


class AdvisorCollector:
    """Prometheus metrics of the advice, from the last computation."""

    def __init__(self, component: AdvisorComponent) -> None:
        self.component = component

    def collect(self) -> list[Metric]:
        doc = self.component._advice
        interval = GaugeMetricFamily(
            "preemptd_advice_interval_seconds",
            "Advised compute time between checkpoints (NaN: no advice yet)",
        )
        save = GaugeMetricFamily(
            "preemptd_advice_save_time_seconds", "Checkpoint save time δ", labels=["kind"]
        )
        mtbp = GaugeMetricFamily(
            "preemptd_advice_mtbp_seconds", "Mean time between interruptions M", labels=["kind"]
        )
        confidence = GaugeMetricFamily(
            "preemptd_advice_confidence", "Advice confidence: 0 none, 1 low, 2 medium, 3 high"
        )
        waste = GaugeMetricFamily(
            "preemptd_advice_expected_waste_ratio", "Expected share of wall time wasted", labels=["interval"]
        )
        losses = GaugeMetricFamily(
            "preemptd_advice_interruptions", "Interruptions seen in the history", labels=["cause"]
        )
        nan = float("nan")
        if doc is not None:
            interval.add_metric([], _num(doc.get("interval_s"), nan))
            save.add_metric(["periodic"], _num(doc["save_time"]["value_s"], nan))
            save.add_metric(["emergency"], _num(doc["emergency_save_time"]["value_s"], nan))
            mtbp.add_metric(["unannounced"], _num(doc["mtbp"]["unannounced"]["value_s"], nan))
            mtbp.add_metric(["announced"], _num(doc["mtbp"]["announced"]["value_s"], nan))
            confidence.add_metric([], float(CONFIDENCE_LEVELS.index(doc.get("confidence", "none"))))
            expected = doc.get("expected_waste") or {}
            for name in ("advised", "current"):
                if expected.get(name) is not None:
                    waste.add_metric([name], float(expected[name]))
            for cause, count in doc["losses"].items():
                if cause != "total":
                    losses.add_metric([cause], float(count))
            losses.add_metric(["announced"], float(doc["announced_interruptions"]))
        return [interval, save, mtbp, confidence, waste, losses]


def _num(value: Any, default: float) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else default
