"""Every cloud source against its simulator, through a real agent to a subscribed client: notices appear,
update and clear; identity reaches status; a restarted agent shows the same notice."""

from __future__ import annotations

import asyncio
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
import structlog

from agent.core.notice import parse_time
from agent.simulate import (
    AlibabaSimulator,
    AwsSimulator,
    AzureSimulator,
    GcpSimulator,
    TencentSimulator,
    simulator_for,
)
from agent.sources import aws as aws_source
from agent.sources.azure import AzureSource
from tests.cloud_harness import CASES, Rig, rig
from tests.support import http_json

pytestmark = pytest.mark.timeout(30)

CLOUDS = sorted(CASES)


@pytest.mark.parametrize("cloud", CLOUDS)
async def test_notice_reaches_the_client(cloud: str, base: Path) -> None:
    case = CASES[cloud]
    async with rig(cloud, base) as r:
        r.sim.trigger(case.appear)
        notice = await r.notice("notice")
        assert (notice["kind"], notice["source"], notice["key"]) == (case.kind, cloud, case.key)


@pytest.mark.parametrize("cloud", CLOUDS)
async def test_notice_updates_under_the_same_id(cloud: str, base: Path) -> None:
    case = CASES[cloud]
    async with rig(cloud, base) as r:
        r.sim.trigger(case.appear)
        first = await r.notice("notice")
        r.sim.trigger(case.update)
        assert (await r.notice("update"))["id"] == first["id"]


@pytest.mark.parametrize("cloud", CLOUDS)
async def test_notice_clears(cloud: str, base: Path) -> None:
    case = CASES[cloud]
    async with rig(cloud, base) as r:
        r.sim.trigger(case.appear)
        first = await r.notice("notice")
        r.sim.trigger(case.clear)
        cleared = await r.notice("cleared")
        assert r.notice_events(first["id"]) == ["notice", "cleared"] and cleared["id"] == first["id"]


@pytest.mark.parametrize("cloud", CLOUDS)
async def test_status_shows_cloud_and_instance(cloud: str, base: Path) -> None:
    async with rig(cloud, base) as r:
        doc = await r.status_until(lambda d: bool(d["agent"]["instance"]), "the instance identity")
        assert (doc["agent"]["cloud"], doc["sources"][cloud]["state"]) == (cloud, "ok")


@pytest.mark.parametrize("cloud", CLOUDS)
async def test_restarted_agent_shows_the_same_notice(cloud: str, base: Path) -> None:
    case = CASES[cloud]
    sim = simulator_for(cloud, **case.sim_options)
    await sim.start()
    try:
        async with rig(cloud, base, sim=sim) as r:
            r.sim.trigger(case.appear)
            before = await r.notice("notice")
        async with rig(cloud, base, sim=sim) as r:
            await r.status_until(lambda d: d["sources"][cloud]["state"] == "ok", "the source polled")
            doc = await r.status()
            (after,) = [n for n in doc["notices"] if n["key"] == case.key]
            assert (after["id"], after["deadline"], r.notice_events(before["id"])) == (
                before["id"],
                before["deadline"],
                ["snapshot"],
            )
    finally:
        await sim.stop()


# --- AWS -----------------------------------------------------------------------------------------------


async def test_aws_drifting_time_keeps_one_notice(base: Path) -> None:
    """The mock that answers now + 2 min on every poll must not produce updates or new notices."""
    async with rig("aws", base) as r:
        r.sim.trigger({"type": "spot", "drift": True})
        notice = await r.notice("notice")
        seen = r.sim.requests
        await r.status_until(lambda d: r.sim.requests >= seen + 20, "five more polls")
        r.sim.trigger({"type": "spot-clear"})
        await r.notice("cleared")
        assert r.notice_events(notice["id"]) == ["notice", "cleared"]


async def test_aws_termination_deadline_is_the_stated_time(base: Path) -> None:
    async with rig("aws", base) as r:
        r.sim.trigger({"type": "spot", "action": "stop", "in_s": 90})
        notice = await r.notice("notice")
        stated = parse_time(r.sim.state()["spot"]["time"])
        assert (parse_time(notice["deadline"]), notice["detail"]["action"]) == (stated, "stop")


async def test_aws_rebalance(base: Path) -> None:
    async with rig("aws", base) as r:
        r.sim.trigger({"type": "rebalance"})
        notice = await r.notice("notice")
        assert (notice["kind"], notice["severity"]) == ("rebalance", "warning")


