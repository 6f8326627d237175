"""The simulators speak each cloud's protocol: paths, headers, status codes, formats, long polls and limits.
Every test talks to a real simulator on 127.0.0.1 with a real HTTP client."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest

from agent.simulate import AlibabaSimulator, AwsSimulator, AzureSimulator, GcpSimulator, TencentSimulator

TTL = "X-aws-ec2-metadata-token-ttl-seconds"
TOKEN = "X-aws-ec2-metadata-token"
FLAVOR = {"Metadata-Flavor": "Google"}
AZ = {"Metadata": "true"}
EVENTS = "/metadata/scheduledevents?api-version=2020-07-01"


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        yield session


@pytest.fixture
async def aws_sim() -> AsyncIterator[AwsSimulator]:
    async with AwsSimulator() as sim:
        yield sim


@pytest.fixture
async def gcp_sim() -> AsyncIterator[GcpSimulator]:
    async with GcpSimulator() as sim:
        yield sim


@pytest.fixture
async def azure_sim() -> AsyncIterator[AzureSimulator]:
    async with AzureSimulator(vm_name="vm-a") as sim:
        yield sim


async def token(http: aiohttp.ClientSession, sim: AwsSimulator, ttl: str = "60") -> str:
    async with http.put(sim.url + "/latest/api/token", headers={TTL: ttl}) as response:
        assert response.status == 200
        return await response.text()


async def get(http: aiohttp.ClientSession, url: str, **kwargs: object) -> tuple[int, str]:
    async with http.get(url, **kwargs) as response:  # type: ignore[arg-type]
        return response.status, await response.text()


# --- AWS -----------------------------------------------------------------------------------------------


async def test_aws_token_echoes_ttl(http: aiohttp.ClientSession, aws_sim: AwsSimulator) -> None:
    async with http.put(aws_sim.url + "/latest/api/token", headers={TTL: "21600"}) as response:
        assert (response.status, response.headers[TTL]) == (200, "21600")


@pytest.mark.parametrize("ttl", [None, "0", "21601", "abc"])
async def test_aws_token_bad_ttl_is_400(
    http: aiohttp.ClientSession, aws_sim: AwsSimulator, ttl: str | None
) -> None:
    headers = {TTL: ttl} if ttl is not None else {}
    async with http.put(aws_sim.url + "/latest/api/token", headers=headers) as response:
        assert response.status == 400


@pytest.mark.parametrize("path", ["/2021-03-23/api/token", "/latest/meta-data/instance-id"])
async def test_aws_put_elsewhere_is_403(
    http: aiohttp.ClientSession, aws_sim: AwsSimulator, path: str
) -> None:
    async with http.put(aws_sim.url + path, headers={TTL: "60"}) as response:
        assert response.status == 403


async def test_aws_token_put_with_forwarded_for_is_rejected(
    http: aiohttp.ClientSession, aws_sim: AwsSimulator
) -> None:
    headers = {TTL: "60", "X-Forwarded-For": "10.1.2.3"}
    async with http.put(aws_sim.url + "/latest/api/token", headers=headers) as response:
        assert response.status == 403


async def test_aws_token_by_get_is_405(http: aiohttp.ClientSession, aws_sim: AwsSimulator) -> None:
    assert (await get(http, aws_sim.url + "/latest/api/token"))[0] == 405


async def test_aws_get_without_token_is_401(http: aiohttp.ClientSession, aws_sim: AwsSimulator) -> None:
    assert (await get(http, aws_sim.url + "/latest/meta-data/instance-id"))[0] == 401


async def test_aws_get_with_unknown_token_is_401(http: aiohttp.ClientSession, aws_sim: AwsSimulator) -> None:
    status, _ = await get(http, aws_sim.url + "/latest/meta-data/instance-id", headers={TOKEN: "nope"})
    assert status == 401


async def test_aws_token_past_its_ttl_is_401(http: aiohttp.ClientSession, aws_sim: AwsSimulator) -> None:
    value = await token(http, aws_sim)
    aws_sim.tokens[value] = time.monotonic() - 0.001
    status, _ = await get(http, aws_sim.url + "/latest/meta-data/instance-id", headers={TOKEN: value})
    assert status == 401


async def test_aws_imdsv1_mode_answers_without_token(http: aiohttp.ClientSession) -> None:
    async with AwsSimulator(imdsv1=True) as sim:
        assert await get(http, sim.url + "/latest/meta-data/instance-id") == (200, "i-0123456789abcdef0")


async def test_aws_spot_action_is_404_until_published(
    http: aiohttp.ClientSession, aws_sim: AwsSimulator
) -> None:
    headers = {TOKEN: await token(http, aws_sim)}
    status, body = await get(http, aws_sim.url + "/latest/meta-data/spot/instance-action", headers=headers)
    assert (status, "404 - Not Found" in body) == (404, True)


async def test_aws_spot_action_payload(http: aiohttp.ClientSession, aws_sim: AwsSimulator) -> None:
    headers = {TOKEN: await token(http, aws_sim)}
    aws_sim.trigger({"type": "spot", "action": "stop"})
    status, body = await get(http, aws_sim.url + "/latest/meta-data/spot/instance-action", headers=headers)
    doc = json.loads(body)
    assert (status, doc["action"], bool(re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", doc["time"]))) == (
        200,
        "stop",
        True,
    )


async def test_aws_answers_text_plain_from_ec2ws(http: aiohttp.ClientSession, aws_sim: AwsSimulator) -> None:
    headers = {TOKEN: await token(http, aws_sim)}
    async with http.get(aws_sim.url + "/latest/meta-data/instance-id", headers=headers) as response:
        assert (response.headers["Content-Type"], response.headers["Server"]) == ("text/plain", "EC2ws")


async def test_aws_maintenance_uses_its_own_time_layout(
    http: aiohttp.ClientSession, aws_sim: AwsSimulator
) -> None:
    headers = {TOKEN: await token(http, aws_sim)}
    aws_sim.trigger({"type": "maintenance", "code": "system-reboot"})
    _, body = await get(http, aws_sim.url + "/latest/meta-data/events/maintenance/scheduled", headers=headers)
    (event,) = json.loads(body)
    assert re.fullmatch(r"[1-3]?\d [A-Z][a-z]{2} \d{4} \d\d:\d\d:\d\d GMT", event["NotBefore"])


async def test_aws_empty_maintenance_is_an_empty_array(
    http: aiohttp.ClientSession, aws_sim: AwsSimulator
) -> None:
    headers = {TOKEN: await token(http, aws_sim)}
    assert await get(
        http, aws_sim.url + "/latest/meta-data/events/maintenance/scheduled", headers=headers
    ) == (
        200,
        "[]",
    )


async def test_aws_empty_maintenance_can_be_404(http: aiohttp.ClientSession) -> None:
    async with AwsSimulator(empty_maintenance="404") as sim:
        headers = {TOKEN: await token(http, sim)}
        status, _ = await get(
            http, sim.url + "/latest/meta-data/events/maintenance/scheduled", headers=headers
        )
        assert status == 404


async def test_aws_listing_shows_spot_once_published(
    http: aiohttp.ClientSession, aws_sim: AwsSimulator
) -> None:
    headers = {TOKEN: await token(http, aws_sim)}
    aws_sim.trigger({"type": "spot"})
    _, body = await get(http, aws_sim.url + "/latest/meta-data/spot/", headers=headers)
    assert body.split("\n") == ["instance-action", "termination-time"]


async def test_aws_leaf_with_trailing_slash(http: aiohttp.ClientSession, aws_sim: AwsSimulator) -> None:
    """botocore reads the zone as placement/availability-zone/ (with a slash)."""
    headers = {TOKEN: await token(http, aws_sim)}
    url = aws_sim.url + "/latest/meta-data/placement/availability-zone/"
    assert await get(http, url, headers=headers) == (200, "us-east-1a")


async def test_aws_identity_document(http: aiohttp.ClientSession, aws_sim: AwsSimulator) -> None:
    headers = {TOKEN: await token(http, aws_sim)}
    _, body = await get(http, aws_sim.url + "/latest/dynamic/instance-identity/document", headers=headers)
    assert json.loads(body)["region"] == "us-east-1"


# --- Google Cloud ----------------------------------------------------------------------------------------


async def test_gcp_requires_metadata_flavor(http: aiohttp.ClientSession, gcp_sim: GcpSimulator) -> None:
    status, body = await get(http, gcp_sim.url + "/computeMetadata/v1/instance/preempted")
    assert (status, body.strip()) == (403, "Missing Metadata-Flavor:Google header.")


async def test_gcp_answers_with_flavor_and_etag(http: aiohttp.ClientSession, gcp_sim: GcpSimulator) -> None:
    async with http.get(gcp_sim.url + "/computeMetadata/v1/instance/preempted", headers=FLAVOR) as response:
        assert (
            await response.text(),
            response.headers["Metadata-Flavor"],
            len(response.headers["ETag"]),
        ) == (
            "FALSE",
            "Google",
            16,
        )


async def test_gcp_rejects_forwarded_for(http: aiohttp.ClientSession, gcp_sim: GcpSimulator) -> None:
    headers = {**FLAVOR, "X-Forwarded-For": "1.2.3.4"}
    assert (await get(http, gcp_sim.url + "/computeMetadata/v1/instance/id", headers=headers))[0] == 403


async def test_gcp_hanging_get_answers_on_change(http: aiohttp.ClientSession, gcp_sim: GcpSimulator) -> None:
    url = gcp_sim.url + "/computeMetadata/v1/instance/preempted"
    async with http.get(url, headers=FLAVOR) as response:
        etag = response.headers["ETag"]
    params = {"wait_for_change": "true", "last_etag": etag, "timeout_sec": "30"}
    request = asyncio.ensure_future(get(http, url, headers=FLAVOR, params=params))
    await gcp_sim.wait_for_waiters(1)
    gcp_sim.trigger({"type": "preempted"})
    assert await asyncio.wait_for(request, 5) == (200, "TRUE")


async def test_gcp_hanging_get_timeout_returns_the_same_value_and_etag(
    http: aiohttp.ClientSession, gcp_sim: GcpSimulator
) -> None:
    url = gcp_sim.url + "/computeMetadata/v1/instance/maintenance-event"
    async with http.get(url, headers=FLAVOR) as response:
        etag = response.headers["ETag"]
    params = {"wait_for_change": "true", "last_etag": etag, "timeout_sec": "1"}
    async with http.get(url, headers=FLAVOR, params=params) as response:
        assert (response.status, await response.text(), response.headers["ETag"]) == (200, "NONE", etag)


async def test_gcp_stale_etag_answers_at_once(http: aiohttp.ClientSession, gcp_sim: GcpSimulator) -> None:
    params = {"wait_for_change": "true", "last_etag": "0", "timeout_sec": "300"}
    url = gcp_sim.url + "/computeMetadata/v1/instance/preempted"
    assert await asyncio.wait_for(get(http, url, headers=FLAVOR, params=params), 5) == (200, "FALSE")


async def test_gcp_recursive_json(http: aiohttp.ClientSession, gcp_sim: GcpSimulator) -> None:
    url = gcp_sim.url + "/computeMetadata/v1/instance/"
    _, body = await get(http, url, headers=FLAVOR, params={"recursive": "true"})
    doc = json.loads(body)
    assert (doc["preempted"], doc["scheduling"]["onHostMaintenance"]) == ("FALSE", "TERMINATE")


async def test_gcp_upcoming_maintenance_is_empty_object(
    http: aiohttp.ClientSession, gcp_sim: GcpSimulator
) -> None:
    url = gcp_sim.url + "/computeMetadata/v1/instance/upcoming-maintenance"
    assert await get(http, url, headers=FLAVOR, params={"alt": "json"}) == (200, "{}")


async def test_gcp_upcoming_maintenance_can_be_absent(http: aiohttp.ClientSession) -> None:
    async with GcpSimulator(offer_upcoming=False) as sim:
        url = sim.url + "/computeMetadata/v1/instance/upcoming-maintenance"
        assert (await get(http, url, headers=FLAVOR))[0] == 404


async def test_gcp_root_ping_needs_no_header(http: aiohttp.ClientSession, gcp_sim: GcpSimulator) -> None:
    async with http.get(gcp_sim.url + "/") as response:
        assert (response.status, response.headers["Metadata-Flavor"]) == (200, "Google")


# --- Azure ---------------------------------------------------------------------------------------------


async def test_azure_requires_metadata_header(http: aiohttp.ClientSession, azure_sim: AzureSimulator) -> None:
    status, body = await get(http, azure_sim.url + EVENTS)
    assert (status, "metadata header" in json.loads(body)["error"]) == (400, True)


async def test_azure_requires_api_version(http: aiohttp.ClientSession, azure_sim: AzureSimulator) -> None:
    status, body = await get(http, azure_sim.url + "/metadata/scheduledevents", headers=AZ)
    assert (status, "newest-versions" in json.loads(body)) == (400, True)


async def test_azure_no_events_document(http: aiohttp.ClientSession, azure_sim: AzureSimulator) -> None:
    _, body = await get(http, azure_sim.url + EVENTS, headers=AZ)
    assert json.loads(body)["Events"] == []


async def test_azure_throttles_above_five_per_second(
    http: aiohttp.ClientSession, azure_sim: AzureSimulator
) -> None:
    statuses = [(await get(http, azure_sim.url + EVENTS, headers=AZ))[0] for _ in range(6)]
    assert statuses == [200, 200, 200, 200, 200, 429]


async def test_azure_not_before_is_rfc1123(http: aiohttp.ClientSession, azure_sim: AzureSimulator) -> None:
    azure_sim.trigger({"type": "event", "event_type": "Reboot"})
    _, body = await get(http, azure_sim.url + EVENTS, headers=AZ)
    (event,) = json.loads(body)["Events"]
    assert re.fullmatch(r"[A-Z][a-z]{2}, \d\d [A-Z][a-z]{2} \d{4} \d\d:\d\d:\d\d GMT", event["NotBefore"])


async def test_azure_not_before_can_be_iso(http: aiohttp.ClientSession) -> None:
    async with AzureSimulator(not_before_format="iso") as sim:
        sim.trigger({"type": "event", "event_type": "Reboot"})
        _, body = await get(http, sim.url + EVENTS, headers=AZ)
        (event,) = json.loads(body)["Events"]
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", event["NotBefore"])


async def test_azure_each_change_bumps_the_incarnation(
    http: aiohttp.ClientSession, azure_sim: AzureSimulator
) -> None:
    before = json.loads((await get(http, azure_sim.url + EVENTS, headers=AZ))[1])["DocumentIncarnation"]
    azure_sim.trigger({"type": "event", "event_type": "Freeze"})
    after = json.loads((await get(http, azure_sim.url + EVENTS, headers=AZ))[1])["DocumentIncarnation"]
    assert after == before + 1


async def test_azure_start_requests_starts_the_event(
    http: aiohttp.ClientSession, azure_sim: AzureSimulator
) -> None:
    azure_sim.trigger({"type": "event", "event_type": "Preempt", "event_id": "E1"})
    body = {"StartRequests": [{"EventId": "E1"}]}
    async with http.post(azure_sim.url + EVENTS, headers=AZ, json=body) as response:
        assert response.status == 200
    (event,) = azure_sim.document()["Events"]
    assert (event["EventStatus"], event["NotBefore"]) == ("Started", "")


async def test_azure_start_requests_unknown_event_is_400(
    http: aiohttp.ClientSession, azure_sim: AzureSimulator
) -> None:
    body = {"StartRequests": [{"EventId": "nope"}]}
    async with http.post(azure_sim.url + EVENTS, headers=AZ, json=body) as response:
        assert response.status == 400


async def test_azure_instance_metadata_names_the_vm(
    http: aiohttp.ClientSession, azure_sim: AzureSimulator
) -> None:
    url = azure_sim.url + "/metadata/instance/compute/name?api-version=2021-02-01&format=text"
    assert await get(http, url, headers=AZ) == (200, "vm-a")


INSTANCE = "/metadata/instance?api-version=2021-02-01"


@pytest.mark.parametrize(
    ("answer", "expected"),
    [("absent", (404, {"error": "Not found"})), ("throttled", (429, {"error": "Too many requests"}))],
)
async def test_azure_instance_metadata_can_fail(
    http: aiohttp.ClientSession, answer: str, expected: tuple[int, dict[str, str]]
) -> None:
    """404 as Microsoft's Scheduled Events mock answers it (it serves no instance metadata), 429 as IMDS."""
    async with AzureSimulator(instance=answer) as sim:
        status, body = await get(http, sim.url + INSTANCE, headers=AZ)
        events_status, _ = await get(http, sim.url + EVENTS, headers=AZ)
    assert (expected, 200) == ((status, json.loads(body)), events_status)


