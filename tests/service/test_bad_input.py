"""Bad input on the socket against a real agent: every malformed request is a 4xx that says why, and client
mistakes reach the log as bounded, rate-limited warnings without tracebacks."""

from __future__ import annotations

import asyncio
import io
import json
import logging
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import structlog
from structlog.testing import LogCapture, capture_logs

from agent.core.ratelog import MAX_KEYS, OTHER
from agent.service.clientlog import ClientMistakes, StreamTally, Tally
from tests.support import eventually, http_json, running_agent

HUGE_INT = b"1" + b"0" * 400
DEEP = 20_000

CASES = [
    ("/v1/reports", b'{"kind":"checkpoint","phase":"finished","duration_s":1e400}', "'duration_s'"),
    (
        "/v1/reports",
        b'{"kind":"checkpoint","phase":"finished","duration_s":' + HUGE_INT + b"}",
        "'duration_s'",
    ),
    ("/v1/reports", b'{"kind":"checkpoint","phase":"finished","duration_s":1e300}', "'duration_s'"),
    ("/v1/reports", b'{"kind":"checkpoint","phase":"started","step":' + HUGE_INT + b"}", "'step'"),
    ("/v1/reports", b"[" * DEEP + b"]" * DEEP, "nested too deeply"),
    ("/v1/reports", b'{"client":' * DEEP + b"{}" + b"}" * DEEP, "nested too deeply"),
    (
        "/v1/reports",
        b'{"kind":"checkpoint","phase":"started","step":1' + b"0" * 5000 + b"}",
        "not valid JSON",
    ),
    ("/v1/reports", b'{"kind": "\xff"}', "not UTF-8"),
    ("/v1/drills", b'{"in_s":' + HUGE_INT + b"}", "'in_s'"),
    ("/v1/drills", b'{"in_s":1e400}', "'in_s'"),
    ("/v1/drills", b'{"in_s":-' + HUGE_INT + b"}", "'in_s'"),
    ("/v1/drills", b"[" * DEEP + b"]" * DEEP, "nested too deeply"),
]


@pytest.mark.parametrize(
    ("path", "raw", "names"), CASES, ids=[f"{p}-{i}" for i, (p, _, _) in enumerate(CASES)]
)
async def test_a_malformed_body_is_a_400_that_says_why_and_the_agent_keeps_serving(
    base: Path, path: str, raw: bytes, names: str
) -> None:
    async with running_agent(base, {"api.max_body_bytes": 1 << 20}) as agent:
        with capture_logs() as logs:
            status, body = await http_json(agent.config.socket, "POST", path, raw=raw)
        after, _ = await http_json(agent.config.socket, "GET", "/v1/status")
    assert (400, 200) == (status, after)
    assert names in body["error"]
    assert len(body["error"]) < 400
    assert ["warning"] == [e["log_level"] for e in logs if e["log_level"] != "info"]
    assert [] == [e for e in logs if "exc_info" in e]


async def post_big(socket_path: Path, path: str, raw: bytes) -> tuple[int, Any]:
    """POST a body of several MiB (streamed, so that the client does not warn about it)."""
    connector = aiohttp.UnixConnector(path=str(socket_path))
    async with (
        aiohttp.ClientSession(connector=connector) as session,
        session.post(f"http://agent{path}", data=io.BytesIO(raw)) as response,
    ):
        return response.status, await response.json()


async def test_a_huge_value_is_quoted_briefly_in_the_answer_and_the_log(base: Path) -> None:
    huge = {"kind": "x" * 3_000_000, "phase": "started", **{f"extra{i}": 1 for i in range(10_000)}}
    async with running_agent(base, {"api.max_body_bytes": 4 << 20}) as agent:
        with capture_logs() as logs:
            status, body = await post_big(agent.config.socket, "/v1/reports", json.dumps(huge).encode())
    assert 400 == status
    assert body["error"].startswith("unknown field(s) 'extra0', 'extra1', 'extra10', 'extra100', 'extra1000'")
    assert body["error"].split(";")[0].endswith("and 9995 more")
    assert [("report_rejected", "warning")] == [(e["event"], e["log_level"]) for e in logs]
    assert len(json.dumps(logs[0])) < 1000


async def test_a_flood_of_bad_reports_is_logged_as_a_burst_then_counted(base: Path) -> None:
    async with running_agent(base) as agent:
        with capture_logs() as logs:
            answers = [
                await http_json(agent.config.socket, "POST", "/v1/reports", {"kind": "nap"})
                for _ in range(30)
            ]
        _, metrics = await http_json(agent.config.socket, "GET", "/metrics")
    assert {400} == {status for status, _ in answers}
    assert 10 == len([e for e in logs if e["event"] == "report_rejected"])
    assert "preemptd_reports_rejected_total 30.0" in metrics


