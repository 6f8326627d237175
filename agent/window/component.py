"""The effective notice window as an agent component (docs/window.md): it gathers, in the background, the
limits this host puts on a job's time after its notice (the participants' launchers, and what the bridges
offer through the ``window_limits`` capability), sets them against the cloud's notice and the predicted flush
(:mod:`agent.window.effective`), and shows the result in the ``window`` status section, the log
(``window_too_short``) and the ``preemptd_window_*`` metrics.

Nothing here runs on the notice path: status and metrics read the last result; each limit source runs
bounded, concurrently with the others, and one that fails or hangs is shown as unknown, with a log event.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

import psutil
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from agent.config import ActionsConfig, AdvisorConfig
from agent.core.errors import PreemptdError
from agent.core.notice import parse_time
from agent.core.ports import Board, Clocked, Configured, HasHistory, HasHooks, Logged, Tasked
from agent.core.reports import Report, parse_report
from agent.sources.clouds import CLOUDS
from agent.window.effective import (
    EXEC_HOLD_MAX_S,
    FlushBook,
    build_window,
    cloud_leads,
    launcher_limits,
    metric_values,
    notice_leads,
    verdicts,
)
from agent.window.limits import Limit, LimitRegistry, LimitSource, limit_registry
from agent.window.signals import signal_limits

HISTORY_TAIL_BYTES = 1 << 20  # the end of the history read at start-up for the saves of earlier runs
REFRESH_S = 30.0  # limits are read again this often, and soon after a new participant or prediction
SOURCE_TIMEOUT_S = 5.0  # a limit source that takes longer is unknown this round
MAX_PIDS = 256
_TORCHRUN_MODULES = ("torch.distributed.run", "torch.distributed.launch")


class WindowHost(Configured, Logged, Tasked, HasHistory, Clocked, HasHooks, Protocol):
    """What the window uses of the agent (``agent.service.daemon.Agent`` has it all)."""

    @property
    def board(self) -> Board:
        """The active notices: one with a deadline gives its kind its own lead."""
        ...

    @property
    def identity(self) -> Any:
        """``cloud``: the configured or detected cloud, None while unknown."""
        ...


def _is_torchrun(cmdline: Sequence[str]) -> bool:
    head = [os.path.basename(arg) for arg in cmdline[:2]]
    if "torchrun" in head:
        return True
    return any(a == "-m" and b in _TORCHRUN_MODULES for a, b in itertools.pairwise(cmdline))


def _is_exec(cmdline: Sequence[str]) -> bool:
    named = any(os.path.basename(arg) == "preemptd" for arg in cmdline[:2])
    module = any(a == "-m" and b in ("agent", "agent.cli") for a, b in itertools.pairwise(cmdline[:3]))
    return (named or module) and "exec" in cmdline[1:4]


def exec_hold_s(cmdline: Sequence[str]) -> float | None:
    """How long a ``preemptd exec`` command line holds an early SIGTERM (its ``--hold-max``), None when it
    does not (``--no-hold``, ``--hold-max 0``). Its options end at ``--`` or at the command's first word."""
    words = list(cmdline)
    rest = words[words.index("exec", 1) + 1 :] if "exec" in words[1:4] else []
    hold: float | None = EXEC_HOLD_MAX_S
    taking = ""
    for word in rest:
        if taking:
            if taking == "--hold-max":
                hold = _number(word)
            taking = ""
        elif word == "--":
            break
        elif word == "--no-hold":
            hold = None
        elif word in ("--hold-max", "--stop-grace", "--socket"):
            taking = word
        elif word.startswith("--hold-max="):
            hold = _number(word.partition("=")[2])
        elif not word.startswith("-"):
            break
    return hold if hold else None


def _number(text: str) -> float | None:
    with contextlib.suppress(ValueError):
        return float(text)
    return None


