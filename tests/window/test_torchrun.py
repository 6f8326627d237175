"""The window on a real agent with a participant started by the real torchrun: the cloud (the AWS simulator)
gives 120 s, torchrun SIGKILLs its workers 30 s after its SIGTERM, and the worker's checkpoints take 45 s, so
under ``preemptd exec --no-hold`` torchrun's 30 s binds and the window is too short: in status, in the log, in
the metrics and in ``preemptd status``. Under exec's default hold torchrun's 30 s start after the save."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from agent.simulate.aws import AwsSimulator
from agent.window.component import _is_exec, _is_torchrun
from agent.window.effective import window_lines
from tests.cloud_harness import settings_for
from tests.support import REPO, http_json, running_agent
from tests.window.support import window_until

pytestmark = [pytest.mark.slow, pytest.mark.torch_mp, pytest.mark.timeout(120)]

TORCHRUN = Path(sys.executable).parent / "torchrun"
PREEMPTD = Path(sys.executable).parent / "preemptd"

# A worker that registers as a participant and reports a 45 s checkpoint, then waits to be killed.
WORKER = textwrap.dedent(
    """
    import pathlib, sys, time
    from agent.client.reporting import Reporter, client_info
    reporter = Reporter(sys.argv[1], client={**client_info(name="train.py"), "job": "llm"})
    reporter.register()
    reporter.checkpoint("finished", 1, duration_s=45.0)
    assert reporter.flush(10)
    pathlib.Path(sys.argv[2]).write_text("reported")
    time.sleep(300)
    """
)


def test_launchers_are_told_by_their_command_lines() -> None:
    assert _is_torchrun(["/venv/bin/python", "/venv/bin/torchrun", "--nproc-per-node", "8", "train.py"])
    assert _is_torchrun(["torchrun", "train.py"])
    assert _is_torchrun(["python3", "-m", "torch.distributed.run", "train.py"])
    assert not _is_torchrun(["python3", "train.py", "torchrun"])
    assert _is_exec(["/usr/bin/python3", "/usr/bin/preemptd", "exec", "--", "torchrun"])
    assert _is_exec(["python3", "-m", "agent", "exec", "--", "torchrun"])
    assert not _is_exec(["python3", "train.py", "exec"])


async def _window_under_torchrun(base: Path, exec_flags: list[str], until: Any) -> tuple[dict[str, Any], str]:
    """Start the worker as ``preemptd exec FLAGS -- torchrun …`` on a real agent (cloud: the AWS simulator);
    the status once ``until(window)`` holds, and the metrics."""
    script, ready = base / "worker.py", base / "ready"
    script.write_text(WORKER)
    sock = base / "a.sock"
    async with AwsSimulator() as sim, running_agent(base, settings_for("aws", sim.url)):
        launcher = await asyncio.create_subprocess_exec(
            str(PREEMPTD), "exec", *exec_flags, "--",
            str(TORCHRUN), "--standalone", "--nproc-per-node", "1", str(script), str(sock), str(ready),
            env={**os.environ, "PYTHONPATH": str(REPO)},
            cwd=str(base),
            start_new_session=True,
        )  # fmt: skip
        try:
            body = await window_until(sock, until, timeout=90)
            _, metrics = await http_json(sock, "GET", "/metrics")
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(launcher.pid, signal.SIGKILL)
            await asyncio.wait_for(launcher.wait(), 10)
    assert ready.exists()
    return body, str(metrics)


async def test_under_an_exec_that_holds_sigterm_torchrun_does_not_bind_the_save(base: Path) -> None:
    """exec's default hold: torchrun's 30 s start after the save, at the latest 90 s after SIGTERM, so the
    limit is held at 120 s, the cloud's 120 s binds and the 45 s flush fits."""
    if not (TORCHRUN.exists() and PREEMPTD.exists()):
        pytest.skip("torchrun or preemptd is not installed next to this interpreter")

    def torchrun_found(doc: dict[str, Any]) -> bool:
        return any(limit["name"] == "torchrun" for limit in doc["kinds"]["termination"]["limits"])

    body, metrics = await _window_under_torchrun(base, [], torchrun_found)
    termination = body["window"]["kinds"]["termination"]
    [limit] = [limit for limit in termination["limits"] if limit["name"] == "torchrun"]
    assert (120.0, "held", "cloud", True, False) == (
        limit["seconds"],
        limit["state"],
        termination["binding"],
        termination["fits"],
        termination["window_too_short"],
    )
    assert limit["detail"].startswith("held: preemptd exec holds an early SIGTERM")
    assert 'preemptd_window_too_short{kind="termination"} 0.0' in metrics
    assert "[cloud 2m00s, torchrun 2m00s held]" in "\n".join(window_lines(body["window"]))


