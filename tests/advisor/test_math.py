"""The advisor's formulas against the reference table, Daly's own check values and scipy."""

from __future__ import annotations

import math

import pytest

from agent.advisor import math as cm

MIN = 60.0
HOUR = 3600.0


# --- the reference table (shared/reference/checkpoint-math.md), δ = 4 min -------------------------------

REFERENCE = [
    # MTBP, Young, √(2δM) - δ, Daly higher order, efficiency of the exact model at its optimum (R = 0)
    (360.0, 53.7, 49.7, 51.0, 85.8),
    (90.0, 26.8, 22.8, 24.2, 73.0),
]


@pytest.mark.parametrize(("mtbp_min", "young", "first", "higher", "eff"), REFERENCE)
def test_young_reproduces_reference_table(
    mtbp_min: float, young: float, first: float, higher: float, eff: float
) -> None:
    assert young == round(cm.young(4 * MIN, mtbp_min * MIN) / MIN, 1)


@pytest.mark.parametrize(("mtbp_min", "young", "first", "higher", "eff"), REFERENCE)
def test_daly_first_order_reproduces_reference_table(
    mtbp_min: float, young: float, first: float, higher: float, eff: float
) -> None:
    assert first == round(cm.daly_first_order(4 * MIN, mtbp_min * MIN) / MIN, 1)


@pytest.mark.parametrize(("mtbp_min", "young", "first", "higher", "eff"), REFERENCE)
def test_daly_higher_order_reproduces_reference_table(
    mtbp_min: float, young: float, first: float, higher: float, eff: float
) -> None:
    assert higher == round(cm.daly_higher_order(4 * MIN, mtbp_min * MIN) / MIN, 1)


@pytest.mark.parametrize(("mtbp_min", "young", "first", "higher", "eff"), REFERENCE)
def test_exact_model_efficiency_at_the_articles_interval_reproduces_reference_table(
    mtbp_min: float, young: float, first: float, higher: float, eff: float
) -> None:
    """The table's efficiency is the exact model's at the article's τ = √(2δM) - δ (see docs/advisor.md)."""
    delta, mtbp = 4 * MIN, mtbp_min * MIN
    assert eff == round(100 * cm.efficiency(cm.daly_first_order(delta, mtbp), delta, mtbp), 1)


@pytest.mark.parametrize(("mtbp_min", "eff"), [(360.0, 85.8), (90.0, 73.1)])
def test_exact_model_efficiency_at_the_exact_optimum(mtbp_min: float, eff: float) -> None:
    """At the exact optimum M = 90 min gives 73.07 %, 0.03 points above the table's 73.0 % (flat optimum)."""
    delta, mtbp = 4 * MIN, mtbp_min * MIN
    assert eff == round(100 * cm.efficiency(cm.exact_interval(delta, mtbp), delta, mtbp), 1)


def test_article_checkpoint_share_at_90_minutes() -> None:
    """4/22.8 = 17.5 % of compute time; 4/26.8 = 14.9 % of wall-clock without failures; total waste ≈ 27 %."""
    tau = cm.daly_first_order(4 * MIN, 90 * MIN)
    assert (
        round(100 * 4 * MIN / tau, 1),
        round(100 * 4 * MIN / (tau + 4 * MIN), 1),
        round(100 * cm.waste(cm.exact_interval(4 * MIN, 90 * MIN), 4 * MIN, 90 * MIN), 0),
    ) == (17.5, 14.9, 27.0)


def test_notice_aware_example_24h() -> None:
    """δ = 4 min and unannounced M = 24 h: τ ≈ 105 min, first-order minimum waste √(2δ/M) ≈ 7.5 %."""
    delta, mtbp = 4 * MIN, 24 * HOUR
    assert (
        round(cm.exact_interval(delta, mtbp) / MIN),
        round(100 * math.sqrt(2 * delta / mtbp), 1),
    ) == (105, 7.5)


# --- Daly (2006): δ = 5 min, R = 10 min ---------------------------------------------------------------

DALY = [(24 * HOUR, 117.0, 0), (6 * HOUR, 57.0, 0), (15 * MIN, 9.1, 1)]


@pytest.mark.parametrize(("mtbp", "expected_min", "digits"), DALY)
def test_daly_check_values_from_higher_order_formula(mtbp: float, expected_min: float, digits: int) -> None:
    assert expected_min == round(cm.daly_higher_order(5 * MIN, mtbp) / MIN, digits)


