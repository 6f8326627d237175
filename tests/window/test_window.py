"""The effective notice window (agent/window/): the shortest of the cloud's notice and the host's limits,
the binding one, the verdict against the predicted flush, unknown limits; and, on a real agent, a limit source
that hangs or fails is shown as unknown while status keeps answering."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from agent.bridges.slurm_commands import SlurmCommands
from agent.bridges.slurm_window import READ_S, KillWait, parse_kill_wait
from agent.client.reporting import Reporter, client_info
from agent.core.reports import parse_report
from agent.simulate.gcp import GcpSimulator
from agent.sources import clouds
from agent.window.component import WindowComponent, exec_hold_s
from agent.window.effective import (
    EXEC_HOLD_MAX_S,
    Flush,
    FlushBook,
    Lead,
    build_window,
    cloud_leads,
    launcher_limits,
    metric_values,
    window_lines,
)
from agent.window.limits import Limit, limit_registry
from agent.window.signals import parse_timespan
from tests.cloud_harness import settings_for
from tests.support import running_agent
from tests.window.support import LEAD, NOW, TORCHRUN, window_until

GRACE = Limit("pod_grace", 15.0, "pod ml/train-0", lengthen="raise the grace")


def window(lead: Lead, limits: list[Limit], flush_s: float | None, tier: str | None = None) -> dict[str, Any]:
    return build_window([lead], limits, Flush(flush_s, "test", tier), NOW)["kinds"][lead.kind]


def test_the_shortest_limit_binds_and_a_longer_flush_does_not_fit() -> None:
    doc = window(LEAD, [TORCHRUN, GRACE], 20.0)
    assert (15.0, "pod_grace", False, True) == (
        doc["effective_s"],
        doc["binding"],
        doc["fits"],
        doc["window_too_short"],
    )
    assert doc["lengthen"].startswith("raise the grace")
    assert 'tier="peer"' in doc["lengthen"]  # a flush that is not a peer one is told of the peer tier
    assert ["torchrun", "pod_grace"] == [limit["name"] for limit in doc["limits"]]


def test_a_flush_within_the_window_fits_and_the_cloud_binds_without_host_limits() -> None:
    assert (120.0, "cloud", True, False) == tuple(
        window(LEAD, [], 90.0)[k] for k in ("effective_s", "binding", "fits", "window_too_short")
    )
    assert (30.0, "torchrun", True) == tuple(
        window(LEAD, [TORCHRUN], 30.0)[k] for k in ("effective_s", "binding", "fits")
    )


def test_the_cloud_binds_among_equals() -> None:
    gcp = Lead("termination", 30.0, "gcp")
    assert "cloud" == window(gcp, [TORCHRUN], 10.0)["binding"]


def test_an_unknown_limit_is_listed_and_never_binds() -> None:
    stuck = Limit("slurm", None, "slurm", detail="no answer within 5 s")
    doc = window(LEAD, [stuck, TORCHRUN], 45.0)
    assert (30.0, "torchrun", ["slurm"]) == (doc["effective_s"], doc["binding"], doc["unknown"])
    assert {
        "name": "slurm",
        "seconds": None,
        "state": "unknown",
        "source": "slurm",
        "detail": "no answer within 5 s",
    } == doc["limits"][0]
    nothing = window(Lead("termination", None, "cloud none"), [stuck], 45.0)
    assert (None, None, None, False) == tuple(
        nothing[k] for k in ("effective_s", "binding", "fits", "window_too_short")
    )


def test_without_a_prediction_there_is_no_verdict() -> None:
    doc = window(LEAD, [TORCHRUN], None)
    assert (30.0, "torchrun", None, False) == tuple(
        doc[k] for k in ("effective_s", "binding", "fits", "window_too_short")
    )


def test_an_advisory_notice_has_no_deadline_and_no_limits() -> None:
    rebalance = Lead("rebalance", None, "aws: advisory", deadline=False)
    doc = window(rebalance, [TORCHRUN], 45.0)
    assert ([], None, None) == (doc["limits"], doc["effective_s"], doc["fits"])


def test_a_limit_for_some_kinds_only_applies_to_those() -> None:
    only = Limit("unit_stop", 5.0, "unit", kinds=("maintenance",))
    assert "cloud" == window(LEAD, [only], 10.0)["binding"]
    assert "unit_stop" == window(Lead("maintenance", 300.0, "x"), [only], 10.0)["binding"]


def test_a_peer_flush_is_not_told_of_the_peer_tier() -> None:
    assert "hold SIGTERM" == window(LEAD, [TORCHRUN], 45.0, tier="peer")["lengthen"]


def leads_of(cloud: str, **table: Any) -> list[Lead]:
    """The window's leads on ``cloud`` as its spec gives them for its table (defaults, but ``table``)."""
    spec = clouds.get(cloud)
    return cloud_leads(cloud, spec.leads(spec.schema(**table)))


