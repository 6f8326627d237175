"""The Slurm bridge against a real one-node Slurm (tests/slurm_cluster.py): drain with the agent's reason,
requeue after ready or at the deadline minus the margin, signals, resume only of the agent's own drain, and
the degraded state when Slurm's tools are missing or failing. Parsers are tested on real sinfo/squeue JSON."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from structlog.testing import capture_logs

from agent.bridges.common import REASON_PREFIX, BridgeCollector, drain_reason
from agent.bridges.slurm import SlurmBridge, SlurmConfig
from agent.bridges.slurm_commands import (
    SlurmJob,
    match_node,
    parse_jobs,
    parse_nodes,
    parse_signal,
    requeue_verdict,
    running_or_ended_since,
)
from agent.config import load_config
from agent.core.errors import ConfigError
from agent.core.notice import EventType, Notice
from agent.service.daemon import Agent
from tests.actions_support import event, make_notice
from tests.bridges.slurm import (
    agent_settings,
    bridge_for,
    drained_for_a_notice,
    drained_with,
    running,
    slurm_status,
    until,
)
from tests.lazy import needs_torch
from tests.slurm_cluster import NODE, SlurmCluster
from tests.support import REPO, SSEClient, agent_config, http_json, running_agent

pytestmark = pytest.mark.timeout(120)

DATA = Path(__file__).parents[1] / "data" / "slurm"


# --- pure: parsers, reason, config ---------------------------------------------------------------------


def test_parse_nodes_of_slurm_22_05() -> None:
    """sinfo --json of Slurm 22.05 (openapi/v0.0.38): the state is a string, DRAIN a flag."""
    nodes = parse_nodes((DATA / "sinfo-22.05-drained.json").read_text())
    assert [(n.name, n.hostname, n.address, n.drained, n.reason) for n in nodes] == [
        ("spot-a", "vm", "127.0.0.1", True, "maintenance by the admin")
    ]


def test_parse_nodes_of_data_parser_shape() -> None:
    """Slurm 23.02 and later (data_parser): the state is a list that holds DRAIN itself."""
    doc = {
        "nodes": [
            {
                "name": "n1",
                "hostname": "h1",
                "address": "10.0.0.1",
                "state": ["IDLE", "DRAIN"],
                "reason": "x",
            },
            {"name": "n2", "hostname": "h2", "address": "10.0.0.2", "state": ["ALLOCATED"], "reason": ""},
        ],
        "errors": [],
    }
    nodes = parse_nodes(json.dumps(doc))
    assert [(n.name, n.drained) for n in nodes] == [("n1", True), ("n2", False)]


def test_parse_jobs_of_slurm_22_05() -> None:
    jobs = parse_jobs((DATA / "squeue-22.05.json").read_text())
    assert [(j.job_id, j.state, j.requeue, j.active) for j in jobs] == [
        (1, "RUNNING", True, True),
        (2, "RUNNING", False, True),
    ]


def test_parse_jobs_exit_code_from_a_wait_status() -> None:
    """Slurm 22.05 gives the raw wait status: 19200 is an exit with 75, 9 a kill by SIGKILL."""
    doc = {"jobs": [{"job_id": 1, "job_state": "FAILED", "exit_code": 19200}, {"job_id": 2, "exit_code": 9}]}
    assert [j.exit_code for j in parse_jobs(json.dumps(doc))] == [75, 137]


def test_parse_jobs_of_data_parser_shape() -> None:
    doc = {
        "jobs": [
            {
                "job_id": 7,
                "name": "train",
                "job_state": ["FAILED"],
                "requeue": True,
                "nodes": "n1",
                "exit_code": {"status": ["EXITED"], "return_code": {"set": True, "number": 75}},
                "restart_cnt": 1,
            }
        ]
    }
    (job,) = parse_jobs(json.dumps(doc))
    assert (job.job_id, job.state, job.requeue, job.exit_code, job.restarts, job.active) == (
        7,
        "FAILED",
        True,
        75,
        1,
        False,
    )


def test_jobs_of_a_notice_are_running_or_ended_since_it_came() -> None:
    """A job that ended after the notice came (its flush, then exit 75) is still the notice's job; one that
    ended before, or waits in the queue, is not."""
    doc = {
        "jobs": [
            {"job_id": 1, "job_state": "RUNNING", "end_time": 900},
            {"job_id": 2, "job_state": "FAILED", "end_time": 1000},
            {"job_id": 3, "job_state": "CANCELLED", "end_time": 999},
            {"job_id": 4, "job_state": "PENDING", "end_time": 5000},
            {"job_id": 5, "job_state": "COMPLETED", "end_time": 1001},
        ]
    }
    assert [j.job_id for j in running_or_ended_since(parse_jobs(json.dumps(doc)), 1000.0)] == [1, 2, 5]


def job_in(state: str, *, requeue: bool = True, restarts: int = 0, exit_code: int | None = None) -> SlurmJob:
    return SlurmJob(1, "train", "root", state, requeue, NODE, restarts=restarts, exit_code=exit_code)


@pytest.mark.parametrize(
    ("job", "tried", "expected"),
    [
        (job_in("RUNNING"), False, None),
        (job_in("FAILED", exit_code=75), False, None),
        (job_in("NODE_FAIL"), False, None),
        (
            job_in("RUNNING", requeue=False),
            False,
            ("not_requeueable", "left alone: not requeueable (submitted with --no-requeue)"),
        ),
        (
            SlurmJob(1, "train", "root", "RUNNING", True, NODE, batch=False),
            False,
            ("not_requeueable", "left alone: not a batch job (Slurm requeues only jobs that sbatch started)"),
        ),
        (job_in("RUNNING", restarts=1), False, ("skipped", "already requeued (restart count 1)")),
        (job_in("PENDING", restarts=1), True, ("ok", "requeued")),
        (job_in("PENDING"), False, ("skipped", "already pending")),
        (
            job_in("COMPLETED", exit_code=0),
            False,
            ("skipped", "left alone: ended COMPLETED (exit 0), not requeued"),
        ),
        (
            job_in("CANCELLED", exit_code=0),
            False,
            ("skipped", "left alone: ended CANCELLED (exit 0), not requeued"),
        ),
    ],
)
def test_requeue_verdict(job: SlurmJob, tried: bool, expected: tuple[str, str] | None) -> None:
    """None: requeue the job now; else what the status says instead. The notice found it with 0 restarts."""
    assert requeue_verdict(job, 0, tried) == expected


def test_a_running_jobs_exit_code_is_not_shown() -> None:
    """squeue gives a running job exit code 0; the status shows no exit code until the job has ended."""
    doc = {"jobs": [{"job_id": 1, "job_state": "RUNNING", "exit_code": 0}]}
    assert "exit_code" not in parse_jobs(json.dumps(doc))[0].to_json()


def test_parse_rejects_output_without_json() -> None:
    with pytest.raises(Exception, match="printed no JSON"):
        parse_nodes("sinfo: unrecognized option '--json'")


def test_match_prefers_hostname_then_address() -> None:
    nodes = parse_nodes((DATA / "sinfo-22.05-drained.json").read_text())
    assert match_node(nodes, ["vm"]) is not None
    assert match_node(nodes, ["127.0.0.1"]) is not None
    assert match_node(nodes, ["other", "10.9.9.9"]) is None


def test_drain_reason_names_agent_kind_source_deadline() -> None:
    notice = make_notice(source="aws", drill=False)
    reason = drain_reason(notice)
    assert reason.startswith(REASON_PREFIX)
    assert "termination from aws" in reason and notice.id in reason
    assert notice.deadline is not None and notice.deadline.strftime("%Y-%m-%dT%H:%M:%S") in reason


@pytest.mark.parametrize(
    ("value", "expected"), [("USR1", "USR1"), ("sigterm", "TERM"), ("10", "10"), ("", "")]
)
def test_parse_signal(value: str, expected: str) -> None:
    assert parse_signal(value) == expected


def test_unknown_signal_names_the_key() -> None:
    """The table itself refuses an unknown signal, so no bridge is ever built with one."""
    with pytest.raises(ConfigError, match=r"actions\.slurm\.signal: 'USR9' is not a signal"):
        SlurmConfig(enabled=True, signal="USR9")


# --- degraded ------------------------------------------------------------------------------------------


async def test_missing_tools_degrade_with_the_reason(tmp_path: Path) -> None:
    """No scontrol where the config says: degraded, and status and the log say why."""
    bridge = SlurmBridge(SlurmConfig(enabled=True, bin_dir=str(tmp_path)))
    with capture_logs() as logs:
        await bridge.start()
        await bridge.drain_tasks()
    status = bridge.status()
    assert status["state"] == "degraded"
    assert f"sinfo not found in {tmp_path}" in status["degraded_reason"]
    assert any(e["event"] == "slurm_degraded" for e in logs)
    await bridge.stop(1)


async def test_failing_controller_degrades_with_stderr(tmp_path: Path) -> None:
    """Slurm's tools fail (here: a slurm.conf they cannot read): degraded, the stderr is kept, and the drain
    is pending (tried again) until the notice clears."""
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=none\nSlurmctldHost=localhost(127.0.0.1)\nNoSuchKey=1\n")
    settings = {"timeout_s": 5.0, "retries": 0, "retry_first_s": 0.2, "retry_max_s": 0.5}
    bridge = SlurmBridge(SlurmConfig(enabled=True, slurm_conf=str(conf), drills=True, **settings))
    if not bridge.commands.env.get("PATH") or _missing("sinfo"):
        pytest.skip("Slurm's client tools are not installed")
    notice = make_notice()
    bridge.handle(event(EventType.NOTICE, notice))
    waiting = await until(pending(bridge, notice, "drain"), what="the drain tried again")
    status = bridge.status()
    bridge.handle(event(EventType.CLEARED, notice))
    await bridge.drain_tasks()
    assert status["state"] == "degraded"
    assert "exited with status 1" in status["degraded_reason"]
    assert "unrecognized key: NoSuchKey" in status["actions"][0]["stderr"]
    assert (waiting["target"], waiting["error"]) == ("-", status["degraded_reason"])
    assert bridge.status()["notices"][notice.id]["phase"] == "cleared"
    await bridge.stop(1)


def _missing(tool: str) -> bool:
    import shutil

    return shutil.which(tool) is None


# --- against the real Slurm ----------------------------------------------------------------------------


async def test_node_found_through_hostname(cluster: SlurmCluster) -> None:
    """The node's Slurm name differs from the hostname; the bridge finds it through NodeHostname."""
    bridge = bridge_for(cluster)
    await bridge.start()
    await bridge.drain_tasks()
    assert (bridge.status()["state"], bridge.node) == ("ok", NODE)
    await bridge.stop(1)


