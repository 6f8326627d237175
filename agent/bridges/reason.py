"""The text a scheduler bridge leaves on the node it drains: who drained it, for what notice, from which
source, until when. Administrators read it in ``sinfo -R`` or ``ray list nodes``; the Slurm bridge also
compares it to decide whether a drain is still the agent's own."""

from __future__ import annotations

from agent.notice import Notice, format_time

# Every reason the agent writes starts with this, so that an administrator sees who drained the node.
REASON_PREFIX = "preemptd:"


def drain_reason(notice: Notice) -> str:
    """``preemptd: termination from aws, deadline 2026-12-03T07:40:00Z (notice aws-…)``; drills say so."""
    deadline = format_time(notice.deadline) if notice.deadline else "none"
    drill = " drill" if notice.drill else ""
    return (
        f"{REASON_PREFIX} {notice.kind.value}{drill} from {notice.source}, deadline {deadline} "
        f"(notice {notice.id})"
    )
