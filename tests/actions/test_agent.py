"""Actions inside the real agent: drills over the Unix socket reach unmodified programs, hooks and ready."""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
import uuid
from pathlib import Path

import psutil
import pytest

from agent.actions import ActionsComponent
from agent.core.errors import ConfigError
from agent.service.daemon import Agent
from tests.actions_support import HANDLER, Child
from tests.support import SSEClient, agent_config, http_json, running_agent


def actions_of(agent: object) -> ActionsComponent:
    [component] = [c for c in agent.components if isinstance(c, ActionsComponent)]  # type: ignore[attr-defined]
    return component


async def drained(agent: object, reactor: str) -> None:
    """Wait until what ``reactor`` started so far has finished; unlike the component's drain, this leaves
    the ready step waiting (up to the drill's deadline) for participants."""
    await actions_of(agent).reactors.by_name()[reactor].drain()  # type: ignore[attr-defined]


async def test_a_program_that_never_heard_of_preemptd_gets_its_signal_on_a_drill(base: Path) -> None:
    marker = f"train-{uuid.uuid4().hex}"
    child = await Child.start(HANDLER, str(base / "got"), marker)
    settings = {"actions.signals": [{"name": "train", "signal": "SIGUSR1", "cmdline": [marker]}]}
    try:
        async with running_agent(base, settings) as agent:
            status, _ = await http_json(
                agent.config.socket, "POST", "/v1/drills", {"kind": "termination", "in_s": 60}
            )
            assert 201 == status
            assert 0 == await child.wait()
            assert "SIGUSR1" == (base / "got").read_text()
            await drained(agent, "signals")
            _, shown = await http_json(agent.config.socket, "GET", "/v1/status")
            [sent] = shown["actions"]["signals"]
            assert ("sent", child.pid, "SIGUSR1", "train") == (
                sent["outcome"],
                sent["pid"],
                sent["signal"],
                sent["rule"],
            )
    finally:
        await child.stop()


@pytest.mark.slow
async def test_a_hanging_hook_does_not_delay_the_notice_to_clients(base: Path) -> None:
    pid_file = base / "hook.pid"
    hang = [
        sys.executable,
        "-c",
        f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(600)",
    ]
    settings = {"actions.hooks": [{"name": "hang", "argv": hang, "timeout_s": 300}]}
    async with running_agent(base, settings) as agent:
        client = await SSEClient.connect(agent.config.socket)
        try:
            await client.next()  # snapshot
            for _ in range(2):  # the second notice comes while the first hook still hangs
                status, body = await http_json(
                    agent.config.socket, "POST", "/v1/drills", {"kind": "termination", "in_s": 60}
                )
                assert 201 == status
                got = await client.until(lambda e: e["type"] == "notice", timeout=5)
                assert body["notice"]["id"] == got["notice"]["id"]
            assert 2 <= actions_of(agent).reactors.running()
        finally:
            await client.close()
    # Stopping the agent kills the hanging hook instead of waiting for it.
    hook_pid = int(pid_file.read_text())
    assert not psutil.pid_exists(hook_pid) or psutil.Process(hook_pid).status() == psutil.STATUS_ZOMBIE


async def test_ready_follows_the_participants_emergency_checkpoint(base: Path) -> None:
    client_doc = {"job": "llm", "rank": 0, "participant": True}
    async with running_agent(base) as agent:
        sock = agent.config.socket
        status, _ = await http_json(
            sock, "POST", "/v1/reports", {"kind": "checkpoint", "phase": "started", "client": client_doc}
        )
        assert status < 300
        events = await SSEClient.connect(sock)
        try:
            await events.next()
            _, body = await http_json(sock, "POST", "/v1/drills", {"kind": "termination", "in_s": 120})
            notice_id = body["notice"]["id"]
            finished = {
                "kind": "checkpoint",
                "phase": "finished",
                "duration_s": 2.5,
                "emergency": True,
                "notice_id": notice_id,
                "client": client_doc,
            }
            status, _ = await http_json(sock, "POST", "/v1/reports", finished)
            assert status < 300
            ready = await events.until(lambda e: e["type"] == "ready", timeout=5)
            assert (notice_id, "all_participants", ["llm#0"]) == (
                ready["data"]["notice_id"],
                ready["data"]["reason"],
                ready["data"]["finished"],
            )
            _, shown = await http_json(sock, "GET", "/v1/status")
            tracked = shown["actions"]["ready"]["notices"][notice_id]
            assert "ready" == tracked["state"]
            assert 100 < tracked["margin_s"] <= 120
        finally:
            await events.close()


async def test_metrics_count_actions(base: Path) -> None:
    settings = {"actions.hooks": [{"argv": ["true"]}]}
    async with running_agent(base, settings) as agent:
        await http_json(agent.config.socket, "POST", "/v1/drills", {"kind": "termination", "in_s": 60})
        await drained(agent, "hooks")
        _, text = await http_json(agent.config.socket, "GET", "/metrics")
    assert 'preemptd_actions_total{action="hook",outcome="ok"} 1.0' in text