async def test_a_request_aiohttp_cannot_parse_is_a_warning_without_traceback(
    base: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with running_agent(base) as agent:
        with capture_logs() as logs, caplog.at_level(logging.DEBUG, logger="aiohttp.server"):
            reader, writer = await asyncio.open_unix_connection(str(agent.config.socket))
            writer.write(b"GET /v1/status HTTP/1.1\r\nX-Long: " + b"a" * 100_000 + b"\r\n\r\n")
            await writer.drain()
            answer = await asyncio.wait_for(reader.read(65536), 10)
            writer.close()
            await writer.wait_closed()
    assert b" 400 Bad Request" in answer.split(b"\r\n", 1)[0]
    assert [] == [r for r in caplog.records if r.levelno >= logging.WARNING]
    warned = [e for e in logs if e["event"] == "bad_request"]
    assert [("warning", 400)] == [(e["log_level"], e["status"]) for e in warned]
    assert len(json.dumps(warned[0])) < 1000


def test_past_the_burst_warnings_refill_over_the_interval_and_say_how_many_were_left_out() -> None:
    now = [0.0]
    mistakes = ClientMistakes(
        structlog.get_logger("preemptd"), burst=2, interval_s=60.0, clock=lambda: now[0]
    )
    with capture_logs() as logs:
        logged = [mistakes.warning("report_rejected", error="bad") for _ in range(5)]
        now[0] = 30.0  # one warning's worth of budget back
        logged.append(mistakes.warning("report_rejected", error="bad"))
        logged.append(mistakes.warning("drill_rejected", error="other kinds have their own budget"))
    assert [True, True, False, False, False, True, True] == logged
    assert [None, None, 3, None] == [e.get("suppressed") for e in logs]


async def test_a_body_cut_short_is_a_warning_without_traceback_and_the_connection_is_closed(
    base: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The client sends 9 of the 100 bytes it announced and leaves: no answer can reach it, so none is
    waited for; the log says what happened, briefly (aiohttp once logged an error with a traceback)."""
    async with running_agent(base) as agent:
        with capture_logs() as logs, caplog.at_level(logging.DEBUG, logger="aiohttp.server"):
            _, writer = await asyncio.open_unix_connection(str(agent.config.socket))
            writer.write(
                b"POST /v1/reports HTTP/1.1\r\nHost: agent\r\nContent-Length: 100\r\n\r\n" + b'{"kind": '
            )
            await writer.drain()
            writer.close()
            await writer.wait_closed()
            await eventually(lambda: any(e["event"] == "bad_request" for e in logs), what="the warning")
            status, _ = await http_json(agent.config.socket, "GET", "/v1/status")
    assert 200 == status
    assert [] == [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert [("warning", 400, "the connection ended after 9 of 100 body bytes")] == [
        (e["log_level"], e["status"], e["error"]) for e in logs if e["event"] == "bad_request"
    ]
    assert [] == [e for e in logs if e["log_level"] == "error" or "exc_info" in e]


async def test_valid_requests_in_a_loop_are_one_info_line_per_interval_with_bounded_counts() -> None:
    """More keys than a line keeps are counted under ``other``; the amounts are summed."""
    capture = LogCapture()
    log = structlog.wrap_logger(
        None, processors=[capture], wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG)
    )
    tally = Tally(log, "reports_received", interval_s=0.05)
    jobs = MAX_KEYS + 4
    for n in range(jobs):
        tally.count({"kinds": "checkpoint finished", "jobs": f"job-{n}"}, {"bytes": 10})
    await eventually(lambda: bool(capture.entries), what="the line")
    tally.close()  # nothing left to say: no second line
    [line] = capture.entries
    assert ("info", jobs, {"checkpoint finished": jobs}, MAX_KEYS + 1, 4, 10 * jobs) == (
        line["log_level"],
        line["total"],
        line["kinds"],
        len(line["jobs"]),
        line["jobs"][OTHER],
        line["bytes"],
    )


async def test_event_streams_coming_and_going_are_one_info_line_per_interval() -> None:
    open_now = [0]
    # A logger of its own at debug: the process's configured level depends on which tests ran before.
    capture = LogCapture()
    log = structlog.wrap_logger(
        None, processors=[capture], wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG)
    )
    logs = capture.entries
    tally = StreamTally(log, lambda: open_now[0], interval_s=0.05)
    for n in range(3):
        open_now[0] = n + 1
        tally.connected(subscriber=n)
    for n in range(3):
        open_now[0] -= 1
        tally.disconnected("client closed the stream", subscriber=n)
    await eventually(lambda: any(e["event"] == "event_streams" for e in logs), what="the line")
    tally.close()  # nothing left to say: no second line
    assert ["client_connected"] * 3 + ["client_disconnected"] * 3 == [
        e["event"] for e in logs if e["log_level"] == "debug"
    ]
    [line] = [e for e in logs if e["log_level"] == "info"]
    assert ("event_streams", 3, 3, {"client closed the stream": 3}, 3, 0) == (
        line["event"],
        line["connected"],
        line["disconnected"],
        line["reasons"],
        line["peak"],
        line["open"],
    )