def find_launchers(
    pids: Mapping[str, tuple[int, float | None]],
) -> tuple[list[tuple[str, int, str, bool, float | None]], dict[str, tuple[int, float | None]]]:
    """For each participant (name → pid, start time or None) still running under torchrun: (name, torchrun's
    pid, its command, whether ``preemptd exec`` runs above it, how long that exec holds an early SIGTERM or
    None); and the participants still alive, with their start times (to tell a reused pid). Blocking (reads
    /proc): call it in a thread."""
    found = []
    alive: dict[str, tuple[int, float | None]] = {}
    for name, (pid, started) in pids.items():
        try:
            process = psutil.Process(pid)
            created = process.create_time()
            if started is not None and created != started:
                continue  # the pid was reused: that participant is gone
            alive[name] = (pid, created)
            parents = process.parents()
            launcher = next((p for p in parents if _is_torchrun(p.cmdline())), None)
            if launcher is None:
                continue
            wrapper = next((p.cmdline() for p in parents if _is_exec(p.cmdline())), None)
            hold = exec_hold_s(wrapper) if wrapper is not None else None
            found.append((name, launcher.pid, " ".join(launcher.cmdline()[:4]), wrapper is not None, hold))
        except psutil.Error:
            continue
    return found, alive


def read_reports(path: Path, size: int = HISTORY_TAIL_BYTES) -> list[Report]:
    """The client reports in the last ``size`` bytes of a history file, oldest first (a torn or unreadable
    record is skipped)."""
    try:
        with path.open("rb") as handle:
            handle.seek(max(0, handle.seek(0, os.SEEK_END) - size))
            data = handle.read(size)
    except OSError:
        return []
    found = []
    for raw in data.splitlines():
        try:
            record = json.loads(raw)
            doc = record["report"] if record.get("type") == "report" else None
            if not isinstance(doc, dict):
                continue
            fields = ("kind", "phase", "step", "duration_s", "emergency", "client", "flush")
            found.append(
                parse_report(
                    {k: doc[k] for k in fields if doc.get(k) is not None},
                    parse_time(doc["received_at"]),
                    doc.get("peer_pid"),
                )
            )
        except (ValueError, KeyError, TypeError, AttributeError, PreemptdError):
            continue
    return found


