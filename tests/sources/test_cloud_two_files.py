"""A new cloud is two files: its source module (the :class:`CloudSpec` with its table, DMI match, probe, source,
notice leads) and its simulator module, installed as a distribution that names them in the ``preemptd.clouds``
and ``preemptd.simulators`` entry-point groups (docs/internals.md, "How to add a cloud"). With nothing in
agent/ edited and nothing registered by hand, in fresh processes: the configuration accepts ``cloud =`` it and
checks its table, ``preemptd simulate`` serves it, and the agent detects it by DMI, polls it and gives its
notice lead to the window."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import uuid
from pathlib import Path

import aiohttp
import pytest

from tests.cloud_harness import QUIET, status_until
from tests.support import REPO, AgentProcess, SSEClient

pytestmark = pytest.mark.timeout(60)

SOURCE = '''
"""Zeta Cloud for preemptd: an RFC 3339 reclaim time at /latest/meta-data/zeta/reclaim-at."""
from dataclasses import dataclass

from agent.config import HttpUrl, Seconds
from agent.core.notice import parse_time
from agent.sources.cloud_spot import TerminationTimeSource, probe_instance_id
from agent.sources.clouds import CloudSpec, Lead


@dataclass(frozen=True)
class ZetaConfig:
    endpoint: HttpUrl = "http://169.254.169.254"
    poll_interval_s: Seconds = 1.0
    timeout_s: Seconds = 1.0
    backoff_max_s: Seconds = 5.0


class ZetaSource(TerminationTimeSource):
    name = "zeta"
    cloud = "zeta"
    termination_path = "/latest/meta-data/zeta/reclaim-at"
    identity_paths = {"instance_id": "/latest/meta-data/instance-id"}

    def __init__(self, config):
        super().__init__(config.endpoint, config.poll_interval_s, config.timeout_s, config.backoff_max_s)

    def parse_time(self, body):
        return parse_time(body.decode().strip())


def names_zeta(dmi):
    return dmi.get("sys_vendor", "") == "Zeta Cloud"


async def probe(config, timeout_s):
    return await probe_instance_id(config.endpoint, timeout_s)


CLOUD = CloudSpec(
    "zeta",
    ZetaConfig,
    names_zeta,
    probe,
    ZetaSource,
    simulator="SIMULATOR_MODULE:ZetaSimulator",
    leads=lambda table: (Lead("termination", 45.0, "zeta: reclaim-at, 45 s ahead", fixed=True),),
    about="Zeta Cloud: instance metadata",
)
'''

SIMULATOR = '''
"""Zeta Cloud's metadata service, simulated."""
from agent.simulate.base import rfc3339_seconds, scenario
from agent.simulate.spot import SpotTimeSimulator


class ZetaSimulator(SpotTimeSimulator):
    cloud = "zeta"
    termination_path = "zeta/reclaim-at"
    scenarios = dict([scenario("quiet", "no notices")])

    def format_time(self, value):
        return rfc3339_seconds(value)

    def identity(self):
        return {"instance-id": "zeta-0001"}
'''


@pytest.fixture
def site(tmp_path: Path) -> Path:
    """A directory holding the distribution: the two modules and their dist-info."""
    tag = uuid.uuid4().hex[:8]
    source, simulator = f"zeta_source_{tag}", f"zeta_simulator_{tag}"
    path = tmp_path / "site"
    path.mkdir()
    (path / f"{source}.py").write_text(SOURCE.replace("SIMULATOR_MODULE", simulator))
    (path / f"{simulator}.py").write_text(SIMULATOR)
    info = path / f"preemptd_zeta_{tag}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: preemptd-zeta-{tag}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        f"[preemptd.clouds]\nzeta = {source}:CLOUD\n\n[preemptd.simulators]\nzeta = {simulator}:ZetaSimulator\n"
    )
    return path


def environment(site: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREEMPTD_")}
    env["PYTHONPATH"] = f"{REPO}{os.pathsep}{site}"
    return env


async def preemptd(site: Path, *args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "agent",
        *args,
        env=environment(site),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_the_configuration_accepts_the_installed_cloud_and_checks_its_table(site: Path) -> None:
    code, out, err = await preemptd(
        site, "run", "--cloud", "zeta", "--set", "zeta.poll_interval_s=0.5", "--print-config"
    )
    printed = json.loads(out) if code == 0 else {}
    refused = await preemptd(
        site, "run", "--cloud", "zeta", "--set", "zeta.poll_interval_s=0", "--print-config"
    )
    assert (0, "zeta", 0.5, 2) == (
        code,
        printed.get("cloud"),
        printed.get("zeta", {}).get("poll_interval_s"),
        refused[0],
    ), err
    assert (
        refused[2]
        .strip()
        .endswith("key 'zeta.poll_interval_s': expected a finite number of seconds >= 0.1, got 0")
    )


async def test_the_simulate_verb_serves_the_installed_cloud(site: Path) -> None:
    code, out, err = await preemptd(site, "simulate", "zeta", "--list-scenarios")
    assert (0, {"quiet": "no notices"}) == (code, json.loads(out) if code == 0 else None), err


@pytest.mark.slow
async def test_the_agent_detects_the_installed_cloud_polls_it_and_knows_its_lead(
    base: Path, site: Path
) -> None:
    """A real agent with the distribution on its path: DMI names Zeta Cloud, the window takes the cloud's
    45 s lead from its spec, and the source polls the simulator that ``preemptd simulate zeta`` serves."""
    sim = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "agent", "simulate", "zeta"),
        env=environment(site),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        assert sim.stdout is not None
        first = (await asyncio.wait_for(sim.stdout.readline(), 20)).decode()
        url = first.rpartition("listening on ")[2].strip()
        dmi = base / "dmi"
        dmi.mkdir()
        (dmi / "sys_vendor").write_text("Zeta Cloud\n")
        args = ["--cloud", "auto", "--set", f"detect.dmi_dir={str(dmi)!r}"]
        args += ["--set", f"zeta.endpoint={url!r}", "--set", "zeta.poll_interval_s=0.1"]
        for key, value in QUIET.items():
            args += ["--set", f"{key}={json.dumps(value)}"]
        agent = AgentProcess(base, extra_args=args, env={"PYTHONPATH": environment(site)["PYTHONPATH"]})
        await agent.start()
        try:
            doc = await status_until(
                agent.socket_path, lambda d: d.get("window", {}).get("state") == "ok", "the window"
            )
            client = await SSEClient.connect(agent.socket_path)
            try:
                await client.next()
                async with (
                    aiohttp.ClientSession() as session,
                    session.post(f"{url}/_sim/event", json={"type": "termination", "in_s": 90}) as r,
                ):
                    posted = r.status
                event = await client.until(lambda e: e["type"] == "notice")
            finally:
                await client.close()
        finally:
            assert 0 == await agent.stop()
    finally:
        sim.terminate()
        await sim.wait()
    assert ("zeta", {"seconds": 45.0, "source": "zeta: reclaim-at, 45 s ahead", "deadline": True}, 200) == (
        doc["agent"]["cloud"],
        doc["window"]["kinds"]["termination"]["cloud"],
        posted,
    )
    assert ("zeta", "termination") == (event["notice"]["source"], event["notice"]["kind"])
