"""The cloud seam: a cloud added from outside the project (an installed ``preemptd.clouds`` entry point, or
``agent.sources.clouds.CLOUDS.register``) is one spec with its table, DMI match, probe, source and simulator.
The agent accepts ``cloud = "<it>"`` and its table (checked when the file is loaded), detects it by DMI or by
its probe, and polls it against its simulator on loopback. Nothing in agent/ is edited for it."""

from __future__ import annotations

import importlib
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agent.config import load_config
from agent.core.errors import ConfigError
from agent.simulate import SIMULATORS
from agent.sources import clouds
from tests.cloud_harness import QUIET, closed_port_url, status_until
from tests.support import REPO, AgentProcess, SSEClient, running_agent

pytestmark = pytest.mark.timeout(30)

# The plug-in, as a third party would write it: a termination time at a path of its own.
PLUGIN = '''
"""Acme Cloud for preemptd: publishes an RFC 3339 reclaim time at /latest/meta-data/acme/reclaim-at."""
from dataclasses import dataclass

from agent.config import HttpUrl, Seconds
from agent.core.notice import parse_time
from agent.simulate.base import rfc3339_seconds, scenario
from agent.simulate.spot import SpotTimeSimulator
from agent.sources.cloud_spot import TerminationTimeSource, probe_instance_id
from agent.sources.clouds import CloudSpec


@dataclass(frozen=True)
class AcmeConfig:
    endpoint: HttpUrl = "http://169.254.169.254"
    poll_interval_s: Seconds = 1.0
    timeout_s: Seconds = 1.0
    backoff_max_s: Seconds = 5.0


class AcmeSource(TerminationTimeSource):
    name = "acme"
    cloud = "acme"
    termination_path = "/latest/meta-data/acme/reclaim-at"
    identity_paths = {"instance_id": "/latest/meta-data/instance-id"}

    def __init__(self, config):
        super().__init__(config.endpoint, config.poll_interval_s, config.timeout_s, config.backoff_max_s)

    def parse_time(self, body):
        return parse_time(body.decode().strip())


class AcmeSimulator(SpotTimeSimulator):
    cloud = "acme"
    termination_path = "acme/reclaim-at"
    scenarios = dict([scenario("quiet", "no notices")])

    def format_time(self, value):
        return rfc3339_seconds(value)

    def identity(self):
        return {"instance-id": "acme-0001"}


def names_acme(dmi):
    return dmi.get("sys_vendor", "") == "Acme Cloud"


async def probe(config, timeout_s):
    return await probe_instance_id(config.endpoint, timeout_s)


SPEC = CloudSpec("acme", AcmeConfig, names_acme, probe, AcmeSource, simulator=__name__ + ":AcmeSimulator")
'''

BUILTIN = ("aws", "gcp", "azure", "alibaba", "tencent")


def write_plugin(directory: Path, entry_point: bool) -> str:
    """The plug-in module (and, for ``entry_point``, an installed distribution that declares it in the
    ``preemptd.clouds`` group) under ``directory``; returns the module name."""
    module = f"acme_{uuid.uuid4().hex[:10]}"
    (directory / f"{module}.py").write_text(PLUGIN)
    if entry_point:
        info = directory / f"{module}-0.1.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module}\nVersion: 0.1\n")
        (info / "entry_points.txt").write_text(f"[{clouds.ENTRY_POINT_GROUP}]\nacme = {module}:SPEC\n")
    return module


@pytest.fixture
def plugin_dir(tmp_path: Path) -> Path:
    path = tmp_path / "site"
    path.mkdir()
    return path


