"""``preemptd advise --plot``: expected waste against the checkpoint interval, with the optimum and the current
interval marked. matplotlib is an optional extra (``preemptd[plot]``), imported only here and only when asked.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from agent.advisor import math as cm
from agent.advisor.advice import Inputs, advised_interval, waste_at
from agent.core.files import replace_file


class PlotUnavailable(RuntimeError):
    """matplotlib is not installed."""


def _unit(seconds: float) -> tuple[float, str]:
    if seconds < 120:
        return 1.0, "s"
    if seconds < 10 * 3600:
        return 60.0, "min"
    return 3600.0, "h"


def plot_waste(path: Path, inputs: Inputs, title: str | None = None, points: int = 400) -> Path:
    """Write a PNG of waste (percent of wall time) against τ and return its path (a link there is replaced,
    not followed)."""
    plt = _pyplot()
    best = advised_interval(inputs)
    scale, unit = _unit(best)
    high = max(best * 4.0, (inputs.current_s or 0.0) * 1.3)
    low = best / 10.0
    taus = [low + (high - low) * i / (points - 1) for i in range(points)]
    wastes = [100.0 * waste_at(inputs, t) for t in taus]
    figure, axes = plt.subplots(figsize=(8, 4.8), dpi=100)
    try:
        _curves(axes, inputs, taus, wastes, scale)
        best_waste = 100.0 * waste_at(inputs, best)
        _mark(axes, best, best_waste, scale, "tab:green", "o", f"optimum {best / scale:.1f} {unit}")
        if inputs.current_s:
            current_waste = 100.0 * waste_at(inputs, inputs.current_s)
            label = f"current {inputs.current_s / scale:.1f} {unit}"
            _mark(axes, inputs.current_s, current_waste, scale, "tab:red", "s", label)
        top = max([*wastes[len(wastes) // 2 :], best_waste * 3.0])
        axes.set_ylim(0.0, min(100.0, top))
        axes.set_xlim(0.0, high / scale)
        axes.set_xlabel(f"compute between checkpoints τ ({unit})")
        axes.set_ylabel("wasted wall time (%)")
        axes.set_title(
            title
            or f"δ = {inputs.save_s / 60:.1f} min, M = {inputs.mtbp_lost_s / 3600:.2f} h, R = {inputs.restart_s / 60:.1f} min"
        )
        axes.grid(True, alpha=0.3)
        axes.legend(loc="upper right")
        figure.tight_layout()
        buffer = io.BytesIO()
        figure.savefig(buffer, format="png")
    finally:
        plt.close(figure)
    replace_file(path, buffer.getvalue())
    return path


def _pyplot() -> Any:
    """matplotlib's pyplot, rendering to files only; PlotUnavailable when matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError as exc:
        raise PlotUnavailable(
            "--plot needs matplotlib, which is not installed: pip install 'preemptd[plot]'"
        ) from exc
    matplotlib.use("Agg", force=True)  # no display: render to a file only
    import matplotlib.pyplot as plt

    return plt


def _curves(axes: Any, inputs: Inputs, taus: list[float], wastes: list[float], scale: float) -> None:
    """The exact model's waste and the first-order one's against τ (in units of ``scale`` seconds)."""
    axes.plot([t / scale for t in taus], wastes, color="tab:blue", label="expected waste (exact model)")
    first = [
        100.0 * cm.waste_first_order(t, inputs.save_s, inputs.mtbp_lost_s, inputs.restart_s) for t in taus
    ]
    axes.plot(
        [t / scale for t in taus],
        first,
        color="tab:gray",
        linestyle="--",
        linewidth=1,
        label="first order, work-losing interruptions only",
    )


def _mark(axes: Any, tau: float, waste: float, scale: float, color: str, marker: str, label: str) -> None:
    """A marked interval: a dotted line at ``tau`` and a point at its ``waste``, labelled with it."""
    axes.axvline(tau / scale, color=color, linestyle=":", linewidth=1)
    axes.plot([tau / scale], [waste], marker, color=color, label=f"{label}: {waste:.1f} %")
