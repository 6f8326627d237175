"""Every fault a metadata service shows, replayed against every cloud source through a real agent: the source
turns degraded (with the error in status), recovers, and the client sees each change exactly once — a fault
never clears a notice, never loses a change made during it and never raises a duplicate."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.cloud_harness import CASES, Rig, rig
from tests.support import http_json

pytestmark = pytest.mark.timeout(40)

FAULTS: dict[str, dict[str, Any]] = {
    "latency": {"type": "latency", "ms": 3000},
    "hang": {"type": "hang"},
    "5xx": {"type": "5xx", "status": 503, "count": 6},
    "429": {"type": "429", "count": 4},
    "garbage": {"type": "garbage", "count": 4},
    "oversized": {"type": "oversized", "size": 1_000_000, "count": 3},
    "reset": {"type": "reset"},
}


def health(doc: dict[str, Any], cloud: str) -> dict[str, Any]:
    source: dict[str, Any] = doc["sources"][cloud]
    return source


async def degraded_then_recovered(
    r: Rig, cloud: str, fault: dict[str, Any], during: dict[str, Any]
) -> dict[str, Any]:
    errors_before = health(await r.status(), cloud)["errors"]
    r.sim.inject(fault)
    doc = await r.status_until(lambda d: health(d, cloud)["errors"] > errors_before, "the source degraded")
    r.sim.trigger(during)  # a change while the service is failing must not be lost
    r.sim.clear_faults()
    await r.status_until(
        lambda d: (
            health(d, cloud)["state"] == "ok"
            and health(d, cloud)["last_ok_at"] > health(d, cloud)["last_error_at"]
        ),
        "the source recovered",
        timeout=15,
    )
    return health(doc, cloud)


@pytest.mark.slow
@pytest.mark.parametrize("fault", sorted(FAULTS))
@pytest.mark.parametrize("cloud", sorted(CASES))
async def test_fault_degrades_then_recovers_without_losing_a_notice(
    cloud: str, fault: str, base: Path
) -> None:
    case = CASES[cloud]
    async with rig(cloud, base) as r:
        r.sim.trigger(case.appear)
        notice = await r.notice("notice")
        during = await degraded_then_recovered(r, cloud, FAULTS[fault], case.update)
        await r.notice("update", timeout=15)
        r.sim.trigger(case.clear)
        await r.notice("cleared")
        assert (bool(during["last_error"]), r.notice_events(notice["id"])) == (
            True,
            ["notice", "update", "cleared"],
        )


async def test_source_errors_reach_the_metrics(base: Path) -> None:
    async with rig("aws", base) as r:
        r.sim.inject({"type": "5xx", "status": 500})
        await r.status_until(lambda d: health(d, "aws")["state"] == "degraded", "the source degraded")
        _, text = await http_json(r.socket, "GET", "/metrics")
        r.sim.clear_faults()
        lines = [line for line in text.splitlines() if line.startswith("preemptd_source_")]
        assert (
            any(line.startswith('preemptd_source_errors_total{source="aws"}') for line in lines),
            any('source="aws"' in line and 'state="degraded"' in line for line in lines),
        ) == (True, True)