async def test_aws_maintenance_canceled_clears(base: Path) -> None:
    async with rig("aws", base) as r:
        r.sim.trigger({"type": "maintenance", "code": "instance-reboot", "in_s": 3600})
        notice = await r.notice("notice")
        r.sim.trigger({"type": "maintenance-state", "state": "canceled"})
        assert (await r.notice("cleared"))["id"] == notice["id"]


async def test_aws_maintenance_deadline_from_its_time_layout(base: Path) -> None:
    async with rig("aws", base) as r:
        r.sim.trigger({"type": "maintenance", "code": "system-reboot", "in_s": 7200})
        notice = await r.notice("notice")
        expected = datetime.strptime(notice["detail"]["NotBefore"], "%d %b %Y %H:%M:%S GMT")
        assert parse_time(notice["deadline"]) == expected.replace(tzinfo=timezone.utc)


async def test_aws_maintenance_empty_as_404(base: Path) -> None:
    async with AwsSimulator(empty_maintenance="404") as sim, rig("aws", base, sim=sim) as r:
        doc = await r.status_until(lambda d: d["sources"]["aws"]["state"] == "ok", "a successful poll")
        assert doc["sources"]["aws"]["errors"] == 0


async def test_aws_autoscaling_terminated(base: Path) -> None:
    async with rig("aws", base) as r:
        r.sim.trigger({"type": "lifecycle", "state": "InService"})
        r.sim.trigger({"type": "lifecycle", "state": "Terminated"})
        assert (await r.notice("notice"))["key"] == "autoscaling/target-lifecycle-state"


async def test_aws_token_expiry_is_handled_without_error(base: Path) -> None:
    async with rig("aws", base) as r:
        r.sim.trigger({"type": "spot"})
        await r.notice("notice")
        r.sim.inject({"type": "token-expiry"})
        seen = r.sim.requests
        doc = await r.status_until(
            lambda d: r.sim.requests > seen + 8 and len(r.sim.tokens) == 1, "a new token"
        )
        assert (doc["sources"]["aws"]["state"], doc["sources"]["aws"]["errors"], len(doc["notices"])) == (
            "ok",
            0,
            1,
        )


@pytest.mark.slow
async def test_aws_token_is_refreshed_before_it_expires(base: Path) -> None:
    async with AwsSimulator() as sim, rig("aws", base, sim=sim, settings={"aws.token_ttl_s": 2}) as r:
        await r.status_until(lambda d: sim.tokens_issued >= 3, "two token refreshes")
        assert sim.unauthorized == 0


@pytest.mark.slow
async def test_aws_token_put_timeout_explains_the_hop_limit(base: Path) -> None:
    async with AwsSimulator() as sim, rig("aws", base, sim=sim) as r:
        await r.status_until(lambda d: d["sources"]["aws"]["state"] == "ok", "a first poll")
        sim.expire_tokens()
        sim.inject({"type": "hang", "path": "/latest/api/token"})
        doc = await r.status_until(lambda d: d["sources"]["aws"]["state"] == "degraded", "the token failure")
        sim.clear_faults()
        assert "hop limit" in doc["sources"]["aws"]["last_error"]


async def test_aws_imdsv1_fallback_is_explicit_and_logged(base: Path) -> None:
    async with AwsSimulator(imdsv1=True) as sim:
        sim.inject({"type": "hang", "path": "/latest/api/token"})  # as when the hop limit drops the reply
        with structlog.testing.capture_logs() as logs:
            async with rig("aws", base, sim=sim, settings={"aws.imdsv1_fallback": True}) as r:
                sim.trigger({"type": "spot"})
                await r.notice("notice")
                doc = await r.status()
        assert (doc["sources"]["aws"]["mode"], any(e["event"] == "imdsv1_fallback" for e in logs)) == (
            "imdsv1",
            True,
        )


