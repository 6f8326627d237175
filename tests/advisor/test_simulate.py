"""The Monte Carlo simulator agrees with the analytical waste (seeded, a fraction of a second each)."""

from __future__ import annotations

import pytest

from agent.advisor import math as cm
from agent.advisor.simulate import simulate

DELTA, MTBP = 240.0, 5400.0  # δ = 4 min, M = 90 min: the reference table's harder row


def test_simulated_waste_brackets_dalys_waste_at_the_optimum() -> None:
    tau = cm.exact_interval(DELTA, MTBP)
    result = simulate(tau, DELTA, MTBP, runs=600, periods_per_run=50, seed=7)
    assert result.ci_low <= cm.waste(tau, DELTA, MTBP) <= result.ci_high


def test_simulated_waste_brackets_dalys_waste_with_restarts() -> None:
    result = simulate(1800.0, DELTA, MTBP, restart=600.0, runs=600, periods_per_run=50, seed=8)
    assert result.ci_low <= cm.waste(1800.0, DELTA, MTBP, restart=600.0) <= result.ci_high


def test_simulated_waste_brackets_the_notice_aware_model() -> None:
    result = simulate(
        1500.0,
        DELTA,
        MTBP,
        announced_share=0.7,
        restart=300.0,
        emergency_delta=60.0,
        runs=600,
        periods_per_run=50,
        seed=9,
    )
    assert (result.agrees, result.announced > 2 * result.lost) == (True, True)


def test_confidence_interval_narrows_with_more_runs() -> None:
    small = simulate(1500.0, DELTA, MTBP, runs=100, periods_per_run=20, seed=1)
    large = simulate(1500.0, DELTA, MTBP, runs=1600, periods_per_run=20, seed=1)
    width = lambda r: r.ci_high - r.ci_low  # noqa: E731
    assert width(large) < width(small) / 2


def test_same_seed_gives_the_same_result() -> None:
    assert simulate(1500.0, DELTA, MTBP, runs=50, seed=3) == simulate(1500.0, DELTA, MTBP, runs=50, seed=3)


def test_every_interruption_announced_loses_no_work() -> None:
    result = simulate(1500.0, DELTA, MTBP, announced_share=1.0, emergency_delta=0.0, runs=50, seed=4)
    assert result.lost == 0


def test_simulation_refuses_unbounded_work() -> None:
    with pytest.raises(ValueError, match="runs"):
        simulate(1500.0, DELTA, MTBP, runs=10**6, periods_per_run=10**6)