@pytest.mark.slow
async def test_notice_drains_then_ready_requeues(cluster: SlurmCluster) -> None:
    """Notice: DRAIN with the agent's reason; ready: the requeueable job is requeued, the other left alone."""
    requeueable = running(cluster, "--requeue")
    pinned = running(cluster, "--no-requeue")
    bridge = bridge_for(cluster, stop_wait_s=0.5)
    notice = await drained_for_a_notice(cluster, bridge)
    await until(lambda: bridge.status()["notices"][notice.id]["phase"] == "waiting", what="waiting for ready")
    assert cluster.job(requeueable)["state"] == "RUNNING"  # nothing moves before the flush
    bridge.handle(event(EventType.READY, notice, {"notice_id": notice.id}))
    await until(lambda: bridge.status()["notices"][notice.id]["phase"] == "done", what="the requeue")
    # A requeued running job passes through COMPLETING (its processes are stopped) on its way to PENDING.
    requeued = await asyncio.to_thread(cluster.wait_job, requeueable, lambda j: j["state"] == "PENDING")
    assert requeued["restart_cnt"] == 1
    assert cluster.job(pinned)["state"] == "RUNNING"
    jobs = {j["job_id"]: j for j in bridge.status()["notices"][notice.id]["jobs"]}
    assert jobs[requeueable]["outcome"] == "requeued"
    assert jobs[pinned]["outcome"] == "left alone: not requeueable (submitted with --no-requeue)"
    assert bridge.status()["notices"][notice.id]["acted_on"] == "ready"
    await bridge.stop(1)