async def test_aws_returns_to_imdsv2_when_tokens_work_again(
    base: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(aws_source, "IMDSV2_RETRY_S", 0.0)
    async with AwsSimulator(imdsv1=True) as sim:
        sim.inject({"type": "5xx", "path": "/latest/api/token"})
        async with rig("aws", base, sim=sim, settings={"aws.imdsv1_fallback": True}) as r:
            await r.status_until(lambda d: d["sources"]["aws"].get("mode") == "imdsv1", "the fallback")
            sim.clear_faults()
            await r.status_until(lambda d: d["sources"]["aws"].get("mode") == "imdsv2", "IMDSv2 again")


# --- Google Cloud ----------------------------------------------------------------------------------------


async def test_gcp_preempted_is_a_termination_30s_out(base: Path) -> None:
    async with rig("gcp", base) as r:
        r.sim.trigger({"type": "preempted"})
        notice = await r.notice("notice")
        lead = parse_time(notice["deadline"]) - parse_time(notice["detected_at"])
        assert (notice["kind"], abs(lead - timedelta(seconds=30)) < timedelta(seconds=1)) == (
            "termination",
            True,
        )


async def test_gcp_terminate_on_host_maintenance_is_a_termination(base: Path) -> None:
    async with rig("gcp", base) as r:
        r.sim.trigger({"type": "maintenance", "value": "TERMINATE_ON_HOST_MAINTENANCE"})
        assert (await r.notice("notice"))["kind"] == "termination"


async def test_gcp_upcoming_maintenance_window(base: Path) -> None:
    async with rig("gcp", base) as r:
        r.sim.trigger({"type": "upcoming", "status": "PENDING", "in_s": 3600})
        notice = await r.notice("notice")
        assert (notice["key"], notice["deadline"][:19]) == (
            "instance/upcoming-maintenance",
            r.sim.state()["upcoming"]["window_start_time"][:19],
        )


async def test_gcp_without_upcoming_maintenance_stays_healthy(base: Path) -> None:
    async with GcpSimulator(offer_upcoming=False) as sim, rig("gcp", base, sim=sim) as r:
        sim.trigger({"type": "preempted"})
        await r.notice("notice")
        doc = await r.status_until(lambda d: d["sources"]["gcp"]["state"] == "ok", "a healthy source")
        assert doc["sources"]["gcp"]["errors"] == 0


class NoHangingGcp(GcpSimulator):
    """A mock that ignores wait_for_change and answers at once with the same ETag, as some do."""

    async def _wait_change(self, *args: object) -> None:
        return None


@pytest.mark.slow
async def test_gcp_does_not_spin_on_a_server_that_never_hangs(base: Path) -> None:
    async with NoHangingGcp() as sim, rig("gcp", base, sim=sim) as r:
        seen = sim.requests
        loop = asyncio.get_running_loop()
        start = loop.time()
        await r.status_until(lambda d: sim.requests >= seen + 8, "eight requests")
        sim.trigger({"type": "preempted"})
        await r.notice("notice")
        assert loop.time() - start >= 1.0


# --- Azure ---------------------------------------------------------------------------------------------


async def test_azure_ignores_other_vms_events(base: Path) -> None:
    async with rig("azure", base) as r:
        r.sim.trigger({"type": "event", "event_type": "Preempt", "resources": ["peer-vm-1"]})
        r.sim.trigger({"type": "event", "event_type": "Reboot", "event_id": "MINE"})
        notice = await r.notice("notice")
        doc = await r.status()
        assert (notice["key"], len(doc["notices"]), doc["sources"]["azure"]["ignored_events"]) == (
            "scheduledevents/MINE",
            1,
            1,
        )


async def test_azure_freeze_is_a_warning(base: Path) -> None:
    async with rig("azure", base) as r:
        r.sim.trigger({"type": "event", "event_type": "Freeze"})
        notice = await r.notice("notice")
        assert (notice["kind"], notice["severity"]) == ("maintenance", "warning")


async def test_azure_acknowledge_sends_start_requests(base: Path) -> None:
    async with rig("azure", base) as r:
        r.sim.trigger({"type": "event", "event_type": "Terminate", "event_id": "T-1"})
        await r.notice("notice")
        source = r.agent.sources["azure"]
        assert isinstance(source, AzureSource)
        await source.acknowledge("T-1")
        updated = await r.notice("update")
        assert (r.sim.state()["acknowledged"], updated["detail"]["EventStatus"]) == (["T-1"], "Started")


async def test_azure_acknowledge_is_off_by_default(base: Path) -> None:
    async with rig("azure", base) as r:
        r.sim.trigger({"type": "event", "event_type": "Preempt"})
        await r.notice("notice")
        seen = r.sim.requests
        await r.status_until(lambda d: r.sim.requests >= seen + 3, "three more polls")
        assert r.sim.state()["acknowledged"] == []


async def test_azure_acknowledge_immediate(base: Path) -> None:
    async with rig("azure", base, settings={"azure.acknowledge": "immediate"}) as r:
        r.sim.trigger({"type": "event", "event_type": "Preempt", "event_id": "P-1"})
        await r.notice("notice")
        await r.notice("update")
        assert r.sim.state()["acknowledged"] == ["P-1"]


async def approved_at_once(r: Rig) -> tuple[dict[str, Any], dict[str, Any]]:
    """A Reboot 15 minutes out, approved as soon as seen: the notice, then its update once Started."""
    r.sim.trigger({"type": "event", "event_type": "Reboot", "event_id": "R-9", "in_s": 900})
    first = await r.notice("notice")
    started = await r.notice("update")
    assert started["detail"]["EventStatus"] == "Started"
    return first, started


async def test_azure_event_approved_at_once_is_due_now_under_the_same_id(base: Path) -> None:
    """Azure starts an approved event early: the deadline 15 minutes out becomes the time it was seen
    started, as an update of the same notice."""
    async with rig("azure", base, settings={"azure.acknowledge": "immediate"}) as r:
        first, started = await approved_at_once(r)
        events = r.notice_events(first["id"])
    scheduled = parse_time(first["deadline"]) - parse_time(first["detected_at"])
    due = parse_time(started["deadline"])
    assert (started["id"], ["notice", "update"], True, True) == (
        first["id"],
        events,
        scheduled > timedelta(minutes=14),
        parse_time(first["detected_at"]) <= due <= parse_time(started["updated_at"]),
    )


async def test_azure_started_deadline_reaches_the_ledger(base: Path) -> None:
    """The ledger keeps the effective window: the started deadline, not the scheduled one."""
    async with rig("azure", base, settings={"azure.acknowledge": "immediate"}) as r:
        first, started = await approved_at_once(r)
        scheduled = parse_time(first["deadline"]).timestamp()
        loop = asyncio.get_running_loop()
        end = loop.time() + 10
        facts: list[dict[str, Any]] = []
        while loop.time() < end:  # the ledger writes on its own thread: no event to wait on
            _, ledger = await http_json(r.socket, "GET", "/v1/ledger")
            facts = [n for n in ledger["notices"] if n["id"] == first["id"]]
            if facts and facts[0]["deadline"] < scheduled:
                break
            await asyncio.sleep(0.05)
    effective = parse_time(started["deadline"]).timestamp()
    assert ([pytest.approx(effective, abs=0.001)], True) == (
        [n["deadline"] for n in facts],
        effective < scheduled - 600,
    )


async def test_azure_iso_not_before(base: Path) -> None:
    async with AzureSimulator(not_before_format="iso") as sim, rig("azure", base, sim=sim) as r:
        sim.trigger({"type": "event", "event_type": "Reboot", "in_s": 900})
        notice = await r.notice("notice")
        assert parse_time(notice["deadline"]).strftime("%Y-%m-%dT%H:%M:%SZ") == notice["detail"]["NotBefore"]


@pytest.mark.slow
async def test_azure_stays_under_the_rate_limit(base: Path) -> None:
    settings = {"azure.poll_interval_s": 0.1}
    async with rig("azure", base, settings=settings) as r:
        seen = r.sim.requests
        await r.status_until(lambda d: r.sim.requests >= seen + 12, "a dozen polls")
        assert r.sim.state()["throttled"] == 0


# --- Alibaba ---------------------------------------------------------------------------------------------


async def test_alibaba_hardened_mode_uses_a_token(base: Path) -> None:
    async with (
        AlibabaSimulator(hardened=True) as sim,
        rig("alibaba", base, sim=sim, settings={"alibaba.token": True}) as r,
    ):
        sim.trigger({"type": "termination", "in_s": 300})
        notice = await r.notice("notice")
        assert (notice["kind"], len(sim.tokens)) == ("termination", 1)


async def test_alibaba_hardened_mode_survives_token_expiry(base: Path) -> None:
    async with (
        AlibabaSimulator(hardened=True) as sim,
        rig("alibaba", base, sim=sim, settings={"alibaba.token": True}) as r,
    ):
        sim.trigger({"type": "termination", "in_s": 300})
        notice = await r.notice("notice")
        sim.inject({"type": "token-expiry"})
        await r.status_until(
            lambda d: len(sim.tokens) == 1 and d["sources"]["alibaba"]["state"] == "ok", "a new token"
        )
        sim.trigger({"type": "clear"})
        await r.notice("cleared")
        assert r.notice_events(notice["id"]) == ["notice", "cleared"]


# --- Tencent -----------------------------------------------------------------------------------------------


async def test_tencent_local_time_becomes_utc(base: Path) -> None:
    async with TencentSimulator() as sim, rig("tencent", base, sim=sim) as r:
        sim.trigger({"type": "termination", "in_s": 120})
        notice = await r.notice("notice")
        local = datetime.strptime(sim.state()["termination_time"], "%Y-%m-%d %H:%M:%S")
        assert parse_time(notice["deadline"]) == (local - timedelta(hours=8)).replace(tzinfo=timezone.utc)
