"""``preemptd report --png`` / ``--html``: where each job's GPU-hours went (useful, checkpointing, flushing,
redone, restarting), as stacked bars. matplotlib is the advisor's optional extra (``preemptd[plot]``),
imported only here and only when asked."""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Any, BinaryIO

from agent.advisor.plot import PlotUnavailable
from agent.core.files import replace_file
from agent.core.screen import when

_PARTS = (
    ("useful_gpu_hours", "tab:green"),
    ("checkpoint_gpu_hours", "tab:blue"),
    ("flush_gpu_hours", "tab:cyan"),
    ("redone_gpu_hours", "tab:red"),
    ("restart_gpu_hours", "tab:orange"),
)


def _png(doc: dict[str, Any]) -> bytes:
    buffer = io.BytesIO()
    _draw(buffer, doc)
    return buffer.getvalue()


def _draw(target: BinaryIO, doc: dict[str, Any]) -> None:
    try:
        import matplotlib
    except ImportError as exc:
        raise PlotUnavailable(
            "plots need matplotlib, which is not installed: pip install 'preemptd[plot]'"
        ) from exc
    matplotlib.use("Agg", force=True)  # no display: render to a file only
    import matplotlib.pyplot as plt

    jobs = doc["jobs"] or {"(none)": doc["total"]}
    names = list(jobs)
    figure, axes = plt.subplots(figsize=(max(6.0, 1.2 * len(names) + 3), 4.5), dpi=100)
    try:
        bottom = [0.0] * len(names)
        for key, colour in _PARTS:
            # Every part is a figure of the report, the useful one included (never recomputed here).
            values = [fig[key] or 0.0 for fig in jobs.values()]
            label = key.removesuffix("_gpu_hours").replace("_", " ")
            axes.bar(names, values, bottom=bottom, color=colour, label=label)
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
        axes.set_ylabel("GPU-hours")
        since = when(doc["since"]) if doc.get("since") else "the start of the ledger"
        axes.set_title(f"Where the GPU-hours went since {since}")
        axes.legend(loc="upper right", fontsize="small")
        figure.tight_layout()
        figure.savefig(target, format="png")
    finally:
        plt.close(figure)


def plot_report(path: Path, doc: dict[str, Any]) -> Path:
    """Write the PNG of a report document and return its path (a link there is replaced, not followed)."""
    replace_file(path, _png(doc))
    return path


def plot_data_uri(doc: dict[str, Any]) -> str:
    """The PNG as a ``data:`` URI, for the one-file HTML page."""
    return "data:image/png;base64," + base64.b64encode(_png(doc)).decode("ascii")