@pytest.mark.slow
async def test_deadline_minus_margin_acts_without_ready(cluster: SlurmCluster) -> None:
    job_id = running(cluster, "--requeue")
    bridge = bridge_for(cluster, margin_s=598.0, stop_wait_s=0.5)
    notice = make_notice(deadline_in=600)
    bridge.handle(event(EventType.NOTICE, notice))
    await until(
        lambda: bridge.status()["notices"][notice.id]["phase"] == "done", what="acting at the deadline"
    )
    assert bridge.status()["notices"][notice.id]["acted_on"] == "deadline"
    requeued = await asyncio.to_thread(cluster.wait_job, job_id, lambda j: j["state"] == "PENDING")
    assert requeued["restart_cnt"] == 1
    await bridge.stop(1)


async def test_cleared_notice_resumes_the_agents_drain(cluster: SlurmCluster) -> None:
    bridge = bridge_for(cluster)
    notice = await drained_for_a_notice(cluster, bridge)
    bridge.handle(event(EventType.CLEARED, notice))
    await bridge.drain_tasks()
    state = cluster.node_state()
    assert not state["states"] & {"DRAIN", "DRAINED", "DRAINING"}
    assert bridge.status()["notices"][notice.id]["drain"] == "resumed"
    await bridge.stop(1)


async def test_administrators_drain_survives_a_cleared_notice(cluster: SlurmCluster) -> None:
    """A node an administrator drained is neither re-drained nor resumed by the agent."""
    cluster.run("scontrol", "update", f"NodeName={NODE}", "State=DRAIN", "Reason=disk replacement")
    bridge = bridge_for(cluster)
    notice = make_notice(deadline_in=600)
    bridge.handle(event(EventType.NOTICE, notice))
    await until(lambda: bridge.status()["notices"][notice.id]["phase"] == "waiting", what="the drain step")
    bridge.handle(event(EventType.CLEARED, notice))
    await bridge.drain_tasks()
    state = cluster.node_state()
    assert (bool(state["states"] & {"DRAIN", "DRAINED"}), state["reason"]) == (True, "disk replacement")
    assert bridge.status()["notices"][notice.id]["drain"].startswith("left alone: already drained by root")
    await bridge.stop(1)


async def test_reason_changed_by_administrator_is_not_resumed(cluster: SlurmCluster) -> None:
    bridge = bridge_for(cluster)
    notice = await drained_for_a_notice(cluster, bridge)
    cluster.run("scontrol", "update", f"NodeName={NODE}", "State=DRAIN", "Reason=keep it down")
    bridge.handle(event(EventType.CLEARED, notice))
    await bridge.drain_tasks()
    assert cluster.node_state()["reason"] == "keep it down"
    assert bridge.status()["notices"][notice.id]["drain"] == "not resumed: the node is now 'keep it down'"
    await bridge.stop(1)


async def test_second_notice_keeps_the_node_drained(cluster: SlurmCluster) -> None:
    """Two notices: clearing the first hands the drain to the second instead of resuming."""
    bridge = bridge_for(cluster)
    first, second = make_notice(deadline_in=600), make_notice(deadline_in=900)
    bridge.handle(event(EventType.NOTICE, first))
    await until(drained_with(cluster, drain_reason(first)), what="the first drain")
    bridge.handle(event(EventType.NOTICE, second))
    await until(lambda: bridge.status()["notices"][second.id]["phase"] == "waiting", what="the second notice")
    bridge.handle(event(EventType.CLEARED, first))
    await until(drained_with(cluster, drain_reason(second)), what="the drain handed over")
    bridge.handle(event(EventType.CLEARED, second))
    await bridge.drain_tasks()
    assert not cluster.node_state()["states"] & {"DRAIN", "DRAINED", "DRAINING"}
    await bridge.stop(1)


