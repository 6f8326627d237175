"""The Slurm bridge's table, ``[actions.slurm]``, with the bounds each value is checked against when the
configuration loads. docs/slurm.md describes each key.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from msgspec import Meta

from agent.bridges.slurm_commands import parse_signal
from agent.config import NoticeKindName, SeverityName

# A pause between two tries: short enough to act soon after the controller is back, never so short that a
# failing controller is asked in a busy loop.
Pause = Annotated[float, Meta(ge=0.1, le=3600, description="seconds from 0.1 to 3600")]
# How long to go on beyond the deadline: up to a week.
Span = Annotated[float, Meta(ge=0, le=7 * 86400, description="seconds from 0 to 604800")]


@dataclass(frozen=True)
class SlurmConfig:
    """``[actions.slurm]``."""

    enabled: bool = False
    # The node's name in Slurm; empty: the node whose NodeHostname or NodeAddr is this host's.
    node: str = ""
    kinds: tuple[NoticeKindName, ...] = ("termination",)
    min_severity: SeverityName = "info"
    # Off: a drill's requeue stops and restarts real jobs and cannot be undone by clearing the drill.
    drills: bool = False
    requeue: bool = True
    # A signal for the jobs' steps (``"USR1"``, ``"SIGTERM"``, a number); empty: none.
    signal: str = ""
    # When to send it: at the notice (programs without the client get the whole window) or with the requeue.
    signal_at: Literal["notice", "ready"] = "notice"
    # Act this many seconds before the deadline at the latest, even if the host is not ready yet.
    margin_s: Span = 30.0
    # After ready, how long a running job may take to exit on its own (75) before it is requeued running.
    stop_wait_s: Span = 15.0
    resume: bool = True
    bin_dir: str = ""
    slurm_conf: str = ""
    # One call: its timeout and how often it is repeated at once (reads only; a change is made once per try).
    timeout_s: Pause = 10.0
    retries: Annotated[int, Meta(ge=0, le=10, description="a whole number from 0 to 10")] = 2
    # A failing step is tried again after retry_first_s, doubling up to retry_max_s, until the deadline.
    retry_first_s: Pause = 1.0
    retry_max_s: Pause = 30.0
    # How long beyond the deadline (or the clear) the requeue of a stopped job and the resume go on.
    persist_s: Span = 3600.0
    history_size: Annotated[int, Meta(ge=1, le=10_000, description="a whole number from 1 to 10000")] = 50

    def __post_init__(self) -> None:
        # Checked when the file is loaded, so --print-config, start-up and a reload refuse an unknown signal.
        parse_signal(self.signal)
