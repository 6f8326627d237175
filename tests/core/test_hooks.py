"""What parts register with the host (agent/core/hooks.py): capabilities, report checks and report and
event-stream listeners, each isolated from the others' failures."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Any

import structlog
from structlog.testing import capture_logs

from agent.core.hooks import Hooks
from agent.core.reports import Report

T0 = datetime(2026, 12, 3, 12, 0, 0, tzinfo=timezone.utc)


def report(phase: str = "finished") -> Report:
    return Report(kind="checkpoint", phase=phase, received_at=T0, step=7)


def hooks(sources: Mapping[str, Any] | None = None) -> Hooks:
    return Hooks(structlog.get_logger(), (sources or {}).get)


def test_a_report_listener_that_raises_is_logged_and_the_next_still_hears_the_report() -> None:
    h = hooks()
    heard: list[int | None] = []

    def broken(r: Report) -> None:
        raise RuntimeError("bug")

    h.on_report(broken)
    h.on_report(lambda r: heard.append(r.step))
    with capture_logs() as logs:
        h.accept_report(report())
    # The report's own line is at debug, which the process's configured level may drop: not asserted here.
    assert ([7], ["report_listener_failed"], {"finished": 1}) == (
        heard,
        [e["event"] for e in logs if e["log_level"] != "debug"],
        h.reports_total,
    )


def test_an_event_stream_listener_that_raises_does_not_keep_the_peer_from_the_next() -> None:
    h = hooks()
    heard: list[Mapping[str, Any]] = []
    h.on_subscriber(lambda peer: 1 / 0)  # type: ignore[func-returns-value]
    h.on_subscriber(heard.append)
    with capture_logs() as logs:
        h.subscriber_connected({"pid": 42})
    assert ([{"pid": 42}], ["subscriber_listener_failed"]) == (heard, [e["event"] for e in logs])


def test_the_first_check_that_refuses_a_report_decides() -> None:
    h = hooks()
    h.add_report_check(lambda r, privileged: None)
    h.add_report_check(lambda r, privileged: (403, "first"))
    h.add_report_check(lambda r, privileged: (409, "second"))
    assert (403, "first") == h.check_report(report(), privileged=False)


def test_a_provided_capability_wins_over_a_source_s_and_an_unknown_one_is_none() -> None:
    h = hooks({"gpu_pids": "from the source", "azure_ack": "from azure"})
    h.provide("gpu_pids", "provided")
    assert ("provided", "from azure", None) == (
        h.capability("gpu_pids"),
        h.capability("azure_ack"),
        h.capability("nothing"),
    )
