"""Metrics where Prometheus looks: the opt-in TCP listener (metrics only), the soonest-deadline gauges, each
notice's outcome, and failed reports at 0 from the start — against a real agent and a real HTTP client."""

from __future__ import annotations

import asyncio
import os
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from agent.core.errors import ConfigError
from agent.core.notice import parse_time
from agent.service.daemon import Agent
from agent.service.metrics import MetricsComponent, MetricsListener, parse_listen
from tests.support import SSEClient, agent_config, eventually, http_json, running_agent

pytestmark = pytest.mark.timeout(30)

PARTICIPANT = {"job": "llm", "rank": 0, "participant": True, "pid": os.getpid()}


@pytest.mark.parametrize(
    ("text", "address"),
    [
        ("", None),
        ("0.0.0.0:9464", ("0.0.0.0", 9464)),
        ("127.0.0.1:0", ("127.0.0.1", 0)),
        ("[::]:9464", ("::", 9464)),
        ("metrics.local:9100", ("metrics.local", 9100)),
    ],
)
def test_parse_listen(text: str, address: tuple[str, int] | None) -> None:
    assert address == parse_listen(text)


@pytest.mark.parametrize("text", ["9464", ":9464", "0.0.0.0:http", "0.0.0.0:70000", "[nope]:9464"])
def test_parse_listen_rejects(text: str) -> None:
    with pytest.raises(ConfigError, match=r"metrics\.listen"):
        parse_listen(text)


@asynccontextmanager
async def agent_with_listener(base: Path, **settings: Any) -> AsyncIterator[tuple[Agent, str]]:
    async with running_agent(base, {"metrics.listen": "127.0.0.1:0", **settings}) as agent:
        (component,) = [c for c in agent.components if isinstance(c, MetricsComponent)]
        assert component.listener is not None
        host, port = component.listener.bound[0]
        yield agent, f"http://{host}:{port}"


async def scrape(url: str) -> dict[str, float]:
    """Every sample as ``name{labels}`` → value, parsed by prometheus_client's own parser."""
    async with aiohttp.ClientSession() as session, session.get(url + "/metrics") as response:
        assert 200 == response.status
        text = await response.text()
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}"] = sample.value
    return samples


async def test_tcp_listener_serves_metrics_from_the_start(base: Path) -> None:
    async with agent_with_listener(base) as (_, url):
        samples = await scrape(url)
    assert (1.0, 0.0, 0.0) == (
        samples['preemptd_build_info{version="0.1.0"}'],
        samples['preemptd_reports_total{phase="failed"}'],
        samples['preemptd_reports_total{phase="finished"}'],
    )


@pytest.mark.parametrize(
    ("method", "path"), [("GET", "/v1/status"), ("GET", "/v1/events"), ("POST", "/v1/drills")]
)
async def test_tcp_listener_serves_nothing_else(base: Path, method: str, path: str) -> None:
    async with (
        agent_with_listener(base) as (_, url),
        aiohttp.ClientSession() as session,
        session.request(method, url + path, json={"in_s": 30}) as response,
    ):
        status = response.status
    assert status in (404, 405)


async def test_no_listener_by_default(base: Path) -> None:
    async with running_agent(base) as agent:
        (component,) = [c for c in agent.components if isinstance(c, MetricsComponent)]
        _, doc = await http_json(agent.socket_path, "GET", "/v1/status")
    assert (None, {"listen": []}) == (component.listener, doc["metrics"])


async def test_status_shows_where_metrics_listen(base: Path) -> None:
    async with agent_with_listener(base) as (agent, url):
        _, doc = await http_json(agent.socket_path, "GET", "/v1/status")
    assert [url.removeprefix("http://")] == doc["metrics"]["listen"]


async def test_a_port_in_use_is_a_clear_error(base: Path) -> None:
    async with agent_with_listener(base) as (_, url):
        taken = url.removeprefix("http://")
        second = Agent(agent_config(base / "second", {"metrics.listen": taken}))
        try:
            with pytest.raises(ConfigError, match=re.escape(f"metrics.listen: cannot listen on {taken}")):
                await second.start()
        finally:
            await second.stop()


