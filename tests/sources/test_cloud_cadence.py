"""How often the cloud sources read each path: the cadence schedule on its own (pure, a fake clock), then the
AWS source against its simulator through a real agent (the spot path on every tick, the others less often on
the same ticks, one token, a failing slow path that never slows the spot path), and Google's
upcoming-maintenance key when its "nothing scheduled" answer does not hang."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from agent.simulate import AwsSimulator, GcpSimulator
from agent.sources.aws import INSTANCE_ACTION, LIFECYCLE, MAINTENANCE, REBALANCE
from agent.sources.cloud_http import Cadence
from tests.cloud_harness import rig

pytestmark = pytest.mark.timeout(30)

DEFAULTS = {"spot": 1.0, "rebalance": 10.0, "lifecycle": 10.0, "maintenance": 60.0}


def run_ticks(cadence: Cadence, until: float, read_takes: float = 0.02) -> list[list[str]]:
    """What a poll loop reads at each wake-up until ``until``, every read succeeding (fake clock)."""
    wakes = []
    now = 0.0
    while now < until:
        due = cadence.due(now)
        wakes.append(due)
        for part in due:
            cadence.read(part, now + read_takes)
        now = cadence.next_at() + 0.003  # the loop wakes a little late, as it does
    return wakes


def test_each_part_is_read_at_its_own_interval() -> None:
    wakes = run_ticks(Cadence(DEFAULTS, 0.0), 120.0)
    reads = Counter(part for due in wakes for part in due)
    assert {"spot": 120, "rebalance": 12, "lifecycle": 12, "maintenance": 2} == dict(reads)


def test_the_slower_parts_ride_on_the_ticks_of_the_fastest() -> None:
    """No wake-up of their own: every wake-up reads the spot path."""
    wakes = run_ticks(Cadence(DEFAULTS, 0.0), 120.0)
    assert [] == [due for due in wakes if "spot" not in due]
    assert ["spot", "rebalance", "lifecycle", "maintenance"] == wakes[0]  # all at once at start


def test_a_part_off_the_grid_is_read_on_the_nearest_tick() -> None:
    wakes = run_ticks(Cadence({"spot": 1.0, "other": 2.5}, 0.0), 10.0)
    assert [0, 2, 5, 7] == [i for i, due in enumerate(wakes) if "other" in due]


def test_a_failed_part_is_retried_at_its_backoff_without_moving_the_others() -> None:
    cadence = Cadence(DEFAULTS, 0.0)
    for part in cadence.due(0.0):
        cadence.read(part, 0.0)
    cadence.retry("maintenance", 0.4)  # failed: its backoff ends before the next spot tick
    assert 0.4 == cadence.next_at()
    assert ["maintenance"] == cadence.due(0.4)
    cadence.read("maintenance", 0.41)
    assert (1.0, ["spot"]) == (cadence.next_at(), cadence.due(1.0))


def test_fixed_rate_a_read_that_overran_its_interval_is_followed_at_once() -> None:
    cadence = Cadence({"spot": 1.0}, 0.0)
    cadence.read("spot", 2.5)  # the read took longer than the interval
    assert 2.5 == cadence.next_at()
    cadence.read("spot", 2.6)
    assert 3.5 == cadence.next_at()  # back on a one-second rate, from when it was due


# --- the AWS source, through the agent -------------------------------------------------------------------

FAST_TICKS = {
    "aws.poll_interval_s": 0.1,
    "aws.rebalance_interval_s": 0.5,
    "aws.lifecycle_interval_s": 0.5,
    "aws.maintenance_interval_s": 1.0,
}


async def test_aws_reads_the_spot_path_each_tick_and_the_others_less_often(base: Path) -> None:
    async with AwsSimulator() as sim, rig("aws", base, sim=sim, settings=FAST_TICKS) as r:
        start = Counter(sim.requests_by_path)
        await r.status_until(
            lambda _: sim.requests_by_path[INSTANCE_ACTION] - start[INSTANCE_ACTION] >= 40, "40 spot reads"
        )
        reads = {
            p: sim.requests_by_path[p] - start[p]
            for p in (INSTANCE_ACTION, REBALANCE, LIFECYCLE, MAINTENANCE)
        }
        doc = await r.status()
    spot = reads[INSTANCE_ACTION]
    # A fifth and a tenth of the spot path's reads, give or take the reads in flight at either end.
    assert {"rebalance": True, "lifecycle": True, "maintenance": True} == {
        "rebalance": abs(reads[REBALANCE] - spot / 5) <= 2,
        "lifecycle": abs(reads[LIFECYCLE] - spot / 5) <= 2,
        "maintenance": abs(reads[MAINTENANCE] - spot / 10) <= 2,
    }, reads
    assert 1 == sim.tokens_issued  # fetched once: it lasts six hours
    assert {"spot": 0.1, "rebalance": 0.5, "lifecycle": 0.5, "maintenance": 1.0} == doc["sources"]["aws"][
        "intervals_s"
    ]


async def test_aws_a_failing_slow_path_never_slows_the_spot_path(base: Path) -> None:
    async with AwsSimulator() as sim, rig("aws", base, sim=sim, settings=FAST_TICKS) as r:
        sim.inject({"type": "5xx", "status": 500, "path": MAINTENANCE})
        failing = await r.status_until(lambda d: d["sources"]["aws"]["state"] == "degraded", "degraded")
        start = Counter(sim.requests_by_path)
        await r.status_until(
            lambda _: sim.requests_by_path[INSTANCE_ACTION] - start[INSTANCE_ACTION] >= 20, "20 spot reads"
        )
        maintenance_reads = sim.requests_by_path[MAINTENANCE] - start[MAINTENANCE]
        sim.trigger({"type": "spot", "action": "terminate", "in_s": 120})
        notice = await r.notice("notice")
        still = await r.status()
        sim.clear_faults()
        recovered = await r.status_until(lambda d: d["sources"]["aws"]["state"] == "ok", "ok again")
    assert "HTTP 500" in failing["sources"]["aws"]["last_error"]
    # Backing off on its own (0.1 s doubling up to the path's 1 s): fewer reads than the spot path's 20.
    assert maintenance_reads <= 10, maintenance_reads
    assert ("spot/instance-action", "degraded") == (notice["key"], still["sources"]["aws"]["state"])
    assert ["spot/instance-action"] == [n["key"] for n in recovered["notices"]]


# --- Google: the upcoming-maintenance key when it does not hang ------------------------------------------


async def test_gcp_upcoming_maintenance_503_idle_is_read_once_per_wait(base: Path) -> None:
    """The 503 "no notifications" answer comes at once: the key is read again after gcp.wait_timeout_s, as
    often as a hanging GET answers at rest, not at the error backoff's pace."""
    path = "/computeMetadata/v1/instance/upcoming-maintenance"
    async with GcpSimulator(upcoming_idle="no-notifications-503") as sim, rig("gcp", base, sim=sim) as r:
        start = sim.requests_by_path[path]
        preempted = "/computeMetadata/v1/instance/preempted"
        begin = sim.requests_by_path[preempted]
        # The preempted key's hanging GET answers once a wait (1 s here) at rest: three of them.
        await r.status_until(lambda _: sim.requests_by_path[preempted] - begin >= 3, "three waits")
        reads = sim.requests_by_path[path] - start
    assert reads <= 4, reads
