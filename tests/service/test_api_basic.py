"""The API end to end: a real agent on a temporary Unix socket and a real client."""

from __future__ import annotations

from pathlib import Path

from agent.core.notice import Kind
from tests.support import SSEClient, http_json, running_agent


async def test_drill_reaches_a_subscriber_after_the_snapshot(base: Path) -> None:
    async with running_agent(base) as agent:
        client = await SSEClient.connect(agent.config.socket)
        try:
            snapshot = await client.next()
            assert ("snapshot", []) == (snapshot["type"], snapshot["notices"])
            status, body = await http_json(
                agent.config.socket, "POST", "/v1/drills", {"kind": "termination", "in_s": 60}
            )
            assert 201 == status
            event = await client.next()
            assert ("notice", Kind.TERMINATION.value, body["notice"]["id"]) == (
                event["type"],
                event["notice"]["kind"],
                event["notice"]["id"],
            )
        finally:
            await client.close()