@pytest.mark.slow
async def test_signal_reaches_the_job_steps_at_the_notice(cluster: SlurmCluster, tmp_path: Path) -> None:
    """``signal = "USR1"``: the steps get it at the notice, like ``sbatch --signal`` would send it."""
    out = cluster.root / f"signal-{time.monotonic_ns()}.txt"
    ready = cluster.root / f"ready-{time.monotonic_ns()}.txt"
    handler = (
        "import pathlib, signal, sys\n"
        f"out = pathlib.Path({str(out)!r})\n"
        "signal.signal(signal.SIGUSR1, lambda s, f: (out.write_text(signal.Signals(s).name), sys.exit(0)))\n"
        f"pathlib.Path({str(ready)!r}).write_text('ready')\n"
        "while True: signal.pause()\n"
    )
    script_path = cluster.root / f"handler-{time.monotonic_ns()}.py"
    script_path.write_text(handler)
    job_id = running(cluster, "--no-requeue", script=f"srun {sys.executable} {script_path}")
    await until(ready.exists, what="the step's signal handler")
    bridge = bridge_for(cluster, signal="USR1", requeue=False)
    notice = make_notice(deadline_in=600)
    bridge.handle(event(EventType.NOTICE, notice))
    await until(out.exists, what="the signal in the job step")
    assert out.read_text() == "SIGUSR1"
    jobs = bridge.status()["notices"][notice.id]["jobs"]
    assert [(j["job_id"], j["signal"]) for j in jobs] == [(job_id, "USR1")]
    await bridge.stop(1)


async def test_metrics_count_the_calls(cluster: SlurmCluster) -> None:
    bridge = bridge_for(cluster)
    notice = await drained_for_a_notice(cluster, bridge)
    bridge.handle(event(EventType.CLEARED, notice))
    await bridge.drain_tasks()
    samples = {
        (s.labels.get("action"), s.labels.get("outcome")): s.value
        for metric in BridgeCollector("slurm", "Slurm", lambda: bridge).collect()
        for s in metric.samples
        if s.name == "preemptd_slurm_actions_total"
    }
    assert samples == {("drain", "ok"): 1.0, ("resume", "ok"): 1.0}
    await bridge.stop(1)


# --- end to end: the agent, the example under `preemptd exec`, a real Slurm --------------------------------

EXAMPLE = REPO / "examples" / "fault_tolerant_training.py"


def job_events(cluster: SlurmCluster, job_id: int) -> list[dict[str, Any]]:
    """The example's JSON progress lines in the job's output (both runs: the output is appended)."""
    events = []
    for line in cluster.output(job_id).splitlines():
        if line.startswith("{"):
            with contextlib.suppress(ValueError):
                events.append(json.loads(line))
    return events


def has_event(cluster: SlurmCluster, job_id: int, name: str) -> Callable[[], dict[str, Any] | None]:
    def check() -> dict[str, Any] | None:
        return next((e for e in job_events(cluster, job_id) if e.get("event") == name), None)

    return check


async def notice_phase(sock: Path, notice_id: str, phase: str, timeout: float = 60.0) -> dict[str, Any]:
    """What ``/v1/status`` shows of the bridge's work on the notice, once it reached ``phase``."""
    end = time.monotonic() + timeout
    for _ in range(int(timeout / 0.2) + 1):
        _, doc = await http_json(sock, "GET", "/v1/status")
        shown = dict(slurm_status(doc)["notices"][notice_id])
        if shown["phase"] == phase or time.monotonic() > end:
            break
        await asyncio.sleep(0.2)
    assert shown["phase"] == phase, shown
    return shown


@needs_torch
@pytest.mark.slow
@pytest.mark.timeout(240)
async def test_drill_drains_flushes_requeues_and_resumes(cluster: SlurmCluster, base: Path) -> None:
    """sbatch --requeue job under `preemptd exec` → drill → DRAIN with the agent's reason → the job flushes and
    exits 75 → requeued → the drill clears, the node resumes → the job resumes at the next step."""
    sock = base / "a.sock"
    ckpt = cluster.root / f"ckpt-{time.monotonic_ns()}"
    script = (
        f"cd {REPO}\n"
        f"export PYTHONPATH={REPO} PREEMPTD_SOCKET={sock}\n"
        f"exec {sys.executable} -m agent exec -- {sys.executable} {EXAMPLE} --checkpoint-dir {ckpt} "
        f"--steps 100000 --step-time 0.05 --interval-s 0.05 --socket {sock}"
    )
    async with running_agent(base, agent_settings(cluster)):
        job_id = cluster.submit(script, "--requeue", "--open-mode=append")
        await until(has_event(cluster, job_id, "checkpoint"), 90, "a periodic checkpoint (a participant)")
        status, body = await http_json(sock, "POST", "/v1/drills", {"kind": "termination", "in_s": 60})
        assert status == 201, body
        notice_id = body["notice"]["id"]
        await until(
            lambda: (
                (s := cluster.node_state())["reason"].startswith("preemptd: termination drill from drill")
                and notice_id in s["reason"]
                and bool(s["states"] & {"DRAIN", "DRAINING", "DRAINED"})
            ),
            what="the agent's drain",
        )
        preempted = await until(has_event(cluster, job_id, "preempted"), 60, "the flush")
        requeued = await asyncio.to_thread(
            cluster.wait_job, job_id, lambda j: j["state"] == "PENDING" and j["restart_cnt"] == 1, 60.0
        )
        _, doc = await http_json(sock, "GET", "/v1/status")
        (job,) = slurm_status(doc)["notices"][notice_id]["jobs"]
        assert (job["job_id"], job["exit_code"], job["outcome"]) == (job_id, 75, "requeued")
        assert slurm_status(doc)["notices"][notice_id]["acted_on"] == "ready"
        status, _ = await http_json(sock, "DELETE", f"/v1/drills/{notice_id}")
        assert status == 200
        await until(
            lambda: not cluster.node_state()["states"] & {"DRAIN", "DRAINING", "DRAINED"},
            what="the node resumed",
        )
        cluster.run("scontrol", "update", f"JobId={job_id}", "StartTime=now")
        resumed = await until(has_event(cluster, job_id, "resumed"), 90, "the requeued run")
    assert requeued["requeue"] is True
    assert resumed["next_step"] == preempted["step"]


