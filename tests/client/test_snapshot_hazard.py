"""The hazard raises the snapshot rate (issue 38; agent/client/hazard.py): notices that call for no checkpoint
but make an unannounced loss likelier (a rebalance recommendation the trigger policy does not act on, NVML's
degraded signals, host degradation) divide the steps between peer snapshots by √factor, for the whole job, and
the rate relaxes when they clear."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest

from agent.cli.render import format_status
from agent.client.events import Notice, TriggerPolicy
from agent.client.hazard import SIBLING_FACTOR, Hazard, Siblings, combined, hazard_of, steps_between
from tests.hosts import HostRun, hosts, train
from tests.lazy import HAS_TORCH
from tests.support import http_json, running_agent


def notice(kind: str, drill: bool = False, source: str = "nvml", reason: str = "") -> Notice:
    return Notice(id=f"{kind}-1", kind=kind, severity="warning", source=source, reason=reason, drill=drill)


def test_only_the_notices_the_trigger_policy_does_not_act_on_raise_the_hazard() -> None:
    assert hazard_of([]) == Hazard()
    assert hazard_of([notice("termination", source="aws")]) == Hazard()  # it evacuates instead
    assert hazard_of([notice("rebalance", source="aws")]).factor == 1.0  # a trigger by default
    quiet = TriggerPolicy(kinds=frozenset({"termination"}))
    assert hazard_of([notice("rebalance", source="aws")], quiet).factor == 4.0
    found = hazard_of(
        [notice("host_degraded", source="host"), notice("gpu_degraded", True, reason="ECC rising")]
    )
    assert found.factor == 4.0
    assert found.reasons == ("gpu_degraded drill from nvml: ECC rising", "host_degraded from host")


@pytest.mark.parametrize(
    ("every", "factor", "expected"), [(20, 1.0, 20), (20, 4.0, 10), (20, 2.0, 14), (1, 4.0, 1), (20, 0.5, 20)]
)
def test_the_steps_between_snapshots_go_as_one_over_the_square_root_of_the_factor(
    every: int, factor: float, expected: int
) -> None:
    assert steps_between(every, factor) == expected


def test_a_sibling_notice_raises_the_hazard_for_a_while_and_asks_for_one_snapshot() -> None:
    siblings = Siblings(hold_s=600)
    assert (Hazard(), False) == (siblings.hazard(now=0.0), siblings.take_snapshot())
    siblings.note("1 host(s) of the job left with a notice", now=100.0)
    assert [True, False] == [siblings.take_snapshot(), siblings.take_snapshot()]  # once per note
    raised = siblings.hazard(now=699.0)
    assert (SIBLING_FACTOR, ("1 host(s) of the job left with a notice",)) == (raised.factor, raised.reasons)
    host = Hazard(2.0, ("host_degraded from host: swap",))
    assert Hazard(SIBLING_FACTOR, (*host.reasons, *raised.reasons)) == combined(host, raised)
    assert Hazard() == siblings.hazard(now=700.0)  # held ten minutes, then relaxed
    assert Hazard() == combined()


def test_the_pools_of_the_hosts_that_left_are_avoided_for_as_long_as_the_hazard_holds() -> None:
    siblings = Siblings(hold_s=600)
    siblings.note("1 host(s) of the job left with a notice", ["aws/p5.48xlarge/us-east-1a/spot"], now=100.0)
    siblings.note("1 host(s) of the job left with a notice", [], now=300.0)  # a pool not known: nothing added
    assert frozenset({"aws/p5.48xlarge/us-east-1a/spot"}) == siblings.pools(now=699.0)
    assert frozenset() == siblings.pools(now=700.0)
    assert SIBLING_FACTOR == siblings.hazard(now=700.0).factor  # the second notice holds until 900
    assert Hazard() == siblings.hazard(now=900.0)


def test_steps_between_refuses_a_rule_below_one_step() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        steps_between(0, 1.0)


async def job_entry(host: Any) -> dict[str, Any]:
    """The job's entry in the ``jobs`` section of the host's agent's status (the one job there)."""
    _, doc = await http_json(host.socket, "GET", "/v1/status")
    [entry] = doc["jobs"].values()
    return dict(entry)


async def test_a_snapshot_rate_report_is_checked_and_shown_in_status(tmp_path: Path) -> None:
    """The agent takes ``snapshot_rate`` reports (raised, relaxed) into the jobs section; one without a
    usable ``rate.every`` is refused with 400 naming it."""
    client = {"job": "llm", "rank": 0}
    async with running_agent(tmp_path) as agent:
        sock = agent.config.socket
        for every in (None, 0, "10"):
            rate = {} if every is None else {"every": every}
            status, body = await http_json(
                sock,
                "POST",
                "/v1/reports",
                {"kind": "snapshot_rate", "phase": "raised", "rate": rate, "client": client},
            )
            assert (400, True) == (status, "rate.every" in str(body)), body
        raised = {"every": 7, "usual": 20, "factor": 8.0, "reason": "host_degraded from host"}
        status, _ = await http_json(
            sock,
            "POST",
            "/v1/reports",
            {"kind": "snapshot_rate", "phase": "raised", "step": 40, "rate": raised, "client": client},
        )
        assert status < 300
        _, doc = await http_json(sock, "GET", "/v1/status")
    entry = doc["jobs"]["llm"]
    assert (None, 7, "raised") == (entry["world_size"], entry["snapshots_every"], entry["last"])
    assert (
        entry["history"][-1]["what"]
        == "snapshots every 7 steps instead of 20 (hazard x8: host_degraded from host)"
    )
    assert "Job llm: snapshots every 7 steps instead of 20" in format_status(doc)


