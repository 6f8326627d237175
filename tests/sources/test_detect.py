"""Cloud detection: DMI strings pick the source without touching the network, ``cloud`` overrides them, and
without DMI a background probe of the configured endpoints finds the cloud — start-up never waits for it."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.simulate import AwsSimulator, AzureSimulator, GcpSimulator
from agent.sources import build_sources
from agent.sources.aws import AwsSource
from agent.sources.detect import AZURE_ASSET_TAG, DetectingSource, probe_all
from agent.sources.gcp import GcpSource
from tests.cloud_harness import QUIET, closed_port_url, status_until
from tests.support import SSEClient, agent_config, http_json, running_agent

pytestmark = pytest.mark.timeout(30)


def dmi_dir(base: Path, **values: str) -> Path:
    path = base / "dmi"
    path.mkdir()
    for name, value in values.items():
        (path / name).write_text(value + "\n")
    return path


def unreachable(base: Path) -> dict[str, str]:
    """Every cloud endpoint on a loopback port where nothing listens: no probe can leave the machine."""
    return {f"{cloud}.endpoint": closed_port_url() for cloud in ("aws", "gcp", "azure", "alibaba", "tencent")}


def sources_for(base: Path, **settings: object) -> list[str]:
    config = agent_config(base, {**QUIET, **unreachable(base), **settings})
    return [type(s).__name__ for s in build_sources(config)]


def test_dmi_picks_aws(base: Path) -> None:
    dmi = dmi_dir(base, sys_vendor="Amazon EC2", product_name="p5.48xlarge")
    assert sources_for(base, cloud="auto", **{"detect.dmi_dir": str(dmi)}) == ["AwsSource"]


def test_dmi_picks_azure_by_asset_tag(base: Path) -> None:
    dmi = dmi_dir(base, sys_vendor="Microsoft Corporation", chassis_asset_tag=AZURE_ASSET_TAG)
    assert sources_for(base, cloud="auto", **{"detect.dmi_dir": str(dmi)}) == ["AzureSource"]


def test_cloud_setting_overrides_dmi(base: Path) -> None:
    dmi = dmi_dir(base, sys_vendor="Amazon EC2")
    assert sources_for(base, cloud="gcp", **{"detect.dmi_dir": str(dmi)}) == ["GcpSource"]


def test_cloud_none_runs_no_cloud_source(base: Path) -> None:
    assert sources_for(base, cloud="none") == []


def test_unknown_dmi_probes_in_the_background(base: Path) -> None:
    dmi = dmi_dir(base, sys_vendor="LENOVO", product_name="20XW")
    assert sources_for(base, cloud="auto", **{"detect.dmi_dir": str(dmi)}) == ["DetectingSource"]


def test_missing_dmi_directory_probes(base: Path) -> None:
    assert sources_for(base, cloud="auto", **{"detect.dmi_dir": str(base / "absent")}) == ["DetectingSource"]


async def test_probe_finds_the_cloud_that_answers(base: Path) -> None:
    async with GcpSimulator() as sim:
        config = agent_config(base, {**unreachable(base), "gcp.endpoint": sim.url})
        assert await probe_all(config, 0.5) == "gcp"


async def test_probe_finds_nothing_on_a_laptop(base: Path) -> None:
    assert await probe_all(agent_config(base, unreachable(base)), 0.5) is None


async def test_detected_cloud_runs_and_identifies(base: Path) -> None:
    dmi = dmi_dir(base, sys_vendor="QEMU")
    async with AwsSimulator() as sim:
        settings = {
            **QUIET,
            **unreachable(base),
            "cloud": "auto",
            "aws.endpoint": sim.url,
            "detect.dmi_dir": str(dmi),
        }
        settings["aws.poll_interval_s"] = 0.1
        async with running_agent(base, settings=settings) as agent:
            assert agent.socket_path is not None
            client = await SSEClient.connect(agent.socket_path)
            try:
                await client.next()
                sim.trigger({"type": "spot"})
                event = await client.until(lambda e: e["type"] == "notice")
            finally:
                await client.close()
            await status_until(agent.socket_path, lambda d: bool(d["agent"]["instance"]), "the instance")
            source = agent.sources["cloud"]
            assert isinstance(source, DetectingSource)
            assert (
                event["notice"]["source"],
                agent.identity.cloud,
                agent.identity.instance["instance_id"],
                source.status()["detected"],
            ) == (
                "cloud",
                "aws",
                "i-0123456789abcdef0",
                "aws",
            )


async def test_detected_azure_can_be_acknowledged(base: Path) -> None:
    async with AzureSimulator() as sim:
        settings = {**QUIET, **unreachable(base), "cloud": "auto", "azure.endpoint": sim.url}
        settings["detect.dmi_dir"] = str(base / "absent")
        async with running_agent(base, settings=settings) as agent:
            assert agent.socket_path is not None
            sim.trigger({"type": "event", "event_type": "Preempt", "event_id": "P-9"})
            await status_until(agent.socket_path, lambda d: bool(d["notices"]), "the notice")
            source = agent.sources["cloud"]
            assert isinstance(source, DetectingSource)
            await source.acknowledge("P-9")
            assert sim.state()["acknowledged"] == ["P-9"]


async def test_start_up_does_not_wait_for_a_hung_metadata_service(base: Path) -> None:
    async with AwsSimulator() as sim:
        sim.inject({"type": "hang"})
        endpoints = {f"{cloud}.endpoint": sim.url for cloud in ("aws", "gcp", "azure", "alibaba", "tencent")}
        settings = {**QUIET, **endpoints, "cloud": "auto", "detect.dmi_dir": str(base / "absent")}
        settings["detect.probe_timeout_s"] = 5.0
        async with running_agent(base, settings=settings) as agent:
            assert agent.socket_path is not None
            _, doc = await http_json(agent.socket_path, "GET", "/v1/status")
            assert doc["sources"]["cloud"]["state"] == "starting"


async def test_nothing_detected_disables_with_advice(base: Path) -> None:
    dmi = dmi_dir(base, sys_vendor="LENOVO")
    settings = {
        **QUIET,
        **unreachable(base),
        "cloud": "auto",
        "detect.dmi_dir": str(dmi),
        "detect.probe_timeout_s": 0.2,
        "detect.probe_retry_s": 0.0,
    }
    async with running_agent(base, settings=settings) as agent:
        assert agent.socket_path is not None
        doc = await status_until(
            agent.socket_path, lambda d: d["sources"]["cloud"]["state"] == "disabled", "the source disabled"
        )
        assert "cloud = " in doc["sources"]["cloud"]["detail"]["why"]


def test_dmi_source_names_its_cloud(base: Path) -> None:
    dmi = dmi_dir(base, product_name="Google Compute Engine")
    config = agent_config(base, {**QUIET, "cloud": "auto", "detect.dmi_dir": str(dmi)})
    (source,) = build_sources(config)
    assert (isinstance(source, GcpSource), source.name) == (True, "gcp")


def test_explicit_aws_source(base: Path) -> None:
    (source,) = build_sources(agent_config(base, {**QUIET, "cloud": "aws"}))
    assert isinstance(source, AwsSource)
