"""The agent as systemd runs it: socket activation (through the real ``systemd-socket-activate``), sd_notify
readiness, stopping and watchdog pings on a ``NOTIFY_SOCKET`` listener, and SIGHUP reloads."""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import signal
from pathlib import Path

import pytest

from tests.support import AgentProcess, SSEClient, http_json, hup_and_wait_ready

SOCKET_ACTIVATE = shutil.which("systemd-socket-activate") or (
    "/usr/bin/systemd-socket-activate" if os.access("/usr/bin/systemd-socket-activate", os.X_OK) else None
)


def socket_activated(base: Path) -> AgentProcess:
    """The agent behind ``systemd-socket-activate``: it listens on the socket and execs the agent on the
    first connection, handing the listening socket over as fd 3 (``LISTEN_FDS=1``, ``LISTEN_PID``)."""
    if SOCKET_ACTIVATE is None:
        pytest.skip("systemd-socket-activate is not installed (Debian/Ubuntu: apt-get install systemd)")
    launcher = [SOCKET_ACTIVATE, "--listen", str(base / "a.sock")]
    # It passes on only TERM, PATH, USER and HOME, and what -E names.
    for name in ("PYTHONPATH", "NOTIFY_SOCKET"):
        launcher += ["--setenv", name]
    return AgentProcess(base, wrapper=launcher)


@pytest.mark.service
async def test_socket_activated_agent_serves_status_on_the_inherited_socket(base: Path) -> None:
    proc = socket_activated(base)
    await proc.start(wait_ready=False)
    try:
        await proc.wrapper_line("Listening on")
        status, body = await http_json(proc.socket_path, "GET", "/v1/status")  # this connection starts it
        assert (200, True, str(proc.socket_path)) == (
            status,
            body["agent"]["socket_activated"],
            body["agent"]["socket"],
        )
        assert proc.proc is not None
        assert proc.proc.pid == body["agent"]["pid"]  # exec'd in place: LISTEN_PID is the agent's pid
    finally:
        assert 0 == await proc.stop()


@pytest.mark.service
async def test_socket_activated_agent_delivers_a_drill_to_a_stream_client(base: Path) -> None:
    proc = socket_activated(base)
    await proc.start(wait_ready=False)
    try:
        await proc.wrapper_line("Listening on")
        client = await SSEClient.connect(proc.socket_path)
        try:
            assert "snapshot" == (await client.next())["type"]
            status, body = await http_json(proc.socket_path, "POST", "/v1/drills", {"in_s": 30})
            assert 201 == status
            event = await client.next()
            assert ("notice", body["notice"]["id"], True) == (
                event["type"],
                event["notice"]["id"],
                event["notice"]["drill"],
            )
        finally:
            await client.close()
    finally:
        assert 0 == await proc.stop()


async def test_ready_is_sent_once_the_socket_answers(base: Path) -> None:
    proc = AgentProcess(base)
    await proc.start(wait_ready=False)
    try:
        message = await proc.wait_notification("READY=1")
        # No retry: at READY=1 the socket is bound and served.
        status, body = await http_json(proc.socket_path, "GET", "/v1/status")
        assert (200, f"MAINPID={body['agent']['pid']}") == (status, message.split("\n")[1])
    finally:
        assert 0 == await proc.stop()


async def test_ready_reaches_an_abstract_notify_socket(base: Path) -> None:
    proc = AgentProcess(base, notify_socket=f"@preemptd-test-{secrets.token_hex(6)}")
    await proc.start(wait_ready=False)
    try:
        await proc.wait_notification("READY=1")
        status, _ = await http_json(proc.socket_path, "GET", "/v1/status")
        assert 200 == status
    finally:
        assert 0 == await proc.stop()


async def test_sigterm_sends_stopping_then_the_agent_exits_cleanly(base: Path) -> None:
    proc = AgentProcess(base)
    await proc.start()
    assert proc.proc is not None
    proc.proc.send_signal(signal.SIGTERM)
    await proc.wait_notification("STOPPING=1", after=len(proc.notifications))
    # Wait for the exit rather than proc.stop(): that would send a second SIGTERM.
    assert 0 == await asyncio.wait_for(proc.proc.wait(), 20)
    await proc.stop()


async def test_watchdog_pings_arrive_when_watchdog_usec_is_set(base: Path) -> None:
    proc = AgentProcess(base, env={"WATCHDOG_USEC": "200000"})  # 0.2 s: a ping every 0.1 s
    await proc.start()
    try:
        for _ in range(3):
            await proc.wait_notification("WATCHDOG=1", timeout=5, after=len(proc.notifications))
    finally:
        assert 0 == await proc.stop()


async def test_sighup_reloads_the_config_file(base: Path) -> None:
    config = base / "config.toml"
    config.write_text('log_level = "warning"\n')
    proc = AgentProcess(base, extra_args=["--config", str(config)])
    await proc.start()
    try:
        _, before = await http_json(proc.socket_path, "POST", "/v1/drills", {"in_s": 30})
        config.write_text('log_level = "info"\n')
        await hup_and_wait_ready(proc)
        _, after = await http_json(proc.socket_path, "POST", "/v1/drills", {"in_s": 30})
    finally:
        assert 0 == await proc.stop()
    drills_logged = [r["notice_id"] for r in proc.logs() if r.get("event") == "drill_injected"]
    # drill_injected is an info line: only the drill after the reload is logged.
    assert (False, True) == (before["notice"]["id"] in drills_logged, after["notice"]["id"] in drills_logged)
    assert 1 == sum(r.get("event") == "config_reloaded" for r in proc.logs())


async def test_broken_config_on_reload_is_logged_and_the_agent_keeps_running(base: Path) -> None:
    config = base / "config.toml"
    config.write_text('log_level = "info"\n')
    proc = AgentProcess(base, extra_args=["--config", str(config)])
    await proc.start()
    try:
        config.write_text("log_level = 5\n[api\n")
        await hup_and_wait_ready(proc)
        status, body = await http_json(proc.socket_path, "POST", "/v1/drills", {"in_s": 30})
        assert 201 == status
    finally:
        assert 0 == await proc.stop()
    failed = [r for r in proc.logs() if r.get("event") == "reload_failed"]
    assert 1 == len(failed)
    assert str(config) in failed[0]["error"]
    # The running configuration stayed: still logging at info.
    assert body["notice"]["id"] in [
        r.get("notice_id") for r in proc.logs() if r.get("event") == "drill_injected"
    ]