async def test_azure_instance_answer_changes_by_event(
    http: aiohttp.ClientSession, azure_sim: AzureSimulator
) -> None:
    azure_sim.trigger({"type": "instance", "answer": "absent"})
    before, _ = await get(http, azure_sim.url + INSTANCE, headers=AZ)
    azure_sim.trigger({"type": "instance", "answer": "serve"})
    after, _ = await get(http, azure_sim.url + INSTANCE, headers=AZ)
    assert (before, after) == (404, 200)


async def test_simulator_counts_requests_by_path(
    http: aiohttp.ClientSession, azure_sim: AzureSimulator
) -> None:
    for _ in range(2):
        await get(http, azure_sim.url + EVENTS, headers=AZ)
    await get(http, azure_sim.url + INSTANCE, headers=AZ)
    assert {"/metadata/scheduledevents": 2, "/metadata/instance": 1} == dict(azure_sim.requests_by_path)


async def test_azure_managed_identity_token(http: aiohttp.ClientSession, azure_sim: AzureSimulator) -> None:
    url = (
        azure_sim.url
        + "/metadata/identity/oauth2/token?api-version=2018-02-01&resource=https://management.azure.com/"
    )
    status, body = await get(http, url, headers=AZ)
    doc = json.loads(body)
    assert (status, doc["token_type"], doc["resource"]) == (200, "Bearer", "https://management.azure.com/")


