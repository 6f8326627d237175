"""Helpers for the cloud tests: a simulator on loopback, a real agent whose cloud source points at it, and a
subscribed SSE client; plus a table of what each cloud's notices look like."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.service.daemon import Agent
from agent.simulate import Simulator, simulator_for
from tests.support import SSEClient, http_json, running_agent

# Fast polling so that tests take milliseconds per poll; the defaults are what the benchmark measures.
FAST: Mapping[str, Mapping[str, Any]] = {
    "aws": {
        "poll_interval_s": 0.1,
        "rebalance_interval_s": 0.1,
        "lifecycle_interval_s": 0.1,
        "maintenance_interval_s": 0.1,
        "timeout_s": 0.5,
        "backoff_max_s": 0.3,
    },
    "gcp": {"wait_timeout_s": 1, "timeout_s": 0.5, "backoff_max_s": 0.3},
    "azure": {"poll_interval_s": 0.25, "timeout_s": 0.5, "backoff_max_s": 0.3},
    "alibaba": {"poll_interval_s": 0.1, "timeout_s": 0.5, "backoff_max_s": 0.3},
    "tencent": {"poll_interval_s": 0.1, "timeout_s": 0.5, "backoff_max_s": 0.3},
}
QUIET = {"gpu.enabled": False, "host.enabled": False}


@dataclass(frozen=True)
class Case:
    """One cloud's notice: the event that raises it, one that changes it, one that ends it."""

    cloud: str
    appear: Mapping[str, Any]
    update: Mapping[str, Any]
    clear: Mapping[str, Any]
    kind: str
    key: str
    sim_options: Mapping[str, Any] = field(default_factory=dict)


CASES: Mapping[str, Case] = {
    "aws": Case(
        "aws",
        {"type": "spot", "action": "terminate", "in_s": 120},
        {"type": "spot", "action": "terminate", "in_s": 60},
        {"type": "spot-clear"},
        "termination",
        "spot/instance-action",
    ),
    "gcp": Case(
        "gcp",
        {"type": "maintenance", "value": "MIGRATE_ON_HOST_MAINTENANCE"},
        {"type": "maintenance", "value": "TERMINATE_ON_HOST_MAINTENANCE"},
        {"type": "maintenance", "value": "NONE"},
        "maintenance",
        "instance/maintenance-event",
    ),
    "azure": Case(
        "azure",
        {"type": "event", "event_type": "Preempt", "event_id": "E-1", "in_s": 120},
        {"type": "start", "event_id": "E-1"},
        {"type": "complete", "event_id": "E-1"},
        "termination",
        "scheduledevents/E-1",
    ),
    "alibaba": Case(
        "alibaba",
        {"type": "termination", "in_s": 300},
        {"type": "termination", "in_s": 100},
        {"type": "clear"},
        "termination",
        "spot/termination-time",
    ),
    "tencent": Case(
        "tencent",
        {"type": "termination", "in_s": 120},
        {"type": "termination", "in_s": 30},
        {"type": "clear"},
        "termination",
        "spot/termination-time",
    ),
}


def settings_for(cloud: str, url: str, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    settings: dict[str, Any] = {"cloud": cloud, f"{cloud}.endpoint": url, **QUIET}
    settings.update({f"{cloud}.{k}": v for k, v in FAST[cloud].items()})
    settings.update(extra or {})
    return settings


async def status_until(
    socket: Path, predicate: Callable[[dict[str, Any]], bool], what: str, timeout: float = 10.0
) -> dict[str, Any]:
    """Poll ``/v1/status`` until ``predicate`` holds: a source's health and identity have no event of their
    own. Bounded, and fails saying what it waited for."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    doc: dict[str, Any] = {}
    while loop.time() < end:
        _, doc = await http_json(socket, "GET", "/v1/status")
        if predicate(doc):
            return doc
        await asyncio.sleep(0.02)
    raise AssertionError(f"status never showed {what}: {doc.get('sources')}")


@dataclass
class Rig:
    sim: Simulator
    agent: Agent
    client: SSEClient
    socket: Path
    snapshot: dict[str, Any]

    async def notice(self, event_type: str, timeout: float = 10.0) -> dict[str, Any]:
        """The next event of ``event_type`` (``notice``, ``update``, ``cleared``), skipping others."""
        event = await self.client.until(lambda e: e["type"] == event_type, timeout)
        notice: dict[str, Any] = event["notice"]
        return notice

    async def status(self) -> dict[str, Any]:
        _, doc = await http_json(self.socket, "GET", "/v1/status")
        assert isinstance(doc, dict)
        return doc

    async def status_until(
        self, predicate: Callable[[dict[str, Any]], bool], what: str, timeout: float = 10.0
    ) -> dict[str, Any]:
        return await status_until(self.socket, predicate, what, timeout)

    def notice_events(self, notice_id: str) -> list[str]:
        """The types of every event this client received about ``notice_id``, in order."""
        return [
            e["type"]
            for e in self.client.received
            if e.get("notice", {}).get("id") == notice_id
            or any(n["id"] == notice_id for n in e.get("notices", []))
        ]


@asynccontextmanager
async def rig(
    cloud: str,
    base: Path,
    sim: Simulator | None = None,
    settings: Mapping[str, Any] | None = None,
) -> AsyncIterator[Rig]:
    """A simulator (started here unless given), an agent watching it, and a client past its snapshot."""
    own = sim is None
    simulator = sim or simulator_for(cloud, **CASES[cloud].sim_options)
    if own:
        await simulator.start()
    try:
        async with running_agent(base, settings=settings_for(cloud, simulator.url, settings)) as agent:
            assert agent.socket_path is not None
            client = await SSEClient.connect(agent.socket_path)
            try:
                snapshot = await client.next()
                assert snapshot["type"] == "snapshot"
                yield Rig(simulator, agent, client, agent.socket_path, snapshot)
            finally:
                await client.close()
    finally:
        if own:
            await simulator.stop()


def closed_port_url() -> str:
    """A loopback URL where nothing listens (connections are refused at once)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"
