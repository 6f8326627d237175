"""The status document (``GET /v1/status``, ``preemptd status``) and the one-line status systemd shows,
assembled from what each part reports of itself. Pure: no I/O, no clock of its own.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any

from agent.core.notice import Notice, Severity
from agent.core.source_health import HealthBook
from agent.core.subscribers import Hub

SCHEMA = 1


def overall(notices: tuple[Notice, ...], state_ok: bool, health: HealthBook) -> str:
    """``critical`` with a critical notice; ``warning`` with any notice, no persistence or a degraded
    source; ``ok`` otherwise."""
    if any(n.severity is Severity.CRITICAL for n in notices):
        return "critical"
    if notices or not state_ok or health.degraded():
        return "warning"
    return "ok"


def document(
    now: datetime,
    agent: Mapping[str, Any],
    notices: tuple[Notice, ...],
    health: HealthBook,
    sources: tuple[dict[str, Any], list[Any]],
    hub: Hub,
    connections: Mapping[str, Any],
    state: tuple[bool, str | None],
    sections: Mapping[str, Callable[[], Any]],
) -> dict[str, Any]:
    """The whole document. ``agent``: the agent's own fields; ``sources``: each source's status and every
    GPU (agent.sources.runner); ``state``: whether persistence works and why not; ``sections``: the
    components' sections, each computed now (one that fails shows its error, the rest still show)."""
    doc: dict[str, Any] = {
        "schema": SCHEMA,
        "agent": dict(agent),
        "overall": overall(notices, state[0], health),
        "notices": [n.to_json(now) for n in notices],
        "sources": sources[0],
        "gpus": sources[1],
        "subscribers": {
            "connected": len(hub),
            "max": hub.max_subscribers,
            "disconnected_slow": hub.kicked_total,
        },
        "events": {"seq": hub.seq, "published": dict(hub.published_total)},
        "connections": dict(connections),
        "state": {"ok": state[0], "error": state[1]},
        "advice": None,
    }
    for name, fn in sections.items():
        try:
            doc[name] = fn()
        except Exception as exc:
            doc[name] = {"error": repr(exc)}
    return doc


def systemd_line(notices: tuple[Notice, ...], subscribers: int, now: datetime) -> str:
    """What ``systemctl status`` shows next to the unit (sd_notify STATUS=)."""
    if notices:
        first = notices[0]
        left = first.seconds_left(now)
        text = f"{len(notices)} active notice(s): {first.kind.value}" + (
            f", {left:.0f}s left" if left is not None else ""
        )
    else:
        text = "no active notices"
    return f"{text}; {subscribers} subscriber(s)"