@pytest.mark.parametrize(("mtbp", "expected_min", "digits"), DALY[:2])
def test_daly_check_values_from_exact_optimum_when_m_is_large(
    mtbp: float, expected_min: float, digits: int
) -> None:
    assert expected_min == round(cm.exact_interval(5 * MIN, mtbp) / MIN, digits)


def test_daly_check_value_at_15_minutes_is_the_higher_order_one_not_the_exact_one() -> None:
    """At M = 15 min the exact optimum is 9.17 min (9.2); Daly's 9.1 is his higher-order formula's 9.14."""
    assert (
        round(cm.exact_interval(5 * MIN, 15 * MIN) / MIN, 1),
        round(cm.daly_higher_order(5 * MIN, 15 * MIN) / MIN, 1),
    ) == (9.2, 9.1)


def test_restart_time_does_not_move_the_optimum() -> None:
    delta, mtbp, tau = 5 * MIN, 6 * HOUR, cm.exact_interval(5 * MIN, 6 * HOUR)
    assert all(
        cm.efficiency(tau, delta, mtbp, restart=10 * MIN)
        > cm.efficiency(tau * f, delta, mtbp, restart=10 * MIN)
        for f in (0.99, 1.01)
    )


def test_restart_time_scales_the_waste_by_exp_r_over_m() -> None:
    delta, mtbp, tau = 5 * MIN, 6 * HOUR, 50 * MIN
    ratio = cm.expected_wall_time(tau, delta, mtbp, restart=10 * MIN) / cm.expected_wall_time(
        tau, delta, mtbp
    )
    assert ratio == pytest.approx(math.exp(10 / 360), rel=1e-12)


def test_higher_order_is_m_when_delta_exceeds_twice_m() -> None:
    assert cm.daly_higher_order(30.0, 10.0) == 10.0


# --- Lambert W and the exact optimum -----------------------------------------------------------------

LAMBERT_POINTS = [-0.3678794, -0.3678, -0.36, -0.3, -0.1, -1e-6, 1e-9, 0.2, 1.0, math.e, 3.0, 10.0, 1e3, 1e12]


@pytest.mark.parametrize("x", LAMBERT_POINTS)
def test_lambert_w0_matches_scipy(x: float) -> None:
    special = pytest.importorskip("scipy.special")
    assert float(special.lambertw(x).real) == pytest.approx(cm.lambert_w0(x), rel=1e-12, abs=1e-15)


@pytest.mark.parametrize("distance", [1e-12, 1e-9, 1e-6, 1e-3])
def test_lambert_w0_near_the_branch_point_solves_its_equation(distance: float) -> None:
    """Near -1/e W₀ is ill-conditioned; check the residual w·e^w - x and agreement with scipy to 1e-9."""
    special = pytest.importorskip("scipy.special")
    x = -cm.INV_E * math.exp(-distance)
    w = cm.lambert_w0(x)
    assert (w * math.exp(w) - x) == pytest.approx(0.0, abs=1e-16)
    assert float(special.lambertw(x).real) == pytest.approx(w, rel=1e-9)


def test_lambert_w0_is_minus_one_at_the_branch_point() -> None:
    assert cm.lambert_w0(-cm.INV_E) == -1.0


def test_lambert_w0_rejects_values_below_minus_one_over_e() -> None:
    with pytest.raises(ValueError, match="-1/e"):
        cm.lambert_w0(-0.5)


@pytest.mark.parametrize("ratio", [1e-6, 1e-3, 0.0111, 0.1, 1.0, 3.0])
def test_exact_interval_matches_scipy_lambert_w(ratio: float) -> None:
    special = pytest.importorskip("scipy.special")
    mtbp = 3600.0
    expected = mtbp * (1.0 + float(special.lambertw(-math.exp(-(1.0 + ratio))).real))
    assert expected == pytest.approx(cm.exact_interval(ratio * mtbp, mtbp), rel=1e-8)


