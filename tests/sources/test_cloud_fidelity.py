"""Metadata edge cases the clouds publish and that peers handle: Google's "no notifications" answer (200 and
503), Azure without this VM's name and during the first call's warm-up, Azure's api-version 2019-04-01, and
an AWS spot action the agent does not know. Each is a table test on the published body plus the real agent
against the simulator serving it."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest

from agent.core.notice import Kind, Severity
from agent.simulate import AwsSimulator, AzureSimulator, GcpSimulator
from agent.sources import aws, gcp
from agent.sources.cloud_http import ParseError
from tests.cloud_harness import rig

pytestmark = pytest.mark.timeout(30)

# Google's answer on instance/upcoming-maintenance while nothing is scheduled, byte for byte.
NO_NOTIFICATIONS = b'{ "error": "no notifications have been received yet, try again later" }'


# --- GCP: "no notifications have been received yet" ---------------------------------------------------


@pytest.mark.parametrize(
    "body",
    [
        NO_NOTIFICATIONS,
        NO_NOTIFICATIONS + b"\n",
        b'{"error":"No notifications have been received yet, try again later"}',
    ],
)
def test_gcp_no_notifications_is_nothing_scheduled(body: bytes) -> None:
    assert (gcp.parse_upcoming_maintenance(body), gcp.is_no_notifications(body)) == (None, True)


@pytest.mark.parametrize(
    "body",
    [b"{}", b'{"maintenance_status": "PENDING", "error": "no notifications have been received yet"}', b"x"],
)
def test_gcp_other_bodies_are_not_the_no_notifications_answer(body: bytes) -> None:
    assert gcp.is_no_notifications(body) is False


def test_gcp_another_error_document_is_a_parse_error_not_a_notice() -> None:
    with pytest.raises(ParseError, match="answered an error"):
        gcp.parse_upcoming_maintenance(b'{"error": "internal failure"}')


async def served(sim: GcpSimulator) -> tuple[int, bytes]:
    headers = {"Metadata-Flavor": "Google"}
    url = sim.url + "/computeMetadata/v1/instance/upcoming-maintenance?alt=json"
    async with aiohttp.ClientSession() as session, session.get(url, headers=headers) as response:
        return response.status, await response.read()


@pytest.mark.parametrize(("idle", "status"), [("no-notifications", 200), ("no-notifications-503", 503)])
async def test_gcp_simulator_serves_no_notifications(idle: str, status: int) -> None:
    async with GcpSimulator(upcoming_idle=idle) as sim:
        assert (status, NO_NOTIFICATIONS) == await served(sim)


@pytest.mark.slow
@pytest.mark.parametrize("idle", ["no-notifications", "no-notifications-503"])
async def test_gcp_no_notifications_raises_no_notice(idle: str, base: Path) -> None:
    async with GcpSimulator(upcoming_idle=idle) as sim, rig("gcp", base, sim=sim) as r:
        seen = sim.requests
        doc = await r.status_until(
            lambda d: sim.requests >= seen + 6 and d["sources"]["gcp"]["state"] == "ok", "six answers"
        )
        assert ([], 0) == (doc["notices"], doc["sources"]["gcp"]["errors"])


@pytest.mark.parametrize("idle", ["no-notifications", "no-notifications-503"])
async def test_gcp_no_notifications_clears_a_pending_window(idle: str, base: Path) -> None:
    async with rig("gcp", base) as r:
        r.sim.trigger({"type": "upcoming", "status": "PENDING", "in_s": 3600})
        first = await r.notice("notice")
        r.sim.trigger({"type": "upcoming-clear", "answer": idle})
        cleared = await r.notice("cleared")
        doc = await r.status()
    assert (first["id"], [], 0) == (cleared["id"], doc["notices"], doc["sources"]["gcp"]["errors"])


async def test_gcp_bare_503_after_a_window_keeps_the_notice(base: Path) -> None:
    """A 503 without the "no notifications" body is a brief outage during host maintenance."""
    async with rig("gcp", base) as r:
        r.sim.trigger({"type": "upcoming", "status": "PENDING", "in_s": 3600})
        await r.notice("notice")
        r.sim.inject({"type": "5xx", "status": 503, "path": "/computeMetadata/v1/instance/upcoming"})
        r.sim.changed()  # wake the hanging GET so that it meets the fault
        doc = await r.status_until(lambda d: d["sources"]["gcp"]["errors"] >= 1, "the 503 as an error")
    assert ["instance/upcoming-maintenance"] == [n["key"] for n in doc["notices"]]


# --- Azure: no acknowledgement without this VM's name -------------------------------------------------

INSTANCE_DOWN = {"type": "5xx", "status": 500, "path": "/metadata/instance"}


async def test_azure_immediate_never_acknowledges_without_the_vm_name(base: Path) -> None:
    async with AzureSimulator() as sim:
        sim.inject(INSTANCE_DOWN)
        async with rig("azure", base, sim=sim, settings={"azure.acknowledge": "immediate"}) as r:
            sim.trigger({"type": "event", "event_type": "Preempt", "resources": ["peer-vm-1"]})
            await r.notice("notice")  # unfiltered: a peer's false alarm beats a missed preemption
            seen = sim.requests
            doc = await r.status_until(lambda d: sim.requests >= seen + 4, "four more requests")
    assert ([], True) == (
        sim.state()["acknowledged"],
        "name is unknown" in doc["sources"]["azure"]["acknowledge_blocked"],
    )


async def test_azure_on_ready_never_acknowledges_without_the_vm_name(base: Path) -> None:
    settings = {
        "actions.ready.azure_acknowledge": "on_ready",
        "actions.ready.without_participants": "immediately",
    }
    async with AzureSimulator() as sim:
        sim.inject(INSTANCE_DOWN)
        async with rig("azure", base, sim=sim, settings=settings) as r:
            sim.trigger({"type": "event", "event_type": "Preempt", "event_id": "P-9", "resources": ["peer"]})
            await r.notice("notice")
            await r.client.until(lambda e: e["type"] == "ready")
            doc = await r.status_until(
                lambda d: bool(d["actions"]["azure_acknowledgements"]), "the acknowledgement's outcome"
            )
    (record,) = doc["actions"]["azure_acknowledgements"]
    assert ([], "failed", True) == (
        sim.state()["acknowledged"],
        record["outcome"],
        "name is unknown" in record["error"],
    )


async def test_azure_acknowledges_once_the_vm_name_is_known(base: Path) -> None:
    async with rig("azure", base, settings={"azure.acknowledge": "immediate"}) as r:
        r.sim.trigger({"type": "event", "event_type": "Preempt", "event_id": "MINE"})
        await r.notice("notice")
        await r.notice("update")
        doc = await r.status()
    assert (["MINE"], None) == (r.sim.state()["acknowledged"], doc["sources"]["azure"]["acknowledge_blocked"])


# --- Azure: the first call may take up to two minutes -------------------------------------------------

WARM = {"azure.timeout_s": 0.3, "azure.first_call_timeout_s": 10.0}
EVENTS = "/metadata/scheduledevents"


async def test_azure_first_call_may_take_longer_than_the_timeout(base: Path) -> None:
    async with AzureSimulator() as sim:
        sim.trigger({"type": "event", "event_type": "Preempt", "event_id": "BOOT"})
        sim.inject({"type": "latency", "ms": 1200, "count": 1, "path": EVENTS})
        async with rig("azure", base, sim=sim, settings=WARM) as r:
            doc = await r.status_until(lambda d: d["sources"]["azure"]["state"] == "ok", "the first answer")
    assert (["scheduledevents/BOOT"], 0, False) == (
        [n["key"] for n in doc["notices"]],
        doc["sources"]["azure"]["errors"],
        doc["sources"]["azure"]["warming_up"],
    )


async def test_azure_first_call_after_a_server_error_may_take_longer(base: Path) -> None:
    async with rig("azure", base, settings=WARM) as r:
        await r.status_until(lambda d: d["sources"]["azure"]["state"] == "ok", "a first answer")
        r.sim.inject({"type": "5xx", "status": 503, "count": 1, "path": EVENTS})
        r.sim.inject({"type": "latency", "ms": 1200, "count": 1, "path": EVENTS})
        seen = r.sim.requests
        doc = await r.status_until(
            lambda d: r.sim.requests >= seen + 3 and d["sources"]["azure"]["state"] == "ok", "recovery"
        )
    assert 1 == doc["sources"]["azure"]["errors"]  # the 503 only, not the slow call after it


async def test_azure_warm_up_does_not_block_other_sources(base: Path) -> None:
    settings = {**WARM, "host.enabled": True, "host.poll_interval_s": 0.1}
    async with AzureSimulator() as sim:
        sim.inject({"type": "hang", "path": EVENTS})
        async with rig("azure", base, sim=sim, settings=settings) as r:
            doc = await r.status_until(lambda d: d["sources"]["host"]["state"] == "ok", "the host monitor")
            sim.clear_faults()
    assert (True, "starting") == (doc["sources"]["azure"]["warming_up"], doc["sources"]["azure"]["state"])


# --- Azure: every api-version Microsoft lists ---------------------------------------------------------


async def test_azure_api_version_2019_04_01(base: Path) -> None:
    async with rig("azure", base, settings={"azure.api_version": "2019-04-01"}) as r:
        r.sim.trigger({"type": "event", "event_type": "Reboot", "event_id": "R-1"})
        notice = await r.notice("notice")
        doc = await r.status()
    assert ("scheduledevents/R-1", 0) == (notice["key"], doc["sources"]["azure"]["errors"])


# --- AWS: an unknown spot action is a termination ------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "raw"),
    [
        (b'{"action": "reboot", "time": "2017-09-18T08:22:00Z"}', "reboot"),
        (b'{"action": "Shutdown-Soon", "time": "2017-09-18T08:22:00Z"}', "Shutdown-Soon"),
        (b'{"action": 3, "time": "2017-09-18T08:22:00Z"}', 3),
        (b'{"time": "2017-09-18T08:22:00Z"}', None),
    ],
)
def test_aws_unknown_spot_action_is_a_critical_termination(body: bytes, raw: object) -> None:
    obs = aws.parse_instance_action(body)
    assert (obs.key, obs.kind, obs.effective_severity, obs.detail["action"]) == (
        "spot/instance-action",
        Kind.TERMINATION,
        Severity.CRITICAL,
        raw,
    )


async def test_aws_unknown_spot_action_through_the_agent(base: Path) -> None:
    async with AwsSimulator() as sim, rig("aws", base, sim=sim) as r:
        sim.trigger({"type": "spot", "action": "evacuate", "raw": True, "in_s": 120})
        notice = await r.notice("notice")
    assert ("termination", "critical", "evacuate") == (
        notice["kind"],
        notice["severity"],
        notice["detail"]["action"],
    )
