"""The agent knows its failure domain (issue 38, placement): the cloud simulators serve the capacity type and
placement group where each cloud does (a 404 where the real service answers 404), a real agent on loopback
reads them into ``agent.domain`` in its status, ``preemptd status`` shows it in one line, and the RAM tier's
info document carries it for every rank. A field that is missing or malformed leaves the domain without
it, never stops the agent."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from agent.cli import format_status
from agent.client.peer.ramtier import RamTier
from agent.core.domain import Domain, domain_of
from agent.simulate import AwsSimulator, AzureSimulator, GcpSimulator, Simulator, simulator_for
from tests.cloud_harness import rig

pytestmark = pytest.mark.timeout(60)

TTL = "X-aws-ec2-metadata-token-ttl-seconds"


async def _get(url: str, headers: Mapping[str, str] | None = None) -> tuple[int, str]:
    timeout = aiohttp.ClientTimeout(total=10)
    async with aiohttp.ClientSession(timeout=timeout) as http, http.get(url, headers=headers) as response:
        return response.status, await response.text()


async def aws_get(sim: AwsSimulator, path: str) -> tuple[int, str]:
    timeout = aiohttp.ClientTimeout(total=10)
    async with (
        aiohttp.ClientSession(timeout=timeout) as http,
        http.put(sim.url + "/latest/api/token", headers={TTL: "60"}) as response,
    ):
        token = await response.text()
    return await _get(sim.url + path, {"X-aws-ec2-metadata-token": token})


# --- the simulators serve what the clouds serve -------------------------------------------------------


async def test_aws_simulator_serves_life_cycle_and_a_placement_group_only_when_in_one() -> None:
    async with AwsSimulator() as sim:
        outside = await aws_get(sim, "/latest/meta-data/placement/group-name")
        life = await aws_get(sim, "/latest/meta-data/instance-life-cycle")
        listing = await aws_get(sim, "/latest/meta-data/placement/")
    async with AwsSimulator(life_cycle="on-demand", placement_group="pg-train") as sim:
        inside = await aws_get(sim, "/latest/meta-data/placement/group-name")
        demand = await aws_get(sim, "/latest/meta-data/instance-life-cycle")
    assert (404, (200, "spot"), (200, "pg-train"), (200, "on-demand")) == (outside[0], life, inside, demand)
    assert "group-name" not in listing[1].split()
    assert "404 - Not Found" in outside[1]  # IMDS's own XHTML page


async def test_gcp_simulator_serves_the_provisioning_model_and_preemptible_or_404_before_it() -> None:
    flavor = {"Metadata-Flavor": "Google"}
    base = "/computeMetadata/v1/instance/scheduling/"
    found: dict[str | None, tuple[Any, ...]] = {}
    for model in ("SPOT", "STANDARD", None):
        async with GcpSimulator(provisioning_model=model) as sim:
            found[model] = (
                await _get(sim.url + base + "provisioning-model", flavor),
                await _get(sim.url + base + "preemptible", flavor),
            )
    assert ((200, "SPOT"), (200, "TRUE")) == found["SPOT"]
    assert ((200, "STANDARD"), (200, "FALSE")) == found["STANDARD"]
    assert (404, (200, "TRUE")) == (found[None][0][0], found[None][1])


async def test_azure_simulator_serves_priority_and_placement_group_id() -> None:
    url = "/metadata/instance?api-version=2021-02-01"
    async with AzureSimulator() as sim:
        _, plain = await _get(sim.url + url, {"Metadata": "true"})
    async with AzureSimulator(
        priority="Regular", placement_group_id="7d5b0f2c-9f0e-4b5e-9a57-1d2c3b4a5f60"
    ) as sim:
        _, in_set = await _get(sim.url + url, {"Metadata": "true"})
    a, b = json.loads(plain)["compute"], json.loads(in_set)["compute"]
    assert ("Spot", "", "Regular", "7d5b0f2c-9f0e-4b5e-9a57-1d2c3b4a5f60") == (
        a["priority"],
        a["placementGroupId"],
        b["priority"],
        b["placementGroupId"],
    )


# --- a real agent reads its domain --------------------------------------------------------------------

EXPECTED: Mapping[str, dict[str, str]] = {
    "aws": {"instance_type": "p4d.24xlarge", "zone": "us-east-1a", "capacity": "spot", "group": ""},
    "gcp": {"instance_type": "a2-highgpu-8g", "zone": "us-central1-a", "capacity": "spot", "group": ""},
    "azure": {"instance_type": "Standard_ND96asr_v4", "zone": "1", "capacity": "spot", "group": ""},
    "alibaba": {
        "instance_type": "ecs.gn7i-c8g1.2xlarge",
        "zone": "cn-hangzhou-i",
        "capacity": "",
        "group": "",
    },
    "tencent": {"instance_type": "GN10Xp.2XLARGE40", "zone": "ap-guangzhou-3", "capacity": "", "group": ""},
}


async def agent_domain(cloud: str, base: Path, sim: Simulator) -> dict[str, Any]:
    async with rig(cloud, base, sim=sim) as r:
        doc = await r.status_until(lambda d: d["agent"].get("domain") is not None, "the domain", timeout=20)
    assert "ok" == doc["sources"][cloud]["state"]
    domain: dict[str, Any] = doc["agent"]["domain"]
    return domain


@pytest.mark.parametrize("cloud", sorted(EXPECTED))
async def test_each_clouds_domain_is_read_by_a_real_agent_from_its_simulator(cloud: str, base: Path) -> None:
    async with simulator_for(cloud) as sim:
        domain = await agent_domain(cloud, base, sim)
    want = {"cloud": cloud, **EXPECTED[cloud]}
    assert want == {k: domain[k] for k in want}
    pool = "/".join(want[k] or "?" for k in ("cloud", "instance_type", "zone", "capacity"))
    assert (pool, pool) == (domain["pool"], domain["text"])


async def test_aws_placement_group_and_on_demand_reach_the_domain(base: Path) -> None:
    async with AwsSimulator(life_cycle="on-demand", placement_group="pg-train") as sim:
        domain = await agent_domain("aws", base, sim)
    assert ("on-demand", "pg-train", "aws/p4d.24xlarge/us-east-1a/on-demand group pg-train") == (
        domain["capacity"],
        domain["group"],
        domain["text"],
    )


async def test_azure_regular_vm_in_a_scale_set_placement_group(base: Path) -> None:
    async with AzureSimulator(priority="Regular", placement_group_id="7d5b0f2c-9f0e") as sim:
        domain = await agent_domain("azure", base, sim)
    assert ("on-demand", "7d5b0f2c-9f0e") == (domain["capacity"], domain["group"])


async def test_gcp_vm_before_provisioning_models_is_preemptible_and_standard_is_on_demand(base: Path) -> None:
    async with GcpSimulator(provisioning_model=None) as sim:
        old = await agent_domain("gcp", base, sim)
    async with GcpSimulator(provisioning_model="STANDARD") as sim:
        standard = await agent_domain("gcp", base, sim)
    assert ("preemptible", "on-demand") == (old["capacity"], standard["capacity"])


async def test_a_malformed_capacity_type_leaves_the_domain_without_it_and_the_agent_ok(base: Path) -> None:
    async with AwsSimulator() as sim:
        sim.identity["instance-life-cycle"] = "spot instance \x01"
        sim.identity["placement/group-name"] = "a/b"  # "/" cannot be told from the string form's separator
        domain = await agent_domain("aws", base, sim)
    assert ("", "", "us-east-1a") == (domain["capacity"], domain["group"], domain["zone"])


# --- the domain, pure ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cloud", "instance", "want"),
    [
        (None, {"instance_id": "i-1"}, None),  # no cloud identified
        ("aws", {}, None),  # the configured cloud, nothing read yet
        ("aws", {"instance_id": "i-1"}, Domain("aws")),
        ("aws", {"instance_type": 7, "zone": ["x"], "life_cycle": None}, Domain("aws")),
        (
            "aws",
            {"instance_type": "p5.48xlarge", "zone": " us-west-2b\n", "life_cycle": "SPOT"},
            Domain("aws", "p5.48xlarge", "us-west-2b", "spot"),
        ),
        ("aws", {"instance_type": "x" * 129, "life_cycle": "reserved"}, Domain("aws")),
        (
            "azure",
            {"vm_size": "Standard_ND96asr_v4", "zone": "", "location": "eastus", "priority": "Low"},
            Domain("azure", "Standard_ND96asr_v4", "eastus", "low-priority"),
        ),
        ("gcp", {"machine_type": "a3-highgpu-8g", "preemptible": "maybe"}, Domain("gcp", "a3-highgpu-8g")),
        (
            "oracle",
            {"instance_type": "BM.GPU.H100.8", "zone": "AD-1"},
            Domain("oracle", "BM.GPU.H100.8", "AD-1"),
        ),
    ],
)
def test_domain_of_never_fails_and_drops_what_is_malformed(
    cloud: str | None, instance: dict[str, Any], want: Domain | None
) -> None:
    assert want == domain_of(cloud, instance)


@pytest.mark.parametrize("doc", [None, "aws/p4d", [], {"zone": "us-east-1a"}, {"cloud": 3}, {"cloud": ""}])
def test_a_document_that_is_not_a_domain_reads_as_none(doc: Any) -> None:
    assert Domain.from_json(doc) is None


def test_a_domain_round_trips_through_its_document() -> None:
    domain = Domain("aws", "p4d.24xlarge", "us-east-1a", "spot", "pg-train")
    assert (domain, ("aws", "p4d.24xlarge", "us-east-1a", "spot")) == (
        Domain.from_json(domain.to_json()),
        domain.pool,
    )


# --- status, `preemptd status`, the RAM tier's info ---------------------------------------------------


def status_doc(domain: Domain | None) -> dict[str, Any]:
    return {
        "overall": "ok",
        "agent": {
            "version": "0.1.0",
            "cloud": "aws",
            "instance": {"instance_id": "i-0123456789abcdef0"},
            "uptime_s": 5,
            "domain": None if domain is None else domain.to_json(),
        },
        "notices": [],
        "sources": {},
    }


def test_preemptd_status_prints_the_domain_in_one_line_of_at_most_80_columns() -> None:
    text = format_status(status_doc(Domain("aws", "p4d.24xlarge", "us-east-1a", "spot", "pg-train")))
    lines = [line for line in text.splitlines() if "failure domain" in line]
    assert ["  failure domain aws/p4d.24xlarge/us-east-1a/spot group pg-train"] == lines
    long = Domain("azure", "Standard_" + "N" * 100, "z" * 100, "spot", "g" * 128)
    text = format_status(status_doc(long)).splitlines()
    at = [i for i, line in enumerate(text) if "failure domain" in line]
    assert (1, "  up 5.0s") == (len(at), text[at[0] + 1])  # no continuation line
    assert all(len(line) <= 80 for line in text)
    assert "failure domain" not in format_status(status_doc(None))


async def test_the_ram_tier_info_carries_the_hosts_domain_for_every_rank(base: Path) -> None:
    settings = {"ram_tier.enabled": True, "ram_tier.path": str(base / "ram"), "ram_tier.cap_bytes": 1 << 20}
    async with (
        AwsSimulator(placement_group="pg-train") as sim,
        rig("aws", base, sim=sim, settings=settings) as r,
    ):
        doc = await r.status_until(lambda d: d["agent"].get("domain") is not None, "the domain", timeout=20)
        await r.status_until(lambda d: d["ram_tier"]["state"] == "ready", "the RAM tier read back")
        info = await asyncio.to_thread(RamTier(r.socket).info)
    assert (doc["agent"]["domain"], Domain("aws", "p4d.24xlarge", "us-east-1a", "spot", "pg-train")) == (
        info["domain"],
        RamTier.domain_of(info),
    )


async def test_the_ram_tier_info_says_none_before_the_instance_is_identified(base: Path) -> None:
    settings = {"ram_tier.enabled": True, "ram_tier.path": str(base / "ram"), "ram_tier.cap_bytes": 1 << 20}
    async with AwsSimulator() as sim:
        sim.inject({"type": "5xx", "path": "/latest/meta-data/instance-id"})
        async with rig("aws", base, sim=sim, settings=settings) as r:
            await r.status_until(lambda d: d["sources"]["aws"]["identity"]["failures"] >= 1, "a failure")
            await r.status_until(lambda d: d["ram_tier"]["state"] == "ready", "the RAM tier read back")
            info = await asyncio.to_thread(RamTier(r.socket).info)
    assert (None, None) == (info["domain"], RamTier.domain_of(info))