@pytest.mark.slow
async def test_agent_leaves_an_administrators_drain_and_a_pinned_job(
    cluster: SlurmCluster, base: Path
) -> None:
    """Through the agent: a non-requeueable job is left alone and the status says so; the administrator's
    drain (set while the job ran) is still there after the drill clears."""
    job_id = running(cluster, "--no-requeue")
    cluster.run("scontrol", "update", f"NodeName={NODE}", "State=DRAIN", "Reason=bad DIMM")
    sock = base / "a.sock"
    settings = agent_settings(cluster, **{"actions.ready.without_participants": "immediately"})
    async with running_agent(base, settings):
        status, body = await http_json(sock, "POST", "/v1/drills", {"kind": "termination", "in_s": 60})
        assert status == 201, body
        notice_id = body["notice"]["id"]

        await notice_phase(sock, notice_id, "done")
        await http_json(sock, "DELETE", f"/v1/drills/{notice_id}")
        shown = await notice_phase(sock, notice_id, "cleared")
    (job,) = shown["jobs"]
    assert (job["job_id"], job["outcome"]) == (
        job_id,
        "left alone: not requeueable (submitted with --no-requeue)",
    )
    assert shown["drain"] == "left alone: already drained by root: bad DIMM"
    assert cluster.node_state()["reason"] == "bad DIMM"
    assert cluster.job(job_id)["state"] == "RUNNING"


def test_a_bad_slurm_table_is_the_loaders_error(base: Path) -> None:
    """A wrong value in [actions.slurm] is the loader's error: the file, the key and what was expected."""
    with pytest.raises(ConfigError, match=r"preemptd\.toml: key 'actions\.slurm\.margin_s'"):
        tmp_config(base, "[actions.slurm]\nenabled = true\nmargin_s = 'soon'\n")


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("retry_first_s", "0"),
        ("retry_max_s", "1e-9"),
        ("timeout_s", "1e-9"),
        ("retries", "1000000"),
        ("margin_s", "-1"),
        ("stop_wait_s", "1e400"),
        ("history_size", "0"),
    ],
)
def test_a_value_out_of_range_is_refused_by_key(base: Path, key: str, value: str) -> None:
    """``retry_first_s = 0`` or a per-call ``timeout_s`` of 1e-9 would ask a failing controller in a busy
    loop; a negative margin or an endless wait is a mistake: the loader refuses each by key."""
    with pytest.raises(ConfigError, match=rf"actions\.slurm\.{key}"):
        tmp_config(base, f"[actions.slurm]\nenabled = true\n{key} = {value}\n")


def test_an_unknown_signal_in_the_table_names_the_key(base: Path) -> None:
    """Refused when the file is loaded (so --print-config, start-up and a reload refuse it too)."""
    with pytest.raises(ConfigError, match=r"actions\.slurm\.signal: 'USR9' is not a signal"):
        tmp_config(base, "[actions.slurm]\nenabled = true\nsignal = 'USR9'\n")


def tmp_config(base: Path, text: str) -> Any:
    path = base / "preemptd.toml"
    path.write_text(text)
    return load_config(path=path, env={})


async def test_without_slurm_tools_clients_still_get_the_notice(base: Path, tmp_path: Path) -> None:
    """scontrol and friends missing: the bridge is degraded and says why (status, metrics), and the notice
    still reaches the clients on the socket."""
    sock = base / "a.sock"
    settings = {
        "actions.slurm.enabled": True,
        "actions.slurm.drills": True,
        "actions.slurm.bin_dir": str(tmp_path),
    }
    async with running_agent(base, settings):
        events = await SSEClient.connect(sock)
        try:
            status, body = await http_json(sock, "POST", "/v1/drills", {"kind": "termination", "in_s": 60})
            assert status == 201, body
            got = await events.until(lambda e: e["type"] == "notice", timeout=10)
        finally:
            await events.close()
        shown = await notice_phase(sock, body["notice"]["id"], "failed")
        _, doc = await http_json(sock, "GET", "/v1/status")
        metrics = await raw_get(sock, "/metrics")
    assert got["notice"]["id"] == body["notice"]["id"]
    assert shown["drain"] == "failed: node unknown"
    assert f"sinfo not found in {tmp_path}" in slurm_status(doc)["degraded_reason"]
    assert "preemptd_slurm_degraded 1.0" in metrics
    assert 'preemptd_slurm_actions_total{action="drain",outcome="failed"} 1.0' in metrics


