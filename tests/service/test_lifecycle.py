"""Start-up, shutdown and restart of the agent: state files, the socket, signals, logs."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from agent.core.errors import AlreadyRunningError
from agent.core.notice import Kind
from agent.service.state_files import STATE_FILE
from tests.support import (
    AgentProcess,
    SSEClient,
    cli,
    eventually,
    http_json,
    hup_and_wait_ready,
    running_agent,
)


async def test_corrupt_state_file_is_moved_aside_and_the_agent_starts_clean(base: Path) -> None:
    state = base / "state"
    state.mkdir()
    (state / STATE_FILE).write_text('{"schema": 1, "seq": 4, "notices": [{"id": ')
    with capture_logs() as logs:
        async with running_agent(base) as agent:
            status, doc = await http_json(agent.config.socket, "GET", "/v1/status")
    aside = list(state.glob("state.json.corrupt-*"))
    assert (200, [], 1) == (status, doc["notices"], len(aside))
    assert ["state_file_corrupt"] == [e["event"] for e in logs if e["event"] == "state_file_corrupt"]


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"\x00\xff\xfe",
        b"[]",
        b'{"schema": 99}',
        b'{"schema": 1, "seq": "x"}',
        b'{"schema": 1, "notices": [{"id": "a"}]}',
    ],
)
async def test_unreadable_state_variants_never_stop_start_up(base: Path, content: bytes) -> None:
    state = base / "state"
    state.mkdir()
    (state / STATE_FILE).write_bytes(content)
    async with running_agent(base) as agent:
        assert (True, 0) == (agent.keeper.ok, len(agent.board))


async def test_missing_state_directory_is_created(base: Path) -> None:
    async with running_agent(base, {"state_dir": str(base / "deep" / "er")}) as agent:
        assert agent.keeper.ok
    assert (base / "deep" / "er" / STATE_FILE).exists()


async def test_unusable_state_directory_leaves_the_agent_serving_without_persistence(base: Path) -> None:
    (base / "file").write_text("not a directory")
    with capture_logs() as logs:
        async with running_agent(base, {"state_dir": str(base / "file" / "state")}) as agent:
            agent.drills.drill(Kind.TERMINATION, 60, None, "still works", {})
            status, doc = await http_json(agent.config.socket, "GET", "/v1/status")
    assert (200, False, 1, "warning") == (
        status,
        doc["state"]["ok"],
        len(doc["notices"]),
        "warning" if doc["overall"] != "ok" else "ok",
    )
    assert "cannot create state directory" in doc["state"]["error"]
    assert "state_dir_unusable" in [e["event"] for e in logs]


async def test_a_second_agent_on_the_same_socket_refuses_to_start(base: Path) -> None:
    async with running_agent(base) as first:
        first.drills.drill(Kind.TERMINATION, 60, None, "first", {})
        await first.keeper.flush()
        before = (base / "state" / STATE_FILE).read_bytes()
        with pytest.raises(AlreadyRunningError, match="another preemptd"):
            async with running_agent(base):
                pass
        assert before == (base / "state" / STATE_FILE).read_bytes()
        status, _ = await http_json(first.config.socket, "GET", "/v1/status")
        assert 200 == status


async def test_stale_socket_from_a_crashed_run_is_replaced(base: Path) -> None:
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(base / "a.sock"))
    stale.close()  # the file stays, nobody listens: what a crash leaves behind
    with capture_logs() as logs:
        async with running_agent(base) as agent:
            status, _ = await http_json(agent.config.socket, "GET", "/v1/status")
    assert 200 == status
    assert "stale_socket_replaced" in [e["event"] for e in logs]


async def test_socket_file_is_removed_on_clean_stop_and_has_mode_0660(base: Path) -> None:
    async with running_agent(base) as agent:
        mode = os.stat(agent.config.socket).st_mode & 0o777
    assert (0o660, False) == (mode, (base / "a.sock").exists())


@pytest.mark.slow
async def test_agent_restarted_after_sigterm_mid_notice_announces_the_same_notice(base: Path) -> None:
    first = AgentProcess(base)
    await first.start()
    _, created = await http_json(first.socket_path, "POST", "/v1/drills", {"in_s": 600})
    code = await first.stop(signal.SIGTERM)
    assert "STOPPING=1" in "\n".join(first.notifications)
    second = AgentProcess(base)
    await second.start()
    try:
        client = await SSEClient.connect(second.socket_path)
        snapshot = await client.next()
        await client.close()
    finally:
        await second.stop()
    (notice,) = snapshot["notices"]
    assert (0, created["notice"]["id"], created["notice"]["deadline"]) == (
        code,
        notice["id"],
        notice["deadline"],
    )


@pytest.mark.slow
async def test_agent_killed_mid_notice_announces_it_again_and_records_the_unclean_stop(base: Path) -> None:
    first = AgentProcess(base)
    await first.start()
    _, created = await http_json(first.socket_path, "POST", "/v1/drills", {"in_s": 600})
    state_file = base / "state" / STATE_FILE
    await eventually(lambda: created["notice"]["id"] in state_file.read_text(), what="notice persisted")
    await first.stop(signal.SIGKILL)
    second = AgentProcess(base)
    await second.start()
    try:
        _, doc = await http_json(second.socket_path, "GET", "/v1/status")
    finally:
        await second.stop()
    starts = [json.loads(line) for line in (base / "state" / "history.jsonl").read_text().splitlines()]
    starts = [r for r in starts if r["type"] == "agent_start"]
    assert [created["notice"]["id"]] == [n["id"] for n in doc["notices"]]
    assert [None, False] == [r["previous_clean"] for r in starts]


@pytest.mark.slow
async def test_logs_carry_the_journald_priority_prefix_when_stdout_is_the_journal(base: Path) -> None:
    log = base / "agent.log"
    log.touch()
    st = os.stat(log)
    proc = AgentProcess(
        base, extra_args=["--log-format", "auto"], env={"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"}
    )
    await proc.start()
    await http_json(proc.socket_path, "POST", "/v1/drills", {"in_s": 60})
    await proc.stop()
    lines = proc.logs_text().splitlines()
    raised = [line for line in lines if '"notice_raised"' in line]
    assert lines and all(line.startswith("<") for line in lines)
    assert raised[0].startswith("<4>{")  # a critical notice is logged as a warning
    assert "agent_started" in [json.loads(line[3:])["event"] for line in lines]


@pytest.mark.slow
async def test_logs_are_one_json_object_per_line_when_not_on_a_terminal(base: Path) -> None:
    proc = AgentProcess(base)
    await proc.start()
    await http_json(proc.socket_path, "POST", "/v1/reports", raw=b"nonsense")
    await proc.stop()
    events = [r["event"] for r in proc.logs()]
    assert len(events) == len(proc.logs_text().splitlines())
    assert {"agent_started", "report_rejected", "agent_stopping", "agent_stopped"} <= set(events)


@pytest.mark.slow
async def test_second_agent_process_exits_with_a_clear_error(base: Path) -> None:
    first = AgentProcess(base)
    await first.start()
    second = AgentProcess(base)
    second.log_path = base / "second.log"
    await second.start(wait_ready=False)
    assert second.proc is not None
    code = await asyncio.wait_for(second.proc.wait(), 20)
    await second.stop()
    await first.stop()
    assert 3 == code
    assert "already_running" in [r["event"] for r in second.logs()]


@pytest.mark.slow
async def test_signals_during_shutdown_do_not_cut_the_final_state_save(base: Path) -> None:
    proc = AgentProcess(base)
    await proc.start()
    _, created = await http_json(proc.socket_path, "POST", "/v1/drills", {"in_s": 600})
    assert proc.proc is not None
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGTERM, signal.SIGINT):
        proc.proc.send_signal(sig)
    code = await proc.stop()
    state = json.loads((base / "state" / STATE_FILE).read_text())
    assert (0, True, [created["notice"]["id"]]) == (
        code,
        state["clean_shutdown"],
        [n["id"] for n in state["notices"]],
    )


async def test_a_fifo_in_place_of_the_config_file_on_reload_is_refused_and_the_agent_keeps_serving(
    base: Path,
) -> None:
    """SIGHUP with the config path replaced by a FIFO: the reload fails at once with a clear error, the
    running configuration stays (still logging at info) and status answers (the loop never blocked)."""
    config = base / "config.toml"
    config.write_text('log_level = "info"\n')
    proc = AgentProcess(base, extra_args=["--config", str(config)])
    await proc.start()
    try:
        config.unlink()
        os.mkfifo(config)
        await hup_and_wait_ready(proc)
        status, _ = await http_json(proc.socket_path, "GET", "/v1/status")
        _, drill = await http_json(proc.socket_path, "POST", "/v1/drills", {"in_s": 30})
    finally:
        assert 0 == await proc.stop()
    failed = [r["error"] for r in proc.logs() if r.get("event") == "reload_failed"]
    assert (200, [f"{config}: is a FIFO, not a regular file; point the configuration at a TOML file"]) == (
        status,
        failed,
    )
    assert drill["notice"]["id"] in [
        r.get("notice_id") for r in proc.logs() if r.get("event") == "drill_injected"
    ]


async def test_run_with_a_fifo_as_the_config_file_exits_2_with_a_clear_error(base: Path) -> None:
    """``preemptd run --config FIFO`` refuses at start instead of blocking on the read."""
    fifo = base / "config.toml"
    os.mkfifo(fifo)
    code, _, err = await cli("run", "--config", str(fifo), "--socket", str(base / "a.sock"))
    assert (2, f"preemptd: configuration error: {fifo}: is a FIFO, not a regular file") == (
        code,
        err.split(";")[0],
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (
            ["api=5", "api.heartbeat_s=1"],
            "command line: key 'api' is set to 5 and 'api.heartbeat_s' sets a key inside it",
        ),
        (
            ["api.backlog=1099511627776"],
            "command line: key 'api.backlog': expected an integer >= 1 and <= 65535",
        ),
        (
            ["host.poll_interval_s=1e-9"],
            "command line: key 'host.poll_interval_s': expected a finite number of",
        ),
    ],
)
async def test_run_with_bad_settings_exits_2_with_the_error_and_no_traceback(
    settings: list[str], message: str
) -> None:
    args = [arg for setting in settings for arg in ("--set", setting)]
    code, out, err = await cli("run", *args, "--print-config")
    expected = f"preemptd: configuration error: {message}"
    assert (2, "", expected, False) == (code, out, err[: len(expected)], "Traceback" in err)