def test_the_clouds_leads() -> None:
    leads = {lead.kind: lead for lead in leads_of("aws")}
    assert (120.0, None, False) == (
        leads["termination"].seconds,
        leads["rebalance"].seconds,
        leads["rebalance"].deadline,
    )
    gcp = {lead.kind: lead for lead in leads_of("gcp", preempt_notice_s=120.0)}
    assert 120.0 == gcp["termination"].seconds
    assert "preemptionNoticeDuration" in gcp["termination"].lengthen
    assert 30.0 == leads_of("azure")[0].seconds
    assert 300.0 == leads_of("alibaba")[0].seconds
    assert leads_of("tencent")[0].seconds is None
    assert [None, None] == [lead.seconds for lead in cloud_leads(None)]


def report(**doc: Any) -> Any:
    return parse_report({"kind": "checkpoint", **doc}, NOW, peer_pid=100, peer_uid=0)


def test_the_flush_prediction_prefers_the_deadline_budget_then_emergency_then_periodic_saves() -> None:
    book = FlushBook()
    assert (None, 12.0) == (book.predict().seconds, book.predict(12.0).seconds)
    for duration in (5.0, 40.0, 7.0, 8.0, 9.0):  # the slowest of the last three
        book.add(report(phase="finished", duration_s=duration))
    assert 9.0 == book.predict(12.0).seconds
    book.add(report(phase="finished", duration_s=3.0, emergency=True, flush={"tier": "peer"}))
    assert (3.0, "peer") == (book.predict().seconds, book.predict().tier)
    book.add(report(phase="started", flush={"predicted_s": 44.5}, client={"job": "j", "rank": 0}))
    book.add(report(phase="started", flush={"predicted_s": 40.0}, client={"job": "j", "rank": 1}))
    assert (44.5, "deadline budget of job j (clients' predicted_s)") == (
        book.predict().seconds,
        book.predict().source,
    )
    book.add(report(phase="started", flush={"predicted_s": 20.0}, client={"job": "k", "rank": 0}))
    assert 20.0 == book.predict().seconds  # the job that reported last, not one that may have ended


def test_the_torchrun_limit_names_its_launchers_and_exec() -> None:
    assert [] == launcher_limits([])
    [limit] = launcher_limits(
        [("j/0@11", 10, "torchrun", False, None), ("j/1@12", 10, "torchrun", False, None)]
    )
    assert (30.0, "torchrun (pid 10) launches j/0@11, j/1@12") == (limit.seconds, limit.source)
    assert "preemptd exec -- torchrun" in limit.lengthen
    [wrapped] = launcher_limits([("j/0@11", 10, "torchrun", True, None)])
    assert ("under preemptd exec, with --no-hold", "known", True) == (
        wrapped.detail,
        wrapped.to_json()["state"],
        "drop exec's --no-hold" in wrapped.lengthen,
    )


def test_under_an_exec_that_holds_sigterm_torchrun_counts_from_the_hold_max() -> None:
    """torchrun's 30 s start after the save, at the latest --hold-max after SIGTERM: a held limit that long;
    one participant whose exec does not hold makes it the plain 30 s."""
    [held] = launcher_limits([("j/0@11", 10, "torchrun", True, 90.0), ("j/1@12", 10, "torchrun", True, 60.0)])
    assert (90.0, "held", True, True) == (
        held.seconds,
        held.to_json()["state"],
        held.detail.startswith("held: preemptd exec holds an early SIGTERM"),
        "--hold-max (60 s)" in held.lengthen,
    )
    [mixed] = launcher_limits(
        [("j/0@11", 10, "torchrun", True, 90.0), ("j/1@12", 10, "torchrun", True, None)]
    )
    assert (30.0, "known") == (mixed.seconds, mixed.to_json()["state"])
    doc = build_window([LEAD], [held], Flush(45.0, "deadline budget"), NOW)
    assert ("torchrun", True) == (doc["kinds"]["termination"]["binding"], doc["kinds"]["termination"]["fits"])
    assert "  termination  1m30s (torchrun binds): fits  [cloud 2m00s, torchrun 1m30s held]" in window_lines(
        doc
    )


