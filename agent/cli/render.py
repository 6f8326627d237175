"""What the command line shows of the agent: the status document and events as readable lines, with every
string from the agent escaped for the terminal. Pure (the clock is a parameter where it matters); the CLI's
``status`` and ``watch`` verbs use it.
"""

from __future__ import annotations

import json
import textwrap
import unicodedata
from datetime import datetime, timezone
from typing import Any

from agent.core.durations import format_duration
from agent.core.window import window_lines

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
    saved = doc.get("emergency_save")
    if isinstance(saved, dict):
        lines.append(_emergency_save_line(saved))
    conn = doc.get("connections")
    if isinstance(conn, dict):
        fds = conn.get("descriptors") or {}
        lines.append(
            f"Connections: {conn.get('open')} open of {conn.get('max')}, {conn.get('refused')} refused;"
            f" descriptors {fds.get('open')} of {fds.get('limit')}"
        )
    tier = doc.get("ram_tier")
    if isinstance(tier, dict) and tier.get("enabled"):
        lines.append(_ram_tier_line(tier))
    lines.extend(window_lines(doc.get("window")))
    advice = doc.get("advice")
    if isinstance(advice, dict) and advice.get("interval_s"):
        lines.append(f"Advice: checkpoint every {format_duration(float(advice['interval_s']))}")
    return "\n".join(printable(line) for line in lines)


def _size(value: Any) -> str:
    size = float(value or 0)
    if size < 1024:
        return f"{size:.0f} B"
    unit = "KiB"
    for unit in ("KiB", "MiB", "GiB", "TiB"):  # noqa: B007 (the unit the loop stops at is the one shown)
        size /= 1024
        if size < 1024:
            break
    return f"{size:.1f} {unit}"


def _about(value: Any) -> str:
    return "?" if not isinstance(value, (int, float)) else f"{value:.1f} s"


def _emergency_save_line(saved: dict[str, Any]) -> str:
    """The newest emergency save: where it went, why not the peer tier, predicted and actual, the slack."""
    outcome = f"in {_about(saved.get('duration_s'))}" if saved.get("phase") == "finished" else "FAILED"
    if saved.get("fallback_step") is not None:
        outcome += f", step {saved['fallback_step']} used instead"
    why = f" (fallback: {saved['fallback']})" if saved.get("fallback") else ""
    budget = [f"predicted {_about(saved.get('predicted_s'))}"]
    if saved.get("time_left_s") is not None:
        budget.append(f"{_about(saved.get('time_left_s'))} left")
    if saved.get("slack_s") is not None:
        budget.append(f"slack {_about(saved.get('slack_s'))}")
    return (
        f"Last emergency save: step {saved.get('step')} to {saved.get('tier') or 'durable'}{why} {outcome}; "
        + ", ".join(budget)
    )


def _ram_tier_line(tier: dict[str, Any]) -> str:
    if tier.get("state") != "ready":
        return f"RAM tier: {str(tier.get('state')).upper()}" + (
            f": {tier['error']}" if tier.get("error") else ""
        )
    jobs = tier.get("jobs") or {}
    steps = sum(len(job.get("steps") or []) for job in jobs.values())
    where = f"{tier.get('filesystem')}" + ("" if tier.get("in_ram") else ": NOT RAM")
    return (
        f"RAM tier: {_size(tier.get('used_bytes'))} used of {_size(tier.get('cap_bytes'))}, "
        f"{_size(tier.get('reserved_bytes'))} reserved; {_plural(steps, 'step')} of {_plural(len(jobs), 'job')} "
        f"in {tier.get('path')} ({where})"
    )


WIDTH = 80  # what `preemptd watch` fits its lines into: the classic terminal, and narrow tmux panes
_INDENT = " " * len("HH:MM:SS ")  # continuation lines start under the event's type
_MAX_LINES = 4  # of one wrapped part (a long reason): the rest is elided, `--json` has it all
_MAX_LISTED = 10  # notices in a snapshot (`preemptd status` lists them all)


def _wrap(text: str, width: int, first: str = "", max_lines: int = _MAX_LINES) -> list[str]:
    """``text`` (escaped for the terminal) in lines of at most ``width`` columns, the first starting with
    ``first`` and the rest indented under it."""
    lines = textwrap.wrap(
        printable(text),
        width,
        initial_indent=first or _INDENT,
        subsequent_indent=_INDENT,
        break_on_hyphens=False,
        max_lines=max_lines,
        placeholder=" ...",
    )
    return [piece for line in lines for piece in _fit(line, width)]


def _fit(line: str, width: int) -> list[str]:
    """``line`` cut where it passes ``width`` columns: textwrap counts characters, and a wide (East Asian)
    character takes two columns (a cloud in China may describe its events in Chinese)."""
    if line.isascii():
        return [line]
    pieces, piece, used = [], "", 0
    for char in line:
        size = 2 if unicodedata.east_asian_width(char) in "WF" else 0 if unicodedata.combining(char) else 1
        if used + size > width:
            pieces.append(piece)
            piece, used = _INDENT, len(_INDENT)
        piece += char
        used += size
    return [*pieces, piece]


def _clock(deadline: str | None, now: datetime) -> str:
    """The deadline in local time: the time of day when it is today, else the date too."""
    when = parse_time(deadline)
    if when is None:
        return ""
    local, today = when.astimezone(), now.astimezone()
    # No-break spaces: a wrapped headline keeps the date and time together.
    return local.strftime("%H:%M:%S" if local.date() == today.date() else "%d\u00a0%b\u00a0%H:%M")


def _seconds(value: Any) -> str:
    """A measured duration as a reader wants it: milliseconds below a second, else ``format_duration``."""
    seconds = max(0.0, float(value))
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else format_duration(seconds)