def test_a_bad_signal_rule_fails_when_the_configuration_is_loaded(base: Path) -> None:
    with pytest.raises(
        ConfigError, match=r"actions.signals \(rule 'signal'\) signal: unknown signal 'SIGNOPE'"
    ):
        agent_config(base, {"actions.signals": [{"signal": "SIGNOPE", "cmdline": ["x"]}]})


async def test_dry_run_in_the_agent_signals_nobody(base: Path) -> None:
    marker = f"train-{uuid.uuid4().hex}"
    child = await Child.start(HANDLER, str(base / "got"), marker)
    try:
        settings = {"actions.dry_run": True, "actions.signals": [{"cmdline": [marker]}]}
        async with running_agent(base, settings) as agent:
            await http_json(agent.config.socket, "POST", "/v1/drills", {"kind": "termination", "in_s": 60})
            await drained(agent, "signals")
            _, shown = await http_json(agent.config.socket, "GET", "/v1/status")
        assert ["dry_run"] == [s["outcome"] for s in shown["actions"]["signals"]]
        await asyncio.sleep(0)
        assert child.proc.returncode is None
    finally:
        await child.stop()


async def test_a_reload_applies_new_signal_rules(base: Path) -> None:
    marker = f"train-{uuid.uuid4().hex}"
    child = await Child.start(HANDLER, str(base / "got"), marker)
    settings: dict[str, object] = {}
    agent = Agent(agent_config(base), reload_config=lambda: agent_config(base, settings))
    await agent.start()
    try:
        settings["actions.signals"] = [{"name": "added", "cmdline": [marker]}]
        await agent.reload()
        await http_json(agent.config.socket, "POST", "/v1/drills", {"kind": "termination", "in_s": 60})
        assert 0 == await child.wait()
    finally:
        await agent.stop()
        await child.stop()


async def test_an_invalid_reload_keeps_the_running_actions(base: Path) -> None:
    marker = f"train-{uuid.uuid4().hex}"
    child = await Child.start(HANDLER, str(base / "got"), marker)
    rule = {"name": "kept", "cmdline": [marker]}
    settings: dict[str, object] = {"actions.signals": [rule]}
    agent = Agent(agent_config(base, settings), reload_config=lambda: agent_config(base, settings))
    await agent.start()
    try:
        settings["actions.signals"] = [rule, {"signal": "SIGNOPE", "cmdline": ["x"]}]
        await agent.reload()
        await http_json(agent.config.socket, "POST", "/v1/drills", {"kind": "termination", "in_s": 60})
        assert 0 == await child.wait()
    finally:
        await agent.stop()
        await child.stop()


async def test_on_ready_hooks_run_when_the_notice_becomes_ready(base: Path) -> None:
    out = base / "ready.env"
    script = f"import os; open({str(out)!r}, 'w').write(os.environ['PREEMPTD_EVENT'] + ' ' + os.environ['PREEMPTD_NOTICE_ID'])"
    settings = {
        "actions.ready.without_participants": "immediately",
        "actions.hooks": [{"name": "on-ready", "argv": [sys.executable, "-c", script], "on": ["ready"]}],
    }
    async with running_agent(base, settings) as agent:
        events = await SSEClient.connect(agent.config.socket)
        try:
            _, body = await http_json(
                agent.config.socket, "POST", "/v1/drills", {"kind": "termination", "in_s": 60}
            )
            await events.until(lambda e: e["type"] == "ready")
        finally:
            await events.close()
        await actions_of(agent).drain()
    assert f"ready {body['notice']['id']}" == out.read_text()


async def test_a_program_in_a_systemd_units_cgroup_gets_its_signal_on_a_drill(base: Path) -> None:
    """The unit target end to end, on a real cgroup v2 hierarchy: without systemd to ask (as here), the
    agent finds the unit's cgroup at system.slice/<unit>."""
    root = next(
        (
            r
            for r in (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified"))
            if (r / "cgroup.controllers").exists()
        ),
        None,
    )
    if root is None or not os.access(root, os.W_OK) or (shutil.which("systemctl") and _systemd_running()):
        pytest.skip("needs a writable cgroup v2 hierarchy and no running systemd")
    unit = f"preemptd-test-{uuid.uuid4().hex[:8]}.service"
    made_slice = not (root / "system.slice").exists()
    group = root / "system.slice" / unit
    try:
        group.mkdir(parents=True)
    except OSError as exc:
        pytest.skip(f"cannot create a cgroup: {exc}")
    child = await Child.start(HANDLER, str(base / "got"))
    try:
        try:
            (group / "cgroup.procs").write_text(str(child.pid))
        except OSError as exc:
            pytest.skip(f"cannot move a process into a cgroup: {exc}")
        async with running_agent(base, {"actions.signals": [{"name": "unit", "units": [unit]}]}) as agent:
            await http_json(agent.config.socket, "POST", "/v1/drills", {"kind": "termination", "in_s": 60})
            assert 0 == await child.wait()
        assert "SIGTERM" == (base / "got").read_text()
    finally:
        await child.stop()
        group.rmdir()
        if made_slice:
            (root / "system.slice").rmdir()


def _systemd_running() -> bool:
    return Path("/run/systemd/system").is_dir()