@pytest.fixture
def acme(plugin_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The plug-in registered in agent.sources.clouds.CLOUDS for the test; yields its module."""
    module = write_plugin(plugin_dir, entry_point=False)
    monkeypatch.syspath_prepend(str(plugin_dir))
    loaded = importlib.import_module(module)
    try:
        with clouds.CLOUDS.registered(loaded.SPEC):
            yield loaded
    finally:
        sys.modules.pop(module, None)


def test_a_registered_cloud_is_a_value_of_cloud_and_its_table_is_checked_at_load(acme: Any) -> None:
    config = load_config(env={}, overrides={"cloud": "acme", "acme.poll_interval_s": 0.5})
    assert ("acme", acme.AcmeConfig(poll_interval_s=0.5)) == (
        config.cloud,
        config.table("acme", acme.AcmeConfig),
    )
    with pytest.raises(ConfigError) as refused:
        load_config(env={}, overrides={"acme.poll_interval_s": 0})
    assert (
        "command line: key 'acme.poll_interval_s': expected a finite number of seconds >= 0.1, got 0"
        == str(refused.value)
    )


def test_every_built_in_cloud_names_the_simulator_that_simulate_finds_for_it() -> None:
    specs, simulators = clouds.clouds(), SIMULATORS.available()
    assert {name: simulators[name] for name in BUILTIN} == {
        name: specs[name].simulator_class() for name in BUILTIN
    }


def test_the_registered_cloud_comes_after_the_built_in_ones_in_detection_order(acme: Any) -> None:
    assert [*BUILTIN, "acme"] == list(clouds.clouds())


def test_a_cloud_that_is_gone_takes_its_table_with_it(
    plugin_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(plugin_dir))
    with clouds.CLOUDS.registered(importlib.import_module(write_plugin(plugin_dir, entry_point=False)).SPEC):
        load_config(env={}, overrides={"cloud": "acme"})
    with pytest.raises(
        ConfigError, match=r"^command line: key 'cloud': expected one of 'auto', 'none', 'aws'"
    ):
        load_config(env={}, overrides={"cloud": "acme"})


async def test_dmi_picks_a_registered_cloud_and_the_agent_polls_its_simulator(base: Path, acme: Any) -> None:
    dmi = base / "dmi"
    dmi.mkdir()
    (dmi / "sys_vendor").write_text("Acme Cloud\n")
    async with acme.AcmeSimulator() as sim:
        settings = {
            **QUIET,
            "cloud": "auto",
            "detect.dmi_dir": str(dmi),
            "acme.endpoint": sim.url,
            "acme.poll_interval_s": 0.1,
        }
        async with running_agent(base, settings=settings) as agent:
            assert agent.socket_path is not None
            client = await SSEClient.connect(agent.socket_path)
            try:
                await client.next()
                sim.trigger({"type": "termination", "in_s": 90})
                event = await client.until(lambda e: e["type"] == "notice")
            finally:
                await client.close()
            doc = await status_until(
                agent.socket_path, lambda d: bool(d["agent"]["instance"]), "the instance"
            )
    assert ("acme", "termination", "spot/termination-time", "acme", "acme-0001") == (
        event["notice"]["source"],
        event["notice"]["kind"],
        event["notice"]["key"],
        doc["agent"]["cloud"],
        doc["agent"]["instance"]["instance_id"],
    )


async def test_an_installed_entry_point_cloud_is_found_by_its_probe(base: Path, plugin_dir: Path) -> None:
    """A real agent process with the plug-in installed (on its path) and no DMI: the background probe of
    every cloud's endpoint finds the one the simulator answers for, and its source polls it."""
    module = write_plugin(plugin_dir, entry_point=True)
    sys.path.insert(0, str(plugin_dir))
    try:
        simulator = importlib.import_module(module).SPEC.simulator_class()
    finally:
        sys.path.remove(str(plugin_dir))
        sys.modules.pop(module, None)
    assert simulator is not None
    async with simulator() as sim:
        args = ["--cloud", "auto", "--set", f"detect.dmi_dir={str(base / 'absent')!r}"]
        for cloud in BUILTIN:
            args += ["--set", f"{cloud}.endpoint={closed_port_url()!r}"]
        args += ["--set", f"acme.endpoint={sim.url!r}", "--set", "acme.poll_interval_s=0.1"]
        args += ["--set", "gpu.enabled=false", "--set", "host.enabled=false"]
        proc = AgentProcess(base, extra_args=args, env={"PYTHONPATH": f"{REPO}:{plugin_dir}"})
        await proc.start()
        try:
            client = await SSEClient.connect(proc.socket_path)
            try:
                await client.next()
                sim.trigger({"type": "termination", "in_s": 90})
                event = await client.until(lambda e: e["type"] == "notice")
            finally:
                await client.close()
            doc = await status_until(proc.socket_path, lambda d: bool(d["agent"]["instance"]), "the instance")
        finally:
            assert 0 == await proc.stop()
    assert ("cloud", "acme", "acme", "acme-0001") == (
        event["notice"]["source"],
        doc["sources"]["cloud"]["detected"],
        doc["agent"]["cloud"],
        doc["agent"]["instance"]["instance_id"],
    )