async def test_a_participant_under_torchrun_binds_the_window_to_30_s(base: Path) -> None:
    if not (TORCHRUN.exists() and PREEMPTD.exists()):
        pytest.skip("torchrun or preemptd is not installed next to this interpreter")
    script, ready = base / "worker.py", base / "ready"
    script.write_text(WORKER)
    sock = base / "a.sock"
    async with AwsSimulator() as sim:
        with capture_logs() as logs:
            async with running_agent(base, settings_for("aws", sim.url)) as agent:
                assert agent.socket_path == sock
                # Under preemptd exec (which the window notices) without its hold: torchrun's 30 s bind.
                launcher = await asyncio.create_subprocess_exec(
                    str(PREEMPTD), "exec", "--no-hold", "--",
                    str(TORCHRUN), "--standalone", "--nproc-per-node", "1", str(script), str(sock), str(ready),
                    env={**os.environ, "PYTHONPATH": str(REPO)},
                    cwd=str(base),
                    start_new_session=True,
                )  # fmt: skip
                try:
                    body = await window_until(
                        sock, lambda doc: doc["kinds"]["termination"]["binding"] == "torchrun", timeout=90
                    )
                    _, metrics = await http_json(sock, "GET", "/metrics")
                finally:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(launcher.pid, signal.SIGKILL)
                    await asyncio.wait_for(launcher.wait(), 10)
    assert ready.exists()
    window = body["window"]
    termination = window["kinds"]["termination"]
    assert (120.0, 30.0, "torchrun", 45.0, False, True) == (
        termination["cloud"]["seconds"],
        termination["effective_s"],
        termination["binding"],
        termination["predicted_flush_s"],
        termination["fits"],
        termination["window_too_short"],
    )
    [limit] = [limit for limit in termination["limits"] if limit["name"] == "torchrun"]
    assert "torchrun (pid " in limit["source"] and ") launches llm/0@" in limit["source"]
    assert "under preemptd exec, with --no-hold" == limit["detail"]
    assert "30 s after its own SIGTERM" in termination["lengthen"]
    assert "drop exec's --no-hold" in termination["lengthen"]
    assert "preemptd exec --" not in termination["lengthen"]  # it already runs under it
    assert "advisory" in window["kinds"]["rebalance"]["cloud"]["source"]
    assert window["window_too_short"]
    [warning] = [e for e in logs if e["event"] == "window_too_short" and e["kind"] == "termination"]
    assert ("torchrun", 30.0, 45.0) == (
        warning["binding"],
        warning["effective_s"],
        warning["predicted_flush_s"],
    )
    assert 'preemptd_window_seconds{kind="termination",limit="torchrun"} 30.0' in metrics
    assert 'preemptd_window_seconds{kind="termination",limit="cloud"} 120.0' in metrics
    assert 'preemptd_window_too_short{kind="termination"} 1.0' in metrics
    assert "preemptd_window_predicted_flush_seconds 45.0" in metrics
    shown = "\n".join(window_lines(body["window"]))
    assert "termination  30s (torchrun binds): TOO SHORT  [cloud 2m00s, torchrun 30s]" in shown
    assert "window_too_short: termination: the flush (45s) outlasts torchrun (30s)" in shown