async def raw_get(sock: Path, path: str) -> str:
    connector = aiohttp.UnixConnector(path=str(sock))
    async with (
        aiohttp.ClientSession(connector=connector) as session,
        session.get(f"http://localhost{path}") as got,
    ):
        return await got.text()


async def test_a_reload_keeps_the_agents_drain_its_own(cluster: SlurmCluster, base: Path) -> None:
    """SIGHUP between the drain and the clear: the new bridge still resumes the node; metrics count once."""
    settings = agent_settings(cluster)
    agent = Agent(agent_config(base, settings), reload_config=lambda: agent_config(base, settings))
    await agent.start()
    try:
        sock = agent.config.socket
        _, body = await http_json(sock, "POST", "/v1/drills", {"kind": "termination", "in_s": 600})
        notice_id = body["notice"]["id"]
        await notice_phase(sock, notice_id, "waiting")
        settings["actions.slurm.margin_s"] = 10.0
        await agent.reload()
        await http_json(sock, "DELETE", f"/v1/drills/{notice_id}")
        shown = await notice_phase(sock, notice_id, "cleared")
        metrics = await raw_get(sock, "/metrics")
    finally:
        await agent.stop()
    assert shown["drain"] == "resumed"
    assert not cluster.node_state()["states"] & {"DRAIN", "DRAINED", "DRAINING"}
    assert metrics.count('preemptd_slurm_actions_total{action="resume",outcome="ok"} 1.0') == 1


@pytest.mark.slow
async def test_signal_at_ready_waits_for_the_flush(cluster: SlurmCluster) -> None:
    """``signal_at = "ready"``: the steps get the signal with the requeue step, not at the notice."""
    out = cluster.root / f"signal-{time.monotonic_ns()}.txt"
    ready = cluster.root / f"ready-{time.monotonic_ns()}.txt"
    script_path = cluster.root / f"handler-{time.monotonic_ns()}.py"
    script_path.write_text(
        "import pathlib, signal, sys\n"
        f"out = pathlib.Path({str(out)!r})\n"
        "signal.signal(signal.SIGUSR1, lambda s, f: (out.write_text(signal.Signals(s).name), sys.exit(0)))\n"
        f"pathlib.Path({str(ready)!r}).write_text('ready')\n"
        "while True: signal.pause()\n"
    )
    running(cluster, "--no-requeue", script=f"srun {sys.executable} {script_path}")
    await until(ready.exists, what="the step's signal handler")
    bridge = bridge_for(cluster, signal="USR1", signal_at="ready", requeue=False)
    notice = make_notice(deadline_in=600)
    bridge.handle(event(EventType.NOTICE, notice))
    await until(lambda: bridge.status()["notices"][notice.id]["phase"] == "waiting", what="waiting for ready")
    assert not out.exists()
    bridge.handle(event(EventType.READY, notice, {"notice_id": notice.id}))
    await until(out.exists, what="the signal in the job step")
    assert out.read_text() == "SIGUSR1"
    await bridge.stop(1)


# --- drills, controller outages, idempotent requeue --------------------------------------------------------


async def test_drills_are_off_by_default() -> None:
    """A drill does nothing to Slurm unless ``drills = true``: a requeue cannot be undone."""
    bridge = SlurmBridge(SlurmConfig(enabled=True, node=NODE))
    bridge.handle(event(EventType.NOTICE, make_notice(drill=True)))
    shown = bridge.status()["notices"]
    await bridge.stop(1)
    assert (SlurmConfig().drills, shown) == (False, {})


# Short calls and pauses: an outage test retries many times within a minute.
FAST = {"timeout_s": 3.0, "retries": 0, "retry_first_s": 0.2, "retry_max_s": 2.0, "stop_wait_s": 30.0}


def exits_75_on(flag: Path) -> str:
    """A job script that runs until ``flag`` exists and then exits 75, as a job under `preemptd exec` does
    after its flush."""
    return f"while [ ! -e {flag} ]; do sleep 0.2; done\nexit 75"


def pending(bridge: SlurmBridge, notice: Notice, action: str) -> Callable[[], dict[str, Any] | None]:
    """The status entry of ``action`` pending for ``notice`` once it failed at least twice."""

    def check() -> dict[str, Any] | None:
        shown = bridge.status()["notices"][notice.id]["pending"]
        return next((p for p in shown if p["action"] == action and p["attempts"] >= 2), None)

    return check


def job_outcome(bridge: SlurmBridge, notice: Notice, job_id: int) -> Callable[[], str | None]:
    """What the requeue step did to the job, once it is no longer being tried."""

    def check() -> str | None:
        jobs = {j["job_id"]: j for j in bridge.status()["notices"][notice.id]["jobs"]}
        outcome = jobs.get(job_id, {}).get("outcome")
        return None if outcome == "requeue pending" else outcome

    return check


