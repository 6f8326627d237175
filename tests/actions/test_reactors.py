"""The reactor seam: a throwaway reactor added from outside the project (an installed entry point, or the
public registry) sees the agent's events, shows in its status, reads its own config table with the loader's
errors, and is stopped within its bound. Nothing in agent/ is edited for it."""

from __future__ import annotations

import importlib
import json
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.actions import registry as reactors
from agent.config import load_config
from agent.core.errors import ConfigError
from agent.core.notice import EventType
from agent.core.plugins import Part
from agent.service.daemon import Agent
from tests.support import REPO, AgentProcess, SSEClient, agent_config, eventually, http_json, running_agent

# The plug-in, as a third party would write it: it imports nothing from the agent (it gets the host).
PLUGIN = '''
"""A throwaway reactor: records what it sees, owns a task per event, writes its state to a file."""
import asyncio
import json
import pathlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Settings:
    out: str = ""
    limit: int = 100
    hang_on_stop: bool = False


class Throwaway:
    name = "throwaway"

    def __init__(self, settings):
        self.settings = settings
        self.seen = []
        self.tasks = set()
        self.stopped = None

    def handle(self, event):
        self.seen.append(event.type.value)
        # Owned work that never ends by itself: only stop() ends it.
        self.tasks.add(asyncio.get_running_loop().create_task(asyncio.sleep(3600)))
        self._write()

    def status(self):
        return {"seen": list(self.seen), "running": sum(not t.done() for t in self.tasks)}

    async def start(self):
        self._write()

    async def stop(self, timeout):
        for task in self.tasks:
            task.cancel()
        if self.tasks:
            await asyncio.wait(self.tasks, timeout=timeout)
        if self.settings.hang_on_stop:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                self.stopped = "cancelled"
                self._write()
                raise
        self.stopped = "stopped"
        self._write()

    def _write(self):
        if self.settings.out:
            doc = {"seen": self.seen, "stopped": self.stopped, "cancelled": sum(t.cancelled() for t in self.tasks)}
            pathlib.Path(self.settings.out).write_text(json.dumps(doc))


def build_reactor(host):
    if not host.config.has_table("actions.throwaway"):
        return None
    return Throwaway(host.config.table("actions.throwaway", Settings))
'''


def write_plugin(directory: Path, entry_point: bool) -> str:
    """The plug-in module (and, for ``entry_point``, an installed distribution that declares it in the
    ``preemptd.reactors`` group) under ``directory``; returns the module name."""
    module = f"throwaway_{uuid.uuid4().hex[:10]}"
    (directory / f"{module}.py").write_text(PLUGIN)
    if entry_point:
        info = directory / f"{module}-0.1.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module}\nVersion: 0.1\n")
        (info / "entry_points.txt").write_text(
            f"[{reactors.ENTRY_POINT_GROUP}]\nthrowaway = {module}:build_reactor\n"
        )
    return module


@pytest.fixture
def plugin_dir(tmp_path: Path) -> Path:
    path = tmp_path / "site"
    path.mkdir()
    return path


