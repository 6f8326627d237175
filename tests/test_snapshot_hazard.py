"""The hazard raises the snapshot rate (issue 38; agent/client/hazard.py): notices that call for no checkpoint
but make an unannounced loss likelier (a rebalance recommendation the trigger policy does not act on, NVML's
degraded signals, host degradation) divide the steps between peer snapshots by √factor, for the whole job, and
the rate relaxes when they clear."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from agent.client.events import Notice, TriggerPolicy
from agent.client.hazard import Hazard, hazard_of, steps_between
from tests.lazy import HAS_TORCH
from tests.support import http_json
from tests.test_evacuate_hosts import HostRun, _train, hosts


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


def test_steps_between_refuses_a_rule_below_one_step() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        steps_between(0, 1.0)


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
        runs = await _train(two, tmp_path / "ckpt", *args)
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
            status, _ = await http_json(two[1].socket, "DELETE", f"/v1/drills/{body['notice']['id']}")
            assert status == 200
            for run in runs:
                while not [e for e in run.of("snapshot_rate") if e["hazard"] == 1.0]:
                    await run.until_more(timeout=120)
                while len([e for e in run.of("snapshot") if e["hazard"] == 1.0]) < 4:
                    await run.until_more(timeout=120)
            relaxed = [e["step"] for e in runs[0].of("snapshot") if e["hazard"] == 1.0][-2:]
            assert relaxed[1] - relaxed[0] == 20, relaxed
        finally:
            for run in runs:
                if run.proc.returncode is None:
                    run.proc.kill()
                    await run.proc.wait()


__all__ = ["HostRun"]