@pytest.mark.slow
async def test_killed_controller_drain_once_it_is_back(cluster: SlurmCluster) -> None:
    """slurmctld SIGKILLed before the notice: the drain is pending (tried again, status says why and when
    next), and lands once the controller is started again on the same state directory and port."""
    cluster.kill_controller(signal.SIGKILL)
    bridge = bridge_for(cluster, node=NODE, **FAST)
    notice = make_notice(deadline_in=600)
    bridge.handle(event(EventType.NOTICE, notice))
    waiting = await until(pending(bridge, notice, "drain"), 60, "the drain tried again")
    await asyncio.to_thread(cluster.start_controller)
    await until(drained_with(cluster, drain_reason(notice)), 60, "the drain after the restart")
    await until(
        lambda: bridge.status()["notices"][notice.id]["phase"] == "waiting", what="the drain step done"
    )
    shown = bridge.status()["notices"][notice.id]
    assert (waiting["target"], "error" in waiting, "next_try" in waiting) == (NODE, True, True)
    assert (shown["drain"], shown["pending"], bridge.counts[("drain", "ok")]) == ("drained", [], 1)
    await bridge.stop(1)


@pytest.mark.slow
async def test_dead_controller_requeue_after_its_restart(cluster: SlurmCluster) -> None:
    """slurmctld stops for good (nothing listens) after the drain; the job exits 75 while it is down; the
    requeue is pending (status says for which job, how often, why) and lands once the controller is started
    again on its state, exactly once."""
    flag = cluster.root / f"flush-{time.monotonic_ns()}"
    job_id = running(cluster, "--requeue", script=exits_75_on(flag))
    bridge = bridge_for(cluster, node=NODE, **{**FAST, "stop_wait_s": 1.0})
    notice = await drained_for_a_notice(cluster, bridge)
    await until(lambda: bridge.status()["notices"][notice.id]["phase"] == "waiting", what="the job listed")
    cluster.kill_controller()
    flag.touch()
    bridge.handle(event(EventType.READY, notice, {"notice_id": notice.id}))
    waiting = await until(pending(bridge, notice, "requeue"), 60, "the requeue tried again")
    shown = dict(bridge.status()["notices"][notice.id]["jobs"][0])
    await asyncio.to_thread(cluster.start_controller)
    assert await until(job_outcome(bridge, notice, job_id), 60, "the requeue") == "requeued"
    # A job the controller still held as running passes through COMPLETING on its way back to the queue.
    job = await asyncio.to_thread(cluster.wait_job, job_id, lambda j: j["state"] == "PENDING")
    assert job["restart_cnt"] == 1
    assert (waiting["target"], "error" in waiting, "next_try" in waiting) == (str(job_id), True, True)
    assert (shown["outcome"], bridge.status()["notices"][notice.id]["pending"]) == ("requeue pending", [])
    assert bridge.counts[("requeue", "ok")] == 1
    await bridge.stop(1)


@pytest.mark.slow
async def test_hung_controller_drain_and_requeue_once_it_answers(cluster: SlurmCluster) -> None:
    """slurmctld stopped (SIGSTOP) at the notice: every call times out; the job exits 75 meanwhile; once the
    controller runs again (SIGCONT) the node is drained and the job requeued exactly once."""
    flag = cluster.root / f"flush-{time.monotonic_ns()}"
    job_id = running(cluster, "--requeue", script=exits_75_on(flag))
    cluster.pause_controller()
    try:
        bridge = bridge_for(cluster, node=NODE, **FAST)
        notice = make_notice(deadline_in=600)
        bridge.handle(event(EventType.NOTICE, notice))
        waiting = await until(pending(bridge, notice, "drain"), 60, "the drain retried")
        flag.touch()
        bridge.handle(event(EventType.READY, notice, {"notice_id": notice.id}))
    finally:
        cluster.continue_controller()
    await until(drained_with(cluster, drain_reason(notice)), what="the drain once the controller answers")
    assert await until(job_outcome(bridge, notice, job_id), 60, "the requeue") == "requeued"
    job = await asyncio.to_thread(cluster.wait_job, job_id, lambda j: j["state"] == "PENDING")
    assert job["restart_cnt"] == 1
    assert "timed out after 3 s" in waiting["error"]
    await bridge.stop(1)


@pytest.mark.slow
async def test_hung_controller_at_the_clear_resume_once_it_answers(cluster: SlurmCluster) -> None:
    """slurmctld hung when the notice clears: the resume is pending, and the node is resumed once the
    controller answers again."""
    bridge = bridge_for(cluster, node=NODE, **FAST)
    notice = await drained_for_a_notice(cluster, bridge)
    await until(lambda: bridge.status()["notices"][notice.id]["phase"] == "waiting", what="the drain step")
    cluster.pause_controller()
    try:
        bridge.handle(event(EventType.CLEARED, notice))
        waiting = await until(pending(bridge, notice, "resume"), 60, "the resume tried again")
    finally:
        cluster.continue_controller()
    await bridge.drain_tasks()
    assert not cluster.node_state()["states"] & {"DRAIN", "DRAINED", "DRAINING"}
    shown = bridge.status()["notices"][notice.id]
    assert (waiting["target"], shown["drain"], shown["pending"]) == (NODE, "resumed", [])
    await bridge.stop(1)


