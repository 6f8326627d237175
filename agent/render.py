"""What the command line shows of the agent: the status document and events as readable lines, with every
string from the agent escaped for the terminal. Pure (the clock is a parameter where it matters); the CLI's
``status`` and ``watch`` verbs use it.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from typing import Any

from agent.durations import format_duration

# C0, DEL and C1 control characters, and the bidirectional overrides that reorder what a terminal shows.
_UNPRINTABLE = {
    code: f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"
    for code in (*range(0x20), *range(0x7F, 0xA0), *range(0x202A, 0x202F), *range(0x2066, 0x206A))
}


def printable(text: str) -> str:
    """``text`` with control characters written as escapes (``\\x1b``): what the agent reports (a drill's
    reason, a source's error) comes from other users and must not move the cursor or rewrite the screen."""
    return text.translate(_UNPRINTABLE)


def parse_time(text: str | None) -> datetime | None:
    if not text:
        return None
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def left(deadline: str | None, now: datetime | None = None) -> str:
    when = parse_time(deadline)
    if when is None:
        return "no deadline"
    seconds = (when - (now or datetime.now(timezone.utc))).total_seconds()
    return f"{format_duration(seconds)} left" if seconds > 0 else "deadline passed"


def format_status(doc: dict[str, Any]) -> str:
    agent = doc.get("agent", {})
    lines = [
        f"preemptd {agent.get('version')}  overall: {str(doc.get('overall')).upper()}",
        f"  socket {agent.get('socket')}  cloud {agent.get('cloud') or 'unknown'}"
        + (
            f"  instance {agent['instance'].get('instance_id') or agent['instance']}"
            if agent.get("instance")
            else ""
        ),
        f"  up {format_duration(float(agent.get('uptime_s') or 0))}  state dir {agent.get('state_dir')}"
        + ("" if doc.get("state", {}).get("ok", True) else f"  STATE PROBLEM: {doc['state'].get('error')}"),
    ]
    notices = doc.get("notices") or []
    lines.append(f"Notices ({len(notices)}):" if notices else "Notices: none")
    for n in notices:
        drill = " [drill]" if n.get("drill") else ""
        lines.append(
            f"  {n['kind']:<13} {n['severity']:<8} {n['source']:<8} {left(n.get('deadline')):<16} {n['reason']}{drill}  ({n['id']})"
        )
    sources = doc.get("sources") or {}
    lines.append("Sources:" if sources else "Sources: none")
    for name, health in sources.items():
        extra = (
            f"  last error: {health.get('last_error')}"
            if health.get("state") != "ok" and health.get("last_error")
            else ""
        )
        why = health.get("detail", {}).get("why")
        lines.append(f"  {name:<10} {health.get('state'):<9}{extra}{f'  ({why})' if why else ''}")
    gpus = doc.get("gpus") or []
    if gpus:
        lines.append(f"GPUs: {len(gpus)}")
    subs = doc.get("subscribers", {})
    lines.append(
        f"Subscribers: {subs.get('connected', 0)} connected, {subs.get('disconnected_slow', 0)} dropped for not reading"
    )
    risk = doc.get("flush_risk")
    if isinstance(risk, dict):
        who = ", ".join(f"{k} {v}" for k, v in (risk.get("client") or {}).items())
        outcome = risk.get("outcome") or {}
        lines.append(
            printable(
                f"Flush at risk: step {risk.get('step')} predicted to take {risk.get('predicted_s')} s with "
                f"{risk.get('time_left_s')} s left ({who}); {outcome.get('phase', 'still saving')}"
            )
        )
    conn = doc.get("connections")
    if isinstance(conn, dict):
        fds = conn.get("descriptors") or {}
        lines.append(
            f"Connections: {conn.get('open')} open of {conn.get('max')}, {conn.get('refused')} refused;"
            f" descriptors {fds.get('open')} of {fds.get('limit')}"
        )
    advice = doc.get("advice")
    if isinstance(advice, dict) and advice.get("interval_s"):
        lines.append(f"Advice: checkpoint every {format_duration(float(advice['interval_s']))}")
    return "\n".join(printable(line) for line in lines)


def format_event(doc: dict[str, Any], now: datetime | None = None) -> str:
    """One readable line for an event."""
    stamp = (now or datetime.now(timezone.utc)).astimezone().strftime("%H:%M:%S")
    kind = doc.get("type", "?")
    if kind == "snapshot":
        notices = doc.get("notices") or []
        if not notices:
            return f"{stamp} SNAPSHOT  no active notices"
        return printable(
            f"{stamp} SNAPSHOT  {len(notices)} active: "
            + "; ".join(f"{n['kind']} ({left(n.get('deadline'), now)})" for n in notices)
        )
    notice = doc.get("notice") or {}
    if kind == "ready":
        return printable(
            f"{stamp} READY     {notice.get('kind', '')} {notice.get('id', doc.get('data', {}).get('notice_id'))}: {json.dumps(doc.get('data', {}))}"
        )
    drill = " [drill]" if notice.get("drill") else ""
    deadline = notice.get("deadline")
    when = f"deadline {deadline} ({left(deadline, now)})" if kind != "cleared" and deadline else ""
    return printable(
        f"{stamp} {kind.upper():<9} {notice.get('kind', ''):<13} {notice.get('severity', ''):<8} "
        f"{notice.get('source', ''):<8} {notice.get('reason', '')}{drill}  {when}  [{notice.get('id', '')}]"
    ).rstrip()


def track(active: dict[str, dict[str, Any]], doc: dict[str, Any]) -> None:
    if doc.get("type") == "snapshot":
        active.clear()
        active.update({n["id"]: n for n in doc.get("notices") or []})
    elif doc.get("type") in ("notice", "update") and doc.get("notice"):
        active[doc["notice"]["id"]] = doc["notice"]
    elif doc.get("type") == "cleared" and doc.get("notice"):
        active.pop(doc["notice"]["id"], None)


def countdown(active: dict[str, dict[str, Any]]) -> str:
    parts = []
    for notice in active.values():
        parts.append(f"{notice['kind']}: {left(notice.get('deadline'))}")
    return printable("  >> " + " | ".join(parts))