@pytest.mark.slow
@pytest.mark.torch_mp
@pytest.mark.timeout(300)
@pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed")
async def test_a_degraded_gpu_on_one_host_halves_the_whole_jobs_snapshot_interval_until_it_clears(
    tmp_path: Path,
) -> None:
    """Two hosts, a snapshot every 20 steps; a gpu_degraded drill on host 1 (no checkpoint: not a trigger):
    every rank says snapshots now come every 10 steps (factor 4), and they do; the drill cleared, every 20 again."""
    args = ("--steps", "100000", "--step-time", "0.02", "--snapshot-every", "20")
    async with hosts(2) as two:
        runs = await train(two, tmp_path / "ckpt", *args)
        try:
            for run in runs:
                while len(run.of("snapshot")) < 2:
                    await run.until_more(timeout=120)
            status, body = await http_json(
                two[1].socket, "POST", "/v1/drills", {"kind": "gpu_degraded", "in_s": 600}
            )
            assert status == 201, body
            for run in runs:
                while not [e for e in run.of("snapshot") if e["hazard"] == 4.0][2:]:
                    await run.until_more(timeout=120)
            raised = [e for e in runs[0].of("snapshot_rate") if e["hazard"] == 4.0]
            assert raised and raised[0]["every"] == 10, runs[0].of("snapshot_rate")
            assert (
                raised[0]["reasons"] == []
            )  # host 0 has no notice of its own: host 1's raised the job's rate
            [mine] = [e for e in runs[1].of("snapshot_rate") if e["hazard"] == 4.0]
            assert mine["reasons"] == ["gpu_degraded drill from drill: drill: gpu_degraded"], mine
            steps = [e["step"] for e in runs[0].of("snapshot") if e["hazard"] == 4.0]
            assert {b - a for a, b in itertools.pairwise(steps)} == {10}, steps
            # Each host's agent heard it: status (and so preemptd watch) and the journal say why.
            said = [await job_entry(host) for host in two]
            assert [("raised", 10)] * 2 == [(e["last"], e["snapshots_every"]) for e in said], said
            assert said[0]["history"][-1]["what"] == "snapshots every 10 steps instead of 20 (hazard x4)"
            assert said[1]["history"][-1]["what"] == (
                "snapshots every 10 steps instead of 20 (hazard x4: gpu_degraded drill from drill: drill: gpu_degraded)"
            )
            status, _ = await http_json(two[1].socket, "DELETE", f"/v1/drills/{body['notice']['id']}")
            assert status == 200
            for run in runs:
                while not [e for e in run.of("snapshot_rate") if e["hazard"] == 1.0]:
                    await run.until_more(timeout=120)
                while len([e for e in run.of("snapshot") if e["hazard"] == 1.0]) < 4:
                    await run.until_more(timeout=120)
            relaxed = [e["step"] for e in runs[0].of("snapshot") if e["hazard"] == 1.0][-2:]
            assert relaxed[1] - relaxed[0] == 20, relaxed
            again = await job_entry(two[1])
            assert ("relaxed", "snapshots every 20 steps again") == (
                again["last"],
                again["history"][-1]["what"],
            )
        finally:
            for run in runs:
                if run.proc.returncode is None:
                    run.proc.kill()
                    await run.proc.wait()


__all__ = ["HostRun"]


def test_the_advised_steps_between_snapshots_are_read_only_from_two_level_advice() -> None:
    from agent.client.reporting import advised_snapshot_steps

    advice = {"two_level": {"levels": 2, "peer": {"steps": 40, "interval_s": 12.0}}}
    assert 40 == advised_snapshot_steps(advice)
    assert None is advised_snapshot_steps({"two_level": {"levels": 1, "peer": None}})
    for steps in (None, 0, True, 2.5, "40"):
        assert None is advised_snapshot_steps({"two_level": {"levels": 2, "peer": {"steps": steps}}})
    assert None is advised_snapshot_steps(None)
    assert None is advised_snapshot_steps({"interval_s": 600})


@pytest.mark.skipif(not HAS_TORCH, reason="torch is not installed")
def test_the_coordinator_takes_the_advised_steps_between_snapshots_over_its_rule(tmp_path: Path) -> None:
    """Until the agent advises K, snapshots come every ``every`` steps; then every K (÷ √hazard as always)."""
    from agent.client.reporting import CheckpointSchedule
    from agent.client.torch import Coordinator

    schedule = CheckpointSchedule(600.0, tmp_path / "none.sock", use_advice=False)
    coordinator = Coordinator(None, schedule)
    coordinator.check(1)
    assert (None, [4, 8]) == (
        coordinator.advised_every,
        [s for s in range(1, 10) if coordinator.snapshot_due(s, 4)],
    )
    schedule.advice = {"two_level": {"levels": 2, "peer": {"steps": 3}}}
    coordinator.check(10)
    assert (3, [11, 14, 17]) == (
        coordinator.advised_every,
        [s for s in range(10, 19) if coordinator.snapshot_due(s, 4)],
    )