@pytest.mark.slow
async def test_a_job_requeued_already_is_not_requeued_again(cluster: SlurmCluster) -> None:
    """A job the notice found, requeued meanwhile by someone else (``RequeueExit=75``, a requeue that timed
    out here but reached the controller) and running again: its restart count says so; no second requeue."""
    job_id = running(cluster, "--requeue")
    bridge = bridge_for(cluster, stop_wait_s=0.5)
    notice = await drained_for_a_notice(cluster, bridge)
    await until(lambda: bridge.status()["notices"][notice.id]["phase"] == "waiting", what="waiting for ready")
    cluster.run("scontrol", "requeue", str(job_id))
    await asyncio.to_thread(cluster.wait_job, job_id, lambda j: j["state"] == "PENDING")
    cluster.run("scontrol", "update", f"NodeName={NODE}", "State=RESUME")
    cluster.run("scontrol", "update", f"JobId={job_id}", "StartTime=now")
    await asyncio.to_thread(cluster.wait_job, job_id, lambda j: j["state"] == "RUNNING", 60.0)
    bridge.handle(event(EventType.READY, notice, {"notice_id": notice.id}))
    await until(lambda: bridge.status()["notices"][notice.id]["phase"] == "done", what="the requeue step")
    job = cluster.job(job_id)
    assert (job["state"], job["restart_cnt"]) == ("RUNNING", 1)
    assert job_outcome(bridge, notice, job_id)() == "already requeued (restart count 1)"
    await bridge.stop(1)


@pytest.mark.slow
async def test_status_of_a_no_requeue_job_follows_its_exit(cluster: SlurmCluster) -> None:
    """A ``--no-requeue`` job left alone at ready and exiting 75 afterwards: its entry shows the end
    (FAILED, exit 75), not the RUNNING it had when the bridge acted."""
    flag = cluster.root / f"flush-{time.monotonic_ns()}"
    job_id = running(cluster, "--no-requeue", script=exits_75_on(flag))
    bridge = bridge_for(cluster, stop_wait_s=0.5)
    notice = await drained_for_a_notice(cluster, bridge)
    bridge.handle(event(EventType.READY, notice, {"notice_id": notice.id}))
    await until(lambda: bridge.status()["notices"][notice.id]["phase"] == "done", what="the requeue step")
    flag.touch()

    def ended() -> dict[str, Any] | None:
        (job,) = bridge.status()["notices"][notice.id]["jobs"]
        return job if job["state"] != "RUNNING" else None

    job = await until(ended, 60, "the job's end in the status")
    assert (job["job_id"], job["state"], job["exit_code"]) == (job_id, "FAILED", 75)
    assert job["outcome"] == "left alone: not requeueable (submitted with --no-requeue)"
    await bridge.stop(1)


@pytest.mark.slow
async def test_a_job_that_exited_75_is_requeued_after_the_deadline(cluster: SlurmCluster) -> None:
    """The controller is away past the deadline: the drain is given up there, but the job that exited 75
    meanwhile is found and requeued once the controller is back."""
    flag, exited = (cluster.root / f"{name}-{time.monotonic_ns()}" for name in ("flush", "exited"))
    job_id = running(
        cluster, "--requeue", script=f"while [ ! -e {flag} ]; do sleep 0.2; done\ntouch {exited}\nexit 75"
    )
    cluster.kill_controller()
    bridge = bridge_for(cluster, node=NODE, margin_s=1.0, **FAST)
    notice = make_notice(deadline_in=5)
    bridge.handle(event(EventType.NOTICE, notice))
    flag.touch()
    await until(exited.exists, what="the job's exit")
    await until(lambda: bridge.status()["notices"][notice.id]["drain"] == "failed", what="the drain given up")
    await asyncio.to_thread(cluster.start_controller)
    assert await until(job_outcome(bridge, notice, job_id), 60, "the requeue") == "requeued"
    job = cluster.job(job_id)
    assert (job["restart_cnt"], bridge.counts[("requeue", "ok")]) == (1, 1)
    assert bridge.status()["notices"][notice.id]["acted_on"] == "deadline"
    await bridge.stop(1)


async def test_requeue_exit_in_slurm_conf_and_the_agent_requeue_once(cluster: SlurmCluster) -> None:
    """``RequeueExit=75`` in slurm.conf beside the bridge: Slurm requeues the job as it exits 75, and the
    bridge, seeing the raised restart count, does not requeue it again."""
    original = cluster.conf.read_text()
    cluster.conf.write_text(original + "RequeueExit=75\n")
    cluster.run("scontrol", "reconfigure")
    try:
        flag = cluster.root / f"flush-{time.monotonic_ns()}"
        job_id = running(cluster, "--requeue", script=exits_75_on(flag))
        bridge = bridge_for(cluster, stop_wait_s=0.5)
        notice = await drained_for_a_notice(cluster, bridge)
        # The job's flush only once the bridge has listed it: requeued by Slurm, it would be pending on no
        # node, and a listing after that would not find it.
        await until(
            lambda: bridge.status()["notices"][notice.id]["phase"] == "waiting", what="the job listed"
        )
        flag.touch()
        await asyncio.to_thread(cluster.wait_job, job_id, lambda j: j["restart_cnt"] == 1)
        bridge.handle(event(EventType.READY, notice, {"notice_id": notice.id}))
        await until(lambda: bridge.status()["notices"][notice.id]["phase"] == "done", what="the requeue step")
    finally:
        cluster.conf.write_text(original)
        cluster.run("scontrol", "reconfigure")
    assert job_outcome(bridge, notice, job_id)() == "already requeued (restart count 1)"
    assert (cluster.job(job_id)["restart_cnt"], bridge.counts[("requeue", "ok")]) == (1, 0)
    await bridge.stop(1)
