"""What the parts register with the host while they are set up (agent/core/ports.py, ``Host``): routes,
status sections, metrics collectors and capabilities, and the listeners and checks of client reports and of
event streams; and the calls that reach those listeners and checks. The agent holds one and answers the
host's registration methods with it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from agent.core.fanout import call_each
from agent.core.ports import Handler
from agent.core.reports import Report

ReportCheck = Callable[[Report, bool], "tuple[int, str] | None"]


class Hooks:
    """``capability_of(name)`` answers for the names no part provided (the running sources' capabilities)."""

    def __init__(self, log: Any, capability_of: Callable[[str], Any | None]) -> None:
        self.routes: list[tuple[str, str, Handler]] = []
        self.status_sections: dict[str, Callable[[], Any]] = {}
        self.collectors: list[Any] = []
        self.reports_total: dict[str, int] = {}
        self._log = log
        self._capability_of = capability_of
        self._capabilities: dict[str, Any] = {}
        self._report_listeners: list[Callable[[Report], None]] = []
        self._report_checks: list[ReportCheck] = []
        self._subscriber_listeners: list[Callable[[Mapping[str, Any]], None]] = []

    def add_route(self, method: str, path: str, handler: Handler) -> None:
        self.routes.append((method, path, handler))

    def add_status_section(self, name: str, fn: Callable[[], Any]) -> None:
        self.status_sections[name] = fn

    def add_metrics_collector(self, collector: Any) -> None:
        self.collectors.append(collector)

    def provide(self, name: str, fn: Any) -> None:
        self._capabilities[name] = fn

    def capability(self, name: str) -> Any | None:
        if name in self._capabilities:
            return self._capabilities[name]
        return self._capability_of(name)

    def on_report(self, fn: Callable[[Report], None]) -> None:
        self._report_listeners.append(fn)

    def add_report_check(self, fn: ReportCheck) -> None:
        self._report_checks.append(fn)

    def on_subscriber(self, fn: Callable[[Mapping[str, Any]], None]) -> None:
        self._subscriber_listeners.append(fn)

    def check_report(self, report: Report, privileged: bool) -> tuple[int, str] | None:
        """The first check's refusal (HTTP status, reason), or None."""
        for check in self._report_checks:
            refusal = check(report, privileged)
            if refusal is not None:
                return refusal
        return None

    def accept_report(self, report: Report) -> None:
        """Count and log (at debug: the socket's handler tallies them at info) an accepted report, then tell
        the report listeners in registration order."""
        self.reports_total[report.phase] = self.reports_total.get(report.phase, 0) + 1
        self._log.debug(
            "report_received",
            phase=report.phase,
            step=report.step,
            duration_s=report.duration_s,
            bytes=report.bytes,
            emergency=report.emergency,
            notice_id=report.notice_id,
            client=dict(report.client),
            peer_pid=report.peer_pid,
        )
        call_each(self._report_listeners, report, self._log, "report_listener_failed")

    def subscriber_connected(self, peer: Mapping[str, Any]) -> None:
        call_each(self._subscriber_listeners, peer, self._log, "subscriber_listener_failed")