def _names(names: list[Any]) -> str:
    shown = ", ".join(str(name) for name in names[:3])
    return shown + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _plural(count: int, word: str) -> str:
    return f"{count} {word}{'' if count == 1 else 's'}"


def _headline(notice: dict[str, Any], now: datetime) -> str:
    """What a notice is and how long is left: ``termination critical from aws: 1m30s left (12:01:30)``."""
    source = notice.get("source", "?")
    drill = " [drill]" if notice.get("drill") and source != "drill" else ""
    deadline = notice.get("deadline")
    when = f"{left(deadline, now)} ({_clock(deadline, now)})" if deadline else "no deadline"
    return f"{notice.get('kind', '?')} {notice.get('severity', '?')} from {source}{drill}: {when}"


def _body(notice: dict[str, Any]) -> str:
    """A notice's id (what `preemptd drill --clear` takes) and reason."""
    return f"{notice.get('id', '?')}: {notice.get('reason') or '(no reason given)'}"


def _ready_sentence(data: dict[str, Any]) -> str:
    """Who saved, how long after the notice and how much time was left: the ready event in words."""
    finished = list(data.get("finished") or [])
    failed = list(data.get("failed") or [])
    missing = list(data.get("missing") or [])
    expected = len(data.get("participants") or []) or len(finished) + len(failed) + len(missing)
    took, margin = data.get("notice_to_ready_s"), data.get("margin_s")
    timing = f"{_seconds(took)} after the notice" if isinstance(took, (int, float)) else "after the notice"
    if isinstance(margin, (int, float)):
        timing += f", with {format_duration(margin)} to spare" if margin > 0 else ", past the deadline"
    saved = f"{len(finished)} of {_plural(expected, 'participant')} saved" + (
        f" ({_names(finished)})" if finished else ""
    )
    reason = data.get("reason")
    if reason == "all_participants":
        sentence = f"all {_plural(expected, 'participant')} saved ({_names(finished)}) {timing}"
    elif reason == "no_participants":
        sentence = f"no participant was registered; ready {timing}"
    elif reason == "grace":
        sentence = f"the grace ran out {timing}: {saved}"
    elif reason == "deadline":
        sentence = f"the deadline came too near {timing}: {saved}"
    else:
        sentence = f"ready ({reason}) {timing}: {saved}"
    if failed:
        sentence += f"; failed: {_names(failed)}"
    if missing and reason != "all_participants":
        sentence += f"; missing: {_names(missing)}"
    return sentence + "."


def format_event(doc: dict[str, Any], now: datetime | None = None, width: int = WIDTH) -> str:
    """An event as lines of at most ``width`` columns: a headline (time, type, what and how long is
    left), then the notice's id and reason, or for ``ready`` a sentence saying who saved and how early."""
    now = now or datetime.now(timezone.utc)
    stamp = now.astimezone().strftime("%H:%M:%S")
    kind = str(doc.get("type", "?"))
    first = printable(f"{stamp} {kind.upper():<8} ")
    notice = doc.get("notice") or {}
    if kind == "snapshot":
        notices = doc.get("notices") or []
        lines = [f"{first}{_plural(len(notices), 'active notice') if notices else 'no active notices'}"]
        for item in notices[:_MAX_LISTED]:
            lines += _wrap(_headline(item, now), width, max_lines=2)
            lines += _wrap(_body(item), width, _INDENT + "  ", max_lines=1)
        if len(notices) > _MAX_LISTED:
            lines.append(f"{_INDENT}... and {len(notices) - _MAX_LISTED} more (preemptd status lists them)")
        return "\n".join(lines)
    if kind == "ready":
        data = dict(doc.get("data") or {})
        notice_id = notice.get("id") or data.get("notice_id", "?")
        return "\n".join(
            _wrap(f"{notice.get('kind', 'notice')} {notice_id}: {_ready_sentence(data)}", width, first)
        )
    if not notice:  # an event type this CLI does not know: show it rather than nothing
        return "\n".join(_wrap(json.dumps(doc, sort_keys=True), width, first))
    if kind == "cleared":
        why = (notice.get("detail") or {}).get("cleared_reason") or "no longer reported"
        headline = (
            f"{notice.get('kind', '?')} {notice.get('severity', '?')} from {notice.get('source', '?')}: {why}"
        )
    else:
        headline = _headline(notice, now)
    return "\n".join(_wrap(headline, width, first, max_lines=2) + _wrap(_body(notice), width))


def note(text: str, width: int = WIDTH) -> str:
    """A remark of the CLI's own between the events (``(waiting for the agent ...)``), wrapped like them."""
    return "\n".join(_wrap(f"{text})", width, "(", max_lines=3))


def track(active: dict[str, dict[str, Any]], doc: dict[str, Any]) -> None:
    if doc.get("type") == "snapshot":
        active.clear()
        active.update({n["id"]: n for n in doc.get("notices") or []})
    elif doc.get("type") in ("notice", "update") and doc.get("notice"):
        active[doc["notice"]["id"]] = doc["notice"]
    elif doc.get("type") == "cleared" and doc.get("notice"):
        active.pop(doc["notice"]["id"], None)


def countdown(active: dict[str, dict[str, Any]], width: int = WIDTH) -> str:
    """The live line under the events (rewritten in place, so it must never wrap): time left per notice."""
    parts = [f"{notice.get('kind', '?')}: {left(notice.get('deadline'))}" for notice in active.values()]
    prefix = "  >> "
    return prefix + textwrap.shorten(
        printable(" | ".join(parts)), width - 1 - len(prefix), placeholder=" ..."
    )
