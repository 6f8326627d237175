"""Ready and the Azure acknowledgement end to end: the real Azure source polling the Azure simulator, a
participant's emergency checkpoint, and ``StartRequests`` arriving at the simulator."""

from __future__ import annotations

from pathlib import Path

from tests.cloud_harness import rig
from tests.support import http_json

PARTICIPANT = {"job": "llm", "rank": 0, "participant": True}


async def test_azure_event_is_acknowledged_once_the_participant_has_saved(base: Path) -> None:
    async with rig("azure", base, settings={"actions.ready.azure_acknowledge": "on_ready"}) as r:
        await http_json(
            r.socket, "POST", "/v1/reports", {"kind": "checkpoint", "phase": "started", "client": PARTICIPANT}
        )
        r.sim.trigger({"type": "event", "event_type": "Preempt", "event_id": "P-7"})
        notice = await r.notice("notice")
        assert [] == r.sim.state()["acknowledged"]
        finished = {
            "kind": "checkpoint",
            "phase": "finished",
            "duration_s": 1.0,
            "emergency": True,
            "notice_id": notice["id"],
            "client": PARTICIPANT,
        }
        await http_json(r.socket, "POST", "/v1/reports", finished)
        ready = await r.client.until(lambda e: e["type"] == "ready")
        started = await r.notice("update")  # the event turns Started once acknowledged
    assert (notice["id"], ["P-7"], "Started") == (
        ready["data"]["notice_id"],
        r.sim.state()["acknowledged"],
        started["detail"]["EventStatus"],
    )


async def test_azure_event_is_not_acknowledged_when_configured_never(base: Path) -> None:
    settings = {
        "actions.ready.azure_acknowledge": "never",
        "actions.ready.without_participants": "immediately",
    }
    async with rig("azure", base, settings=settings) as r:
        r.sim.trigger({"type": "event", "event_type": "Preempt", "event_id": "P-8"})
        await r.notice("notice")
        await r.client.until(lambda e: e["type"] == "ready")
        seen = r.sim.requests
        await r.status_until(lambda d: r.sim.requests >= seen + 3, "three more polls")
    assert [] == r.sim.state()["acknowledged"]