@pytest.mark.parametrize(
    ("cmdline", "hold"),
    [
        (["/venv/bin/python", "/venv/bin/preemptd", "exec", "--", "torchrun", "--no-hold"], EXEC_HOLD_MAX_S),
        (["python3", "-m", "agent", "exec", "--no-hold", "--", "torchrun"], None),
        (["preemptd", "exec", "--stop-grace", "5", "--hold-max", "40", "--", "torchrun"], 40.0),
        (["preemptd", "exec", "--hold-max=12.5", "torchrun", "--hold-max", "3"], 12.5),
        (["preemptd", "exec", "--hold-max", "0", "--", "torchrun"], None),
        (["preemptd", "exec", "--socket", "/run/a.sock", "torchrun", "--no-hold"], EXEC_HOLD_MAX_S),
    ],
)
def test_exec_s_hold_is_read_from_its_command_line(cmdline: list[str], hold: float | None) -> None:
    assert hold == exec_hold_s(cmdline)


def test_the_window_knows_exec_s_default_hold_max() -> None:
    from agent.cli.exec_hold import HOLD_MAX_S

    assert HOLD_MAX_S == EXEC_HOLD_MAX_S


async def test_kill_wait_is_read_again_only_after_a_while(tmp_path: Path) -> None:
    """Every node's agent asks the one controller: KillWait is read at most every READ_S (a stand-in
    scontrol that counts its calls)."""
    calls = tmp_path / "calls"
    scontrol = tmp_path / "scontrol"
    scontrol.write_text(f"#!/bin/sh\necho \"$@\" >> {calls}\necho 'KillWait                = 45 sec'\n")
    scontrol.chmod(0o755)
    now = [0.0]
    source = KillWait(SlurmCommands(bin_dir=str(tmp_path)), clock=lambda: now[0])
    assert [45.0, 45.0] == [(await source())[0].seconds for _ in range(2)]
    now[0] = READ_S + 1
    await source()
    assert ["show config", "show config"] == calls.read_text().splitlines()


def test_kill_wait_is_read_from_scontrol_show_config() -> None:
    text = "Configuration data as of 2026-12-04T12:00:00\nJobAcctGatherType       = (null)\nKillWait                = 30 sec\nKillOnBadExit           = 0\n"
    assert 30.0 == parse_kill_wait(text)
    assert parse_kill_wait("KillOnBadExit = 0\n") is None


def test_the_status_lines_and_the_metric_values() -> None:
    doc = build_window(
        [LEAD, Lead("rebalance", None, "advisory", deadline=False)],
        [TORCHRUN, Limit("slurm", None, "slurm")],
        Flush(45.0, "deadline budget"),
        NOW,
    )
    lines = window_lines(doc)
    assert (  # wrapped at 80 columns, under the kind's row
        "  termination  30s (torchrun binds): TOO SHORT  [cloud 2m00s, torchrun 30s,\n"
        "               slurm unknown]"
    ) in "\n".join(lines)
    assert "  rebalance    no deadline" in lines
    assert any(
        line.startswith("  window_too_short: termination: the flush (45s) outlasts torchrun (30s)")
        for line in lines
    )
    seconds, short = metric_values(doc)
    assert [
        ("termination", "cloud", 120.0),
        ("termination", "torchrun", 30.0),
        ("termination", "effective", 30.0),
    ] == seconds
    assert [("termination", 1)] == short
    assert [] == window_lines(build_window([LEAD], [], Flush(None, "x"), None))  # not gathered yet
    nothing = build_window(cloud_leads(None), [], Flush(12.0, "x"), NOW)
    assert ["Window: no limit known on this host (predicted flush 12s, x)"] == window_lines(nothing)


# ----- on a real agent ---------------------------------------------------------------------------------------


def window_component(agent: Any) -> WindowComponent:
    found = next(c for c in agent.components if c.name == "window")
    assert isinstance(found, WindowComponent)
    return found


async def test_a_hung_and_a_failing_limit_source_are_unknown_and_status_still_answers(base: Path) -> None:
    released = asyncio.Event()

    async def hangs() -> list[Limit]:
        await released.wait()
        return [Limit("never", 1.0, "never")]

    async def fails() -> list[Limit]:
        raise OSError("scontrol: cannot reach the controller")

    async def answers() -> list[Limit]:
        return [Limit("unit_stop", 12.0, "unit train.service: TimeoutStopSec")]

    with capture_logs() as logs:
        async with running_agent(base) as agent:
            assert agent.socket_path is not None
            component = window_component(agent)
            component.source_timeout_s = 0.5
            registry = limit_registry(agent.hooks)
            registry.add("stuck", hangs)
            registry.add("broken", fails)
            registry.add("unit", answers)
            body = await window_until(
                agent.socket_path,
                lambda doc: {"stuck", "broken", "unit_stop"} <= {limit["name"] for limit in doc["limits"]},
            )
            released.set()
    shown = {limit["name"]: limit for limit in body["window"]["limits"]}
    assert (None, "unknown", "no answer within 0.5 s") == (
        shown["stuck"]["seconds"],
        shown["stuck"]["state"],
        shown["stuck"]["detail"],
    )
    assert "OSError: scontrol: cannot reach the controller" == shown["broken"]["detail"]
    termination = body["window"]["kinds"]["termination"]
    assert (12.0, "unit_stop", ["stuck", "broken"]) == (
        termination["effective_s"],
        termination["binding"],
        sorted(termination["unknown"], key=["stuck", "broken"].index),
    )
    unknown = [e for e in logs if e["event"] == "window_limit_unknown"]
    assert {"stuck", "broken"} == {e["source"] for e in unknown}
    assert "Window (flush not predicted: no checkpoint reported yet):" in "\n".join(
        window_lines(body["window"])
    )


