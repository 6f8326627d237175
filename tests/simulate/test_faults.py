"""Fault injection, scenarios and the /_sim/ control API of the simulators, seen by a real HTTP client."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest

from agent.simulate import AwsSimulator, GcpSimulator, SimulatorError, TencentSimulator

FLAVOR = {"Metadata-Flavor": "Google"}
PREEMPTED = "/computeMetadata/v1/instance/preempted"


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        yield session


@pytest.fixture
async def sim() -> AsyncIterator[GcpSimulator]:
    async with GcpSimulator(seed=1) as simulator:
        yield simulator


async def fetch(http: aiohttp.ClientSession, sim: GcpSimulator, path: str = PREEMPTED) -> tuple[int, bytes]:
    async with http.get(sim.url + path, headers=FLAVOR) as response:
        return response.status, await response.read()


async def test_5xx_burst_then_normal(http: aiohttp.ClientSession, sim: GcpSimulator) -> None:
    sim.inject({"type": "5xx", "count": 2, "status": 503})
    statuses = [(await fetch(http, sim))[0] for _ in range(3)]
    assert statuses == [503, 503, 200]


async def test_429_carries_retry_after(http: aiohttp.ClientSession, sim: GcpSimulator) -> None:
    sim.inject({"type": "429", "count": 1})
    async with http.get(sim.url + PREEMPTED, headers=FLAVOR) as response:
        assert (response.status, response.headers["Retry-After"]) == (429, "1")


async def test_garbage_body_is_not_text(http: aiohttp.ClientSession, sim: GcpSimulator) -> None:
    sim.inject({"type": "garbage", "count": 1})
    status, body = await fetch(http, sim)
    with pytest.raises(UnicodeDecodeError):
        body.decode("utf-8")
    assert status == 200


async def test_oversized_body(http: aiohttp.ClientSession, sim: GcpSimulator) -> None:
    sim.inject({"type": "oversized", "count": 1, "size": 300_000})
    assert len((await fetch(http, sim))[1]) == 300_000


async def test_latency_delays_the_answer(http: aiohttp.ClientSession, sim: GcpSimulator) -> None:
    sim.inject({"type": "latency", "ms": 150, "count": 1})
    start = time.monotonic()
    await fetch(http, sim)
    assert time.monotonic() - start >= 0.15


async def test_reset_drops_the_connection(http: aiohttp.ClientSession, sim: GcpSimulator) -> None:
    # No count: aiohttp's client silently retries a request whose fresh connection was reset once.
    sim.inject({"type": "reset"})
    with pytest.raises(aiohttp.ClientError):
        await fetch(http, sim)


async def test_hang_never_answers_until_cleared(http: aiohttp.ClientSession, sim: GcpSimulator) -> None:
    sim.inject({"type": "hang"})
    request = asyncio.ensure_future(fetch(http, sim))
    done, _ = await asyncio.wait({request}, timeout=0.3)
    sim.clear_faults()
    with contextlib.suppress(aiohttp.ClientError):  # released: dropped, or retried by the client
        await request
    assert done == set()


async def test_fault_path_prefix_spares_other_paths(http: aiohttp.ClientSession, sim: GcpSimulator) -> None:
    sim.inject({"type": "5xx", "path": "/computeMetadata/v1/instance/maintenance"})
    assert (await fetch(http, sim))[0] == 200


async def test_fault_window_ends(http: aiohttp.ClientSession, sim: GcpSimulator) -> None:
    sim.inject({"type": "5xx", "duration_s": 0.0})
    assert (await fetch(http, sim))[0] == 200


async def test_control_api_is_never_faulted(http: aiohttp.ClientSession, sim: GcpSimulator) -> None:
    sim.inject({"type": "5xx"})
    async with http.get(sim.url + "/_sim/state") as response:
        assert (response.status, (await response.json())["faults"][0]["type"]) == (200, "5xx")


async def test_token_expiry_invalidates_tokens(http: aiohttp.ClientSession) -> None:
    async with AwsSimulator() as aws:
        ttl = {"X-aws-ec2-metadata-token-ttl-seconds": "60"}
        async with http.put(aws.url + "/latest/api/token", headers=ttl) as response:
            token = await response.text()
        async with http.post(aws.url + "/_sim/fault", json={"type": "token-expiry"}) as response:
            assert response.status == 200
        headers = {"X-aws-ec2-metadata-token": token}
        async with http.get(aws.url + "/latest/meta-data/instance-id", headers=headers) as response:
            assert response.status == 401


@pytest.mark.parametrize(
    "fault",
    [
        {"type": "earthquake"},
        {"type": "5xx", "status": 404},
        {"type": "latency", "ms": -1},
        {"type": "5xx", "count": 0},
    ],
)
def test_bad_fault_is_rejected(fault: dict[str, object]) -> None:
    with pytest.raises(SimulatorError):
        GcpSimulator().inject(fault)


async def test_control_event_reports_publication_time(http: aiohttp.ClientSession, sim: GcpSimulator) -> None:
    before = time.time()
    async with http.post(sim.url + "/_sim/event", json={"type": "preempted"}) as response:
        doc = await response.json()
    assert (before <= doc["published_unix"] <= time.time(), (await fetch(http, sim))[1]) == (True, b"TRUE")


async def test_control_event_rejects_unknown_type(http: aiohttp.ClientSession, sim: GcpSimulator) -> None:
    async with http.post(sim.url + "/_sim/event", json={"type": "meteor"}) as response:
        assert response.status == 400


async def test_scenario_plays_in_the_background(http: aiohttp.ClientSession) -> None:
    async with TencentSimulator() as tencent:
        async with http.post(
            tencent.url + "/_sim/scenario", json={"name": "spot-termination", "after_s": 0}
        ) as r:
            assert r.status == 200
        await tencent.wait_publications(1)
        assert tencent.state()["termination_time"] is not None


async def test_unknown_scenario_is_400(http: aiohttp.ClientSession, sim: GcpSimulator) -> None:
    async with http.post(sim.url + "/_sim/scenario", json={"name": "apocalypse"}) as response:
        assert response.status == 400


async def test_reset_clears_state_and_faults(http: aiohttp.ClientSession, sim: GcpSimulator) -> None:
    sim.trigger({"type": "preempted"})
    sim.inject({"type": "5xx"})
    async with http.post(sim.url + "/_sim/reset") as response:
        assert response.status == 200
    assert await fetch(http, sim) == (200, b"FALSE")


def test_every_cloud_lists_scenarios() -> None:
    from agent.simulate import SIMULATORS

    assert all("quiet" in cls.scenarios for cls in SIMULATORS.available().values())