@pytest.mark.parametrize("ratio", [1e-4, 0.0111, 0.2, 2.0])
def test_exact_interval_is_the_numerical_minimum_of_the_waste(ratio: float) -> None:
    optimize = pytest.importorskip("scipy.optimize")
    mtbp = 1.0
    found = optimize.minimize_scalar(
        lambda t: cm.waste(t, ratio, mtbp), bounds=(1e-6, 5.0), method="bounded", options={"xatol": 1e-12}
    )
    assert float(found.x) == pytest.approx(cm.exact_interval(ratio, mtbp), rel=1e-4)


def test_exact_interval_tends_to_daly_higher_order_when_delta_is_small() -> None:
    delta, mtbp = 1.0, 1e6
    assert cm.daly_higher_order(delta, mtbp) == pytest.approx(cm.exact_interval(delta, mtbp), rel=1e-9)


def test_first_order_waste_minimum_is_sqrt_two_delta_over_m() -> None:
    delta, mtbp = 4 * MIN, 24 * HOUR
    best = cm.waste_first_order(cm.young(delta, mtbp) - delta, delta, mtbp)
    assert math.sqrt(2 * delta / mtbp) == pytest.approx(best, rel=1e-12)


# --- the notice-aware model --------------------------------------------------------------------------


def test_mixed_model_without_announced_interruptions_is_dalys_model() -> None:
    args = (50 * MIN, 4 * MIN, 6 * HOUR)
    assert cm.efficiency(*args, restart=7 * MIN) == pytest.approx(
        cm.efficiency_mixed(*args, None, restart=7 * MIN), rel=1e-13
    )


def test_mixed_model_without_interruptions_only_pays_checkpoints() -> None:
    assert pytest.approx(cm.efficiency_mixed(90.0, 10.0, None, None)) == 0.9


def test_announced_interruptions_waste_less_than_the_same_number_of_lost_ones() -> None:
    tau, delta = 50 * MIN, 4 * MIN
    all_lost = cm.efficiency_mixed(tau, delta, 3 * HOUR, None)
    half_announced = cm.efficiency_mixed(tau, delta, 6 * HOUR, 6 * HOUR)
    assert half_announced > all_lost


def test_mixed_optimum_equals_exact_optimum_without_announced_interruptions() -> None:
    assert cm.exact_interval(240.0, 21600.0) == cm.optimal_interval_mixed(240.0, 21600.0, None)


def test_mixed_optimum_is_the_numerical_maximum_of_the_mixed_efficiency() -> None:
    optimize = pytest.importorskip("scipy.optimize")
    args = (240.0, 6 * HOUR, 2 * HOUR)
    costs = {"restart": 300.0, "emergency_delta": 60.0}
    found = optimize.minimize_scalar(
        lambda t: -cm.efficiency_mixed(t, *args, **costs),
        bounds=(60.0, 20000.0),
        method="bounded",
        options={"xatol": 1e-6},
    )
    assert float(found.x) == pytest.approx(cm.optimal_interval_mixed(*args, **costs), rel=1e-4)


@pytest.mark.parametrize(("delta", "mtbp"), [(0.0, 10.0), (-1.0, 10.0), (1.0, 0.0), (1.0, math.nan)])
def test_formulas_reject_nonpositive_inputs(delta: float, mtbp: float) -> None:
    with pytest.raises(ValueError, match="positive"):
        cm.young(delta, mtbp)


def test_waste_of_an_absurdly_long_interval_is_total_not_an_overflow() -> None:
    assert cm.waste(30 * 86400.0, 240.0, 3600.0) == 1.0


def test_mixed_optimum_is_the_shortest_near_best_interval_when_the_efficiency_is_flat() -> None:
    """Announced interruptions every 12 min, losses every 1000 h: beyond ~6 h the efficiency is flat to 1e-10;
    the advice is the shortest interval within FLAT_TOLERANCE of the best efficiency."""
    args = (60.0, 1000 * HOUR, 0.2 * HOUR)
    tau = cm.optimal_interval_mixed(*args, emergency_delta=10.0)
    best = max(cm.efficiency_mixed(t, *args, emergency_delta=10.0) for t in (1e4, 3e4, 1e5, 1e6))
    assert (
        best - cm.efficiency_mixed(tau, *args, emergency_delta=10.0) <= cm.FLAT_TOLERANCE * 1.001,
        best - cm.efficiency_mixed(0.99 * tau, *args, emergency_delta=10.0) > cm.FLAT_TOLERANCE,
    ) == (True, True)