# --- Alibaba and Tencent ---------------------------------------------------------------------------------


async def test_alibaba_termination_time(http: aiohttp.ClientSession) -> None:
    async with AlibabaSimulator() as sim:
        sim.trigger({"type": "termination"})
        status, body = await get(http, sim.url + "/latest/meta-data/instance/spot/termination-time")
        assert (status, bool(re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", body))) == (200, True)


async def test_alibaba_hardened_mode_needs_a_token(http: aiohttp.ClientSession) -> None:
    async with AlibabaSimulator(hardened=True) as sim:
        assert (await get(http, sim.url + "/latest/meta-data/instance-id"))[0] == 401


async def test_alibaba_hardened_mode_token(http: aiohttp.ClientSession) -> None:
    async with AlibabaSimulator(hardened=True) as sim:
        headers = {"X-aliyun-ecs-metadata-token-ttl-seconds": "60"}
        async with http.put(sim.url + "/latest/api/token", headers=headers) as response:
            value = await response.text()
        headers = {"X-aliyun-ecs-metadata-token": value}
        assert await get(http, sim.url + "/latest/meta-data/instance-id", headers=headers) == (
            200,
            "i-bp67acfmxazb4ph3e8q1",
        )


async def test_tencent_time_is_local_without_zone(http: aiohttp.ClientSession) -> None:
    async with TencentSimulator() as sim:
        assert (await get(http, sim.url + "/latest/meta-data/spot/termination-time"))[0] == 404
        sim.trigger({"type": "termination"})
        _, body = await get(http, sim.url + "/latest/meta-data/spot/termination-time")
        assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", body)