class WindowComponent:
    name = "window"

    def __init__(self, refresh_s: float = REFRESH_S, source_timeout_s: float = SOURCE_TIMEOUT_S) -> None:
        self.refresh_s = refresh_s
        self.source_timeout_s = source_timeout_s
        self.registry = LimitRegistry()
        self.flushes = FlushBook()
        self._host: WindowHost | None = None
        self._pids: dict[str, tuple[int, float | None]] = {}
        self._limits: list[Limit] = []
        self._checked_at: datetime | None = None
        self._said: dict[str, tuple[Any, ...]] = {}
        self._failing: dict[str, str] = {}
        self._poke = asyncio.Event()
        self._task: asyncio.Task[Any] | None = None

    def setup(self, host: WindowHost) -> None:
        self._host = host
        # The saves of earlier runs, so that the start-up warning has a prediction (before the socket serves).
        for report in read_reports(host.history.path):
            self.flushes.add(report)
        self.registry = limit_registry(host.hooks)  # the bridges built before this offered theirs already
        self.registry.changed = self._poke.set
        host.hooks.on_report(self._on_report)
        host.hooks.add_status_section("window", self.status)
        host.hooks.add_metrics_collector(WindowCollector(self))

    async def start(self) -> None:
        self._task = self._require().tasks.spawn(self._loop(), "window")

    async def stop(self) -> None:
        if self._task is not None:
            await self._require().tasks.cancel(self._task, timeout=1.0)
            self._task = None

    async def reload(self, config: Any) -> None:
        self._poke.set()  # [gcp] or the advisor's fallback may have changed

    def _require(self) -> WindowHost:
        if self._host is None:
            raise RuntimeError("the window component was not set up")
        return self._host

    # ----- inputs (on the loop: note and return) -----

    def _on_report(self, report: Report) -> None:
        changed = self.flushes.add(report)
        pid = report.peer_pid
        if pid is not None and pid > 0:
            name = "/".join(str(report.client[k]) for k in ("job", "rank") if k in report.client) or str(
                report.client.get("name", "client")
            )
            key = f"{name}@{pid}"
            if key not in self._pids:
                self._pids[key] = (pid, None)
                while len(self._pids) > MAX_PIDS:
                    del self._pids[next(iter(self._pids))]
                changed = True
        if changed:
            self._poke.set()

    # ----- gathering -----

    async def _bounded(self, name: str, source: LimitSource) -> list[Limit]:
        host = self._require()
        try:
            found = list(await asyncio.wait_for(source(), self.source_timeout_s))
        except Exception as exc:  # a source's failure is its limit's "unknown", never the window's
            why = (
                f"no answer within {self.source_timeout_s:g} s"
                if isinstance(exc, asyncio.TimeoutError)
                else f"{type(exc).__name__}: {exc}"[:300]
            )
            if self._failing.get(name) != why:
                host.log.warning("window_limit_unknown", source=name, error=why, effect="shown as unknown")
            self._failing[name] = why
            return [Limit(name, None, name, detail=why)]
        if self._failing.pop(name, None) is not None:
            host.log.info("window_limit_known", source=name)
        return found

    async def _participants(self) -> list[Limit]:
        asked = dict(self._pids)
        found, alive = await asyncio.to_thread(find_launchers, asked)
        # Forget the participants that are gone; keep those that reported while this ran.
        self._pids = {k: alive.get(k, v) for k, v in self._pids.items() if k in alive or k not in asked}
        return launcher_limits(found)

    async def _signals(self) -> list[Limit]:
        rules = self._require().config.table("actions", ActionsConfig).signals
        return await asyncio.to_thread(signal_limits, rules) if rules else []

    async def gather(self) -> dict[str, Any]:
        """Read every limit (bounded) and recompute the window; log what changed."""
        host = self._require()
        sources: dict[str, LimitSource] = {
            "participants": self._participants,
            "signals": self._signals,
            **self.registry.sources,
        }
        results = await asyncio.gather(*(self._bounded(name, source) for name, source in sources.items()))
        self._limits = [limit for found in results for limit in found]
        self._checked_at = host.now()
        doc = self.status()
        self._log_changes(doc)
        return doc

    def _log_changes(self, doc: Mapping[str, Any]) -> None:
        log = self._require().log
        now = verdicts(doc)
        for kind, (short, binding, effective) in now.items():
            if self._said.get(kind) == (short, binding, effective):
                continue
            window = doc["kinds"][kind]
            if short:
                log.warning(
                    "window_too_short",
                    kind=kind,
                    binding=binding,
                    effective_s=effective,
                    predicted_flush_s=window["predicted_flush_s"],
                    lengthen=window.get("lengthen", ""),
                )
            elif kind in self._said and self._said[kind][0]:
                log.info("window_fits", kind=kind, binding=binding, effective_s=effective)
        self._said = now

    async def _loop(self) -> None:
        host = self._require()
        while True:
            self._poke.clear()
            try:
                await self.gather()
            except Exception as exc:  # the next round tries again; status keeps the last result
                host.log.error("window_failed", error=repr(exc), exc_info=True)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._poke.wait(), timeout=self.refresh_s)
            await asyncio.sleep(0.2)  # coalesce a burst of reports into one round

    # ----- reading -----

    def status(self) -> dict[str, Any]:
        host = self._require()
        cloud = host.identity.cloud
        spec = CLOUDS.available().get(cloud) if cloud else None
        said = spec.leads(host.config.table(spec.name, spec.schema)) if spec is not None else ()
        # An active notice's own lead, not the cloud's usual figure: a 20 s notice on AWS gives a job 20 s.
        leads = notice_leads(cloud_leads(cloud, said), host.board.active())
        flush = self.flushes.predict(host.config.table("advisor", AdvisorConfig).save_time_s)
        return build_window(leads, self._limits, flush, self._checked_at)


class WindowCollector:
    """``preemptd_window_seconds{kind,limit}``, ``preemptd_window_too_short{kind}`` and the predicted flush."""

    def __init__(self, component: WindowComponent) -> None:
        self.component = component

    def collect(self) -> list[Metric]:
        doc = self.component.status()
        seconds = GaugeMetricFamily(
            "preemptd_window_seconds",
            "Seconds a job gets after a notice: the cloud's notice, each limit on this host, and the shortest "
            "(limit=effective)",
            labels=["kind", "limit"],
        )
        short = GaugeMetricFamily(
            "preemptd_window_too_short",
            "1 when the predicted emergency flush does not fit in the effective window of this notice kind",
            labels=["kind"],
        )
        flush = GaugeMetricFamily(
            "preemptd_window_predicted_flush_seconds", "Seconds the emergency flush is predicted to take"
        )
        values, verdict = metric_values(doc)
        for kind, limit, value in values:
            seconds.add_metric([kind, limit], value)
        for kind, flag in verdict:
            short.add_metric([kind], flag)
        predicted = doc["predicted_flush"]["seconds"]
        if predicted is not None:
            flush.add_metric([], float(predicted))
        return [seconds, short, flush]
