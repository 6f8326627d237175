"""``preemptd status`` shows the window (agent/cli/render.py)."""

from __future__ import annotations

from agent.cli.render import format_status
from agent.window.effective import Flush, build_window
from tests.window.support import LEAD, NOW, TORCHRUN


def test_preemptd_status_shows_the_window() -> None:
    doc = build_window([LEAD], [TORCHRUN], Flush(45.0, "deadline budget"), NOW)
    shown = format_status({"agent": {}, "window": doc})
    assert "  termination  30s (torchrun binds): TOO SHORT  [cloud 2m00s, torchrun 30s]" in shown.splitlines()
    assert "window_too_short: termination: the flush (45s) outlasts torchrun (30s)" in shown