async def test_soonest_deadline_as_timestamp_and_seconds_left(base: Path) -> None:
    async with agent_with_listener(base) as (agent, url):
        _, far = await http_json(agent.socket_path, "POST", "/v1/drills", {"in_s": 600})
        _, near = await http_json(agent.socket_path, "POST", "/v1/drills", {"in_s": 120})
        samples = await scrape(url)
    deadline = parse_time(near["notice"]["deadline"]).timestamp()
    assert (True, True) == (
        abs(deadline - samples["preemptd_next_deadline_timestamp_seconds{}"]) < 0.001,
        100 < samples["preemptd_next_deadline_seconds{}"] <= 120,
    )
    assert far["notice"]["id"] != near["notice"]["id"]


async def test_no_deadline_series_without_notices(base: Path) -> None:
    async with agent_with_listener(base) as (_, url):
        samples = await scrape(url)
    assert "preemptd_next_deadline_seconds{}" not in samples


async def report(agent: Agent, phase: str, **extra: Any) -> None:
    body = {"kind": "checkpoint", "phase": phase, "client": PARTICIPANT, **extra}
    status, _ = await http_json(agent.socket_path, "POST", "/v1/reports", body)
    assert status in {200, 202}


async def test_a_flushed_notice_is_told_flushed_and_has_a_margin(base: Path) -> None:
    async with agent_with_listener(base) as (agent, url):
        client = await SSEClient.connect(agent.socket_path)
        try:
            await client.next()
            await report(agent, "started")
            _, drill = await http_json(agent.socket_path, "POST", "/v1/drills", {"in_s": 120})
            notice_id = drill["notice"]["id"]
            await report(agent, "finished", emergency=True, notice_id=notice_id, duration_s=0.5, step=3)
            await client.until(lambda e: e["type"] == "ready")
        finally:
            await client.close()
        samples = await scrape(url)
    labels = '{drill="true",kind="termination"}'
    assert (1.0, 1.0, None, 1.0, True) == (
        samples[f"preemptd_notices_told_total{labels}"],
        samples[f"preemptd_notices_flushed_total{labels}"],
        samples.get(f"preemptd_notices_lost_total{labels}"),
        samples["preemptd_notice_flush_margin_seconds_count{}"],
        100 < samples["preemptd_notice_flush_margin_seconds_sum{}"] <= 120,
    )


async def test_a_notice_whose_participant_failed_is_lost(base: Path) -> None:
    async with agent_with_listener(base) as (agent, url):
        await report(agent, "started")
        _, drill = await http_json(agent.socket_path, "POST", "/v1/drills", {"in_s": 120})
        client = await SSEClient.connect(agent.socket_path)
        try:
            await report(agent, "failed", emergency=True, notice_id=drill["notice"]["id"])
            await client.until(lambda e: e["type"] == "ready")
        finally:
            await client.close()
        samples = await scrape(url)
    assert (1.0, None) == (
        samples['preemptd_notices_lost_total{drill="true",kind="termination"}'],
        samples.get('preemptd_notices_flushed_total{drill="true",kind="termination"}'),
    )


def listener_of(agent: Agent) -> MetricsListener:
    (component,) = [c for c in agent.components if isinstance(c, MetricsComponent)]
    assert component.listener is not None
    return component.listener


async def test_an_idle_tcp_connection_is_closed_after_the_idle_timeout(base: Path) -> None:
    """The metrics listener closes a connection that sends nothing, as the socket does (api.idle_timeout_s)."""
    async with agent_with_listener(base, **{"api.idle_timeout_s": 0.5}) as (agent, _):
        host, port = listener_of(agent).bound[0]
        reader, writer = await asyncio.open_connection(host, port)
        sent = await asyncio.wait_for(reader.read(), 10)
        writer.close()
    assert b"" == sent


async def test_past_the_cap_a_tcp_connection_is_answered_503_with_the_reason(base: Path) -> None:
    settings = {"metrics.max_connections": 2, "api.idle_timeout_s": 30}
    async with agent_with_listener(base, **settings) as (agent, url):
        listener = listener_of(agent)
        held = [await asyncio.open_connection(*listener.bound[0]) for _ in range(2)]
        await eventually(lambda: listener.open_connections == 2, what="two connections served")
        async with aiohttp.ClientSession() as session, session.get(url + "/metrics") as response:
            status, body = response.status, await response.json()
        for _, writer in held:
            writer.close()
        _, doc = await http_json(agent.config.socket, "GET", "/v1/status")
    assert 503 == status
    assert "at most 2 connections at once (metrics.max_connections)" in body["error"]
    assert {"max": 2, "refused": 1} == {k: doc["metrics"]["connections"][k] for k in ("max", "refused")}
