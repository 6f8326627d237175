"""The instance identity is an auxiliary read: when it fails (a 404, as from Microsoft's Scheduled Events mock,
or IMDS throttling it with 429), the notice poll keeps its cadence and stays ``ok``, and the failure shows on
its own (``identity`` in the source's status, the ``identity_read_failed`` log event with the HTTP status).
Cadence is counted in requests the simulator received, never timed."""

from __future__ import annotations

from pathlib import Path

import pytest
import structlog

from agent.simulate import AzureSimulator, simulator_for
from tests.cloud_harness import rig

pytestmark = pytest.mark.timeout(30)

EVENTS = "/metadata/scheduledevents"
INSTANCE = "/metadata/instance"
# An error backoff cap eight times the poll interval (the defaults are 1 s and 5 s), so that polls taking the
# error backoff would show in the counts; vm_name set, as it must be with Microsoft's mock. The interval stays
# above the source's 4 requests/s (0.25 s), which would leave no room for the identity's retries.
AZURE = {"azure.poll_interval_s": 0.3, "azure.backoff_max_s": 2.4, "azure.vm_name": "gpu-trainer-0"}
POLLS = 16


def events_gets(sim: AzureSimulator) -> int:
    return sim.requests_by_path[EVENTS]


@pytest.mark.slow
@pytest.mark.parametrize(("answer", "status"), [("absent", 404), ("throttled", 429)])
async def test_azure_failing_instance_metadata_keeps_the_events_poll_ok(
    answer: str, status: int, base: Path
) -> None:
    async with AzureSimulator(instance=answer) as sim, rig("azure", base, sim=sim, settings=AZURE) as r:
        doc = await r.status_until(lambda d: events_gets(sim) >= POLLS, f"{POLLS} events reads", timeout=20)
    azure = doc["sources"]["azure"]
    assert ("ok", 0, True, "failing", status) == (
        azure["state"],
        azure["errors"],
        azure["last_ok_at"] is not None,
        azure["identity"]["state"],
        azure["identity"]["last_error_status"],
    )


@pytest.mark.slow
@pytest.mark.parametrize("answer", ["absent", "throttled"])
async def test_azure_instance_metadata_is_retried_on_its_own_slower_schedule(answer: str, base: Path) -> None:
    """Old behaviour: one identity read per events read, each one an error that backed the poll off."""
    async with AzureSimulator(instance=answer) as sim, rig("azure", base, sim=sim, settings=AZURE) as r:
        await r.status_until(lambda d: events_gets(sim) >= POLLS, f"{POLLS} events reads", timeout=20)
        identity_gets = sim.requests_by_path[INSTANCE]
    assert 1 <= identity_gets <= POLLS // 4, (identity_gets, events_gets(sim))


async def test_azure_identity_failure_is_logged_with_its_http_status(base: Path) -> None:
    with structlog.testing.capture_logs() as logs:
        async with AzureSimulator(instance="absent") as sim, rig("azure", base, sim=sim, settings=AZURE) as r:
            await r.status_until(lambda d: d["sources"]["azure"]["identity"]["failures"] >= 1, "a failure")
    failed = [e for e in logs if e["event"] == "identity_read_failed"]
    errors = [e for e in logs if e["event"] == "source_error"]
    assert (404, "azure", []) == (failed[0]["status"], failed[0]["source"], errors)


async def test_azure_identity_arrives_once_instance_metadata_answers(base: Path) -> None:
    async with AzureSimulator(instance="throttled") as sim, rig("azure", base, sim=sim, settings=AZURE) as r:
        await r.status_until(lambda d: d["sources"]["azure"]["identity"]["failures"] >= 1, "a failure")
        sim.trigger({"type": "instance", "answer": "serve"})
        doc = await r.status_until(lambda d: bool(d["agent"].get("instance")), "the instance")
    assert ("ok", "gpu-trainer-0", "ok", 0) == (
        doc["sources"]["azure"]["identity"]["state"],
        doc["agent"]["instance"]["name"],
        doc["sources"]["azure"]["state"],
        doc["sources"]["azure"]["errors"],
    )


async def test_azure_without_vm_name_still_filters_once_the_identity_answers(base: Path) -> None:
    """Without azure.vm_name the first poll waits for the first identity answer (one request), so a peer's
    event is never raised only to be cleared a poll later."""
    async with AzureSimulator() as sim:
        sim.trigger({"type": "event", "event_type": "Preempt", "resources": ["peer-vm-1"]})
        async with rig("azure", base, sim=sim) as r:
            await r.status_until(lambda d: events_gets(sim) >= 3, "three events reads")
            sim.trigger({"type": "event", "event_type": "Preempt", "event_id": "MINE"})
            first = await r.notice("notice")  # the peer's, had it been raised
    assert ([], "scheduledevents/MINE") == (r.snapshot["notices"], first["key"])


# --- the other clouds: the same rule ------------------------------------------------------------------

IDENTITY_PATHS: dict[str, str] = {
    "aws": "/latest/meta-data/instance-id",
    "gcp": "/computeMetadata/v1/instance/id",
    "alibaba": "/latest/meta-data/instance-id",
    "tencent": "/latest/meta-data/instance-id",
}
# Requests to wait for: Google's watchers hang up to wait_timeout_s (1 s) per answer.
REQUESTS = {"aws": 20, "gcp": 6, "alibaba": 20, "tencent": 20}


@pytest.mark.parametrize("cloud", sorted(IDENTITY_PATHS))
async def test_failing_identity_leaves_the_notice_poll_ok(cloud: str, base: Path) -> None:
    sim = simulator_for(cloud)
    async with sim:
        sim.inject({"type": "429", "path": IDENTITY_PATHS[cloud]})
        async with rig(cloud, base, sim=sim, settings={f"{cloud}.backoff_max_s": 0.8}) as r:
            seen = sim.requests
            doc = await r.status_until(
                lambda d: (
                    sim.requests >= seen + REQUESTS[cloud]
                    and d["sources"][cloud]["identity"]["failures"] >= 1
                ),
                "requests and an identity failure",
            )
    source = doc["sources"][cloud]
    assert ("ok", 0, "failing", 429) == (
        source["state"],
        source["errors"],
        source["identity"]["state"],
        source["identity"]["last_error_status"],
    )