async def test_at_start_up_the_saves_of_the_last_run_warn_that_gcps_30_s_are_too_short(base: Path) -> None:
    """The first run hears a 45 s checkpoint; the next start reads it back from the history and warns at once
    that GCP's 30 s (gcp.preempt_notice_s) are too short, naming preemptionNoticeDuration."""
    sock = base / "a.sock"
    async with GcpSimulator() as sim:
        settings = settings_for("gcp", sim.url)
        async with running_agent(base, settings):
            reporter = Reporter(sock, client=client_info(name="train.py"))
            reporter.checkpoint("finished", 1, duration_s=45.0)
            assert await asyncio.to_thread(reporter.flush, 10)
            reporter.close()
        with capture_logs() as logs:
            async with running_agent(base, settings):
                body = await window_until(sock, lambda doc: doc["state"] == "ok")
    termination = body["window"]["kinds"]["termination"]
    assert (30.0, "cloud", 45.0, True) == (
        termination["effective_s"],
        termination["binding"],
        termination["predicted_flush_s"],
        termination["window_too_short"],
    )
    assert "gcp.preempt_notice_s = 30 s" in termination["cloud"]["source"]
    assert "preemptionNoticeDuration" in termination["lengthen"]
    [warning] = [e for e in logs if e["event"] == "window_too_short"]
    assert ("termination", "cloud", 30.0, 45.0) == (
        warning["kind"],
        warning["binding"],
        warning["effective_s"],
        warning["predicted_flush_s"],
    )
    assert "slowest of the last 1 periodic saves" == body["window"]["predicted_flush"]["source"]


def test_systemd_time_spans() -> None:
    assert [90.0, 90.0, 0.5, 3723.004, None, None, None] == [
        parse_timespan(text)
        for text in ("1min 30s", "90s", "500ms", "1h 2min 3s 4ms", "infinity", "soon", "")
    ]


async def test_a_signal_rule_that_escalates_binds_and_its_units_stop_timeout_is_read(base: Path) -> None:
    """The signal action SIGKILLs 8 s after its SIGTERM at the notice; the unit it signals has systemd's
    TimeoutStopSec (unknown where systemd does not run, as here in a container, with systemctl's reason)."""
    rule = {"name": "trainer", "kinds": ["termination"], "units": ["train.service"], "escalate_after_s": 8.0}
    sock = base / "a.sock"
    async with running_agent(base, {"actions.signals": [rule]}):
        reporter = Reporter(sock, client=client_info(name="train.py"))
        reporter.checkpoint("finished", 1, duration_s=10.0)
        assert await asyncio.to_thread(reporter.flush, 10)
        reporter.close()
        body = await window_until(
            sock,
            lambda doc: doc["state"] == "ok" and doc["kinds"]["termination"]["predicted_flush_s"] == 10.0,
        )
    termination = body["window"]["kinds"]["termination"]
    shown = {limit["name"]: limit for limit in termination["limits"]}
    assert {"signal_escalation", "unit_stop"} == set(shown)
    assert (
        "[[actions.signals]] 'trainer': SIGKILL 8 s after its SIGTERM at the notice"
        == (shown["signal_escalation"]["source"])
    )
    unit = shown["unit_stop"]
    assert unit["source"].startswith("unit train.service: TimeoutStopSec")
    assert unit["state"] == "known" or unit["detail"]  # systemd's figure, or why systemctl could not say
    assert (8.0, "signal_escalation", True) == (
        termination["effective_s"],
        termination["binding"],
        termination["window_too_short"],
    )
    assert "escalate_after_s of the [[actions.signals]] rule 'trainer'" in termination["lengthen"]
    assert [] == body["window"]["kinds"]["maintenance"]["limits"]  # the rule is for terminations only