@pytest.fixture
def registered(plugin_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The plug-in registered through agent.actions.registry.REACTORS for the test; yields its module."""
    module = write_plugin(plugin_dir, entry_point=False)
    monkeypatch.syspath_prepend(str(plugin_dir))
    loaded = importlib.import_module(module)
    try:
        with reactors.REACTORS.registered(Part("throwaway", loaded.build_reactor)):
            yield loaded
    finally:
        sys.modules.pop(module, None)


def read_state(path: Path) -> dict[str, Any]:
    try:
        doc: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return doc


@pytest.mark.slow
async def test_an_installed_entry_point_reactor_sees_events_shows_status_and_stops(
    base: Path, plugin_dir: Path
) -> None:
    write_plugin(plugin_dir, entry_point=True)
    out = base / "throwaway.json"
    proc = AgentProcess(
        base,
        extra_args=["--set", f"actions.throwaway.out={json.dumps(str(out))}"],
        env={"PYTHONPATH": f"{REPO}:{plugin_dir}"},
    )
    await proc.start()
    try:
        status, _ = await http_json(
            proc.socket_path, "POST", "/v1/drills", {"kind": "termination", "in_s": 60}
        )
        assert 201 == status
        await eventually(
            lambda: "notice" in read_state(out).get("seen", []), what="the reactor saw the notice"
        )
        _, shown = await http_json(proc.socket_path, "GET", "/v1/status")
        mine = shown["actions"]["reactors"]["throwaway"]
        assert ["notice"] == mine["seen"][:1]
        assert 1 <= mine["running"]
        # The built-in actions are reactors in the same list.
        assert {"signals", "ready", "azure_acknowledgement", "hooks", "webhooks"} <= set(
            shown["actions"]["reactors"]
        )
    finally:
        assert 0 == await proc.stop()
    final = read_state(out)
    assert "stopped" == final["stopped"]
    assert final["cancelled"] >= 1  # its owned work was ended by its stop


@pytest.mark.slow
async def test_a_registered_reactor_gets_events_after_the_clients_and_a_hung_stop_is_cut_short(
    base: Path, registered: Any
) -> None:
    async with running_agent(base, {"actions.throwaway.hang_on_stop": True}) as agent:
        [reactor] = [r for r in agent.components[0].reactors if r.name == "throwaway"]  # type: ignore[attr-defined]
        client = await SSEClient.connect(agent.config.socket)
        try:
            await client.next()  # snapshot
            status, body = await http_json(
                agent.config.socket, "POST", "/v1/drills", {"kind": "termination", "in_s": 60}
            )
            assert 201 == status
            got = await client.until(lambda e: e["type"] == "notice")
            assert body["notice"]["id"] == got["notice"]["id"]
            assert "notice" in reactor.seen
            _, shown = await http_json(agent.config.socket, "GET", "/v1/status")
            assert shown["actions"]["reactors"]["throwaway"]["seen"][0] == "notice"
        finally:
            await client.close()
    # The agent's stop returned although the reactor's stop never would: the runner cancelled it.
    assert "cancelled" == reactor.stopped
    assert all(task.done() for task in reactor.tasks)


async def test_the_reactor_reads_its_table_with_the_loaders_errors(tmp_path: Path, registered: Any) -> None:
    path = tmp_path / "config.toml"
    path.write_text('[actions.throwaway]\nlimit = "many"\n')
    config = load_config(path, env={})  # the loader itself does not know the table
    with pytest.raises(ConfigError) as bad_type:
        config.table("actions.throwaway", registered.Settings)
    assert f"{path}: key 'actions.throwaway.limit': expected an integer, got 'many'" == str(bad_type.value)

    path.write_text("[actions.throwaway]\nlimt = 5\n")
    with pytest.raises(ConfigError) as unknown:
        load_config(path, env={}).table("actions.throwaway", registered.Settings)
    assert "unknown key 'actions.throwaway.limt' (did you mean 'actions.throwaway.limit'?)" in str(
        unknown.value
    )

    env_config = load_config(path=None, env={"PREEMPTD_ACTIONS__THROWAWAY__LIMIT": "x"})
    with pytest.raises(ConfigError, match=r"^environment: key 'actions\.throwaway\.limit'"):
        env_config.table("actions.throwaway", registered.Settings)


async def test_a_bad_table_stops_the_agent_before_it_serves(base: Path, registered: Any) -> None:
    agent = Agent(agent_config(base, {"actions.throwaway.limit": "many"}))
    try:
        with pytest.raises(ConfigError, match=r"key 'actions\.throwaway\.limit': expected an integer"):
            await agent.start()
    finally:
        await agent.stop()


def test_a_table_for_a_bridge_that_is_not_installed_is_refused_when_loading() -> None:
    """A table no reactor is named after (a typo, a bridge not installed here) stops the loading, naming the
    tables that exist, instead of being ignored."""
    with pytest.raises(ConfigError) as refused:
        load_config(env={}, overrides={"actions.slurmm.enabled": True})
    assert str(refused.value).startswith(
        "command line: unknown table 'actions.slurmm' (did you mean 'actions.slurm'?); the tables under"
    )


async def test_one_failing_reactor_does_not_keep_events_from_the_others(base: Path, registered: Any) -> None:
    class Broken:
        name = "broken"

        def handle(self, event: Any) -> None:
            raise RuntimeError("a bug in a bridge")

        def status(self) -> dict[str, Any]:
            return {}

        async def start(self) -> None:
            pass

        async def stop(self, timeout: float) -> None:
            pass

    with reactors.REACTORS.registered(Part("broken", lambda host: Broken())):
        async with running_agent(base, {"actions.throwaway.limit": 1}) as agent:
            [throwaway] = [r for r in agent.components[0].reactors if r.name == "throwaway"]  # type: ignore[attr-defined]
            status, _ = await http_json(
                agent.config.socket, "POST", "/v1/drills", {"kind": "termination", "in_s": 60}
            )
            assert 201 == status
            await eventually(lambda: "notice" in throwaway.seen, what="the other reactor saw the notice")
            assert EventType.NOTICE.value == throwaway.seen[0]
