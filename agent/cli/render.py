"""What the command line shows of the agent: the status document and events as readable lines of at most 80
columns (:mod:`agent.core.screen`), with every string from the agent escaped for the terminal. Pure (the clock
is a parameter where it matters); the CLI's ``status`` and ``watch`` verbs use it.
"""

from __future__ import annotations

import json
import textwrap
from datetime import datetime, timezone
from typing import Any

from agent.core.domain import Domain
from agent.core.screen import WIDTH, duration, keep, parse_time, plural, printable, when, wrap
from agent.window.effective import window_lines

__all__ = ["WIDTH", "countdown", "format_event", "format_status", "left", "note", "parse_time", "printable"]


def left(deadline: str | None, now: datetime | None = None) -> str:
    moment = parse_time(deadline)
    if moment is None:
        return "no deadline"
    seconds = (moment - (now or datetime.now(timezone.utc))).total_seconds()
    return f"{duration(seconds)} left" if seconds > 0 else "deadline passed"


# ----- preemptd status ---------------------------------------------------------------------------------------

_ITEM = "  "  # a row under a heading
_MORE = "    "  # the lines that continue a row
_DETAIL_LINES = 3  # of a source's error or a row's detail: the rest is in `preemptd status --json`


def format_status(doc: dict[str, Any], now: datetime | None = None, width: int = WIDTH) -> str:
    """The status document as lines of at most ``width`` columns."""
    now = now or datetime.now(timezone.utc)
    lines: list[str] = []

    def row(text: str, first: str = _ITEM, indent: str = _MORE, max_lines: int | None = None) -> None:
        lines.extend(wrap(text, first, indent, width, max_lines))

    lines.extend(_agent_lines(doc, width))
    lines.extend(_notices(doc.get("notices") or [], now, width))
    lines.extend(_sources(doc.get("sources") or {}, width))
    gpus = doc.get("gpus") or []
    if gpus:
        lines.append(f"GPUs: {len(gpus)}")
    subs = doc.get("subscribers") or {}
    lines.append(
        f"Subscribers: {subs.get('connected', 0)} connected, "
        f"{subs.get('disconnected_slow', 0)} dropped for not reading"
    )
    risk = doc.get("flush_risk")
    if isinstance(risk, dict):
        row(_flush_risk_line(risk), "")
    saved = doc.get("emergency_save")
    if isinstance(saved, dict):
        row(_emergency_save_line(saved), "")
    conn = doc.get("connections")
    if isinstance(conn, dict):
        row(_connections_line(conn), "")
    tier = doc.get("ram_tier")
    if isinstance(tier, dict) and tier.get("enabled"):
        row(_ram_tier_line(tier), "")
    lines.extend(window_lines(doc.get("window"), width))
    for text in _job_lines(doc.get("jobs")):
        row(text, "")
    advice = doc.get("advice")
    if isinstance(advice, dict) and advice.get("interval_s"):
        lines.append(f"Advice: checkpoint every {duration(float(advice['interval_s']))}")
    return "\n".join(printable(line) for line in lines)


def _job_lines(jobs: Any) -> list[str]:
    """Each job whose ranks reported a change (of membership, of the snapshot rate): its world size now, if
    known, and the latest change."""
    if not isinstance(jobs, dict):
        return []
    lines = []
    for job, entry in jobs.items():
        if not isinstance(entry, dict):
            continue
        history = entry.get("history") or [{}]
        latest = history[-1] if isinstance(history[-1], dict) else {}
        size = f"world size {entry['world_size']}; " if entry.get("world_size") is not None else ""
        lines.append(f"Job {job}: {size}{latest.get('what', '')}")
    return lines


def _agent_lines(doc: dict[str, Any], width: int) -> list[str]:
    """The agent's own lines: its version and overall state, where it listens and runs, its failure domain,
    its uptime, and a problem with its state directory."""
    lines: list[str] = []

    def row(text: str, first: str = _ITEM) -> None:
        lines.extend(wrap(text, first, _MORE, width, None))

    agent = doc.get("agent") or {}
    overall = doc.get("overall")
    name = f"preemptd {agent['version']}" if agent.get("version") else "preemptd"
    row(f"{name}  overall: {str(overall).upper() if overall else 'not reported'}", "")
    where = [f"socket {agent['socket']}" if agent.get("socket") else ""]
    if agent:
        where.append(f"cloud {agent.get('cloud') or 'unknown'}")
    instance = agent.get("instance")
    if isinstance(instance, dict) and instance.get("instance_id"):
        where.append(f"instance {instance['instance_id']}")
    if any(where):
        row(", ".join(part for part in where if part))
    domain = Domain.from_json(agent.get("domain"))
    if domain is not None:  # one line, whatever the cloud said: its fields are bounded, the line is cut
        lines.extend(line[:width] for line in wrap(f"failure domain {domain}", _ITEM, _MORE, width, 1))
    if agent:
        since = [f"up {duration(float(agent.get('uptime_s') or 0))}"]
        if agent.get("state_dir"):
            since.append(f"state dir {agent['state_dir']}")
        row(", ".join(since))
    state = doc.get("state") or {}
    if state.get("ok") is False:
        row(f"STATE PROBLEM: {state.get('error') or 'the state directory cannot be used'}")
    return lines


def _notices(notices: list[dict[str, Any]], now: datetime, width: int) -> list[str]:
    """Each active notice: what it is and how long is left, then its id and reason under it."""
    if not notices:
        return ["Notices: none"]
    lines = [f"Notices ({len(notices)}):"]
    for item in notices:
        lines += wrap(_headline(item, now), _ITEM, _MORE, width, max_lines=2)
        lines += wrap(_body(item), _MORE, _MORE + "  ", width, max_lines=_DETAIL_LINES)
    return lines


def _sources(sources: dict[str, Any], width: int) -> list[str]:
    """Each source's state, and why when it is not ok (an error, or why it is off)."""
    if not sources:
        return ["Sources: none"]
    lines = ["Sources:"]
    for name, reported in sources.items():
        health = reported if isinstance(reported, dict) else {}
        text = f"{name:<10} {health.get('state') or 'state not reported'}"
        if health.get("state") != "ok" and health.get("last_error"):
            text += f"; last error: {health['last_error']}"
        why = (health.get("detail") or {}).get("why")
        if why:
            text += f": {why}"
        lines += wrap(text, _ITEM, " " * (len(_ITEM) + 11), width, max_lines=_DETAIL_LINES)
        for also in _source_causes(health):
            lines += wrap(
                also, " " * (len(_ITEM) + 11), " " * (len(_ITEM) + 13), width, max_lines=_DETAIL_LINES
            )
    return lines


def _source_causes(health: dict[str, Any]) -> list[str]:
    """The probable cause of what a source cannot see (the GPU monitor's NVML, its kernel log)."""
    found: list[str] = []
    cause = health.get("cause")
    if isinstance(cause, dict) and cause.get("cause"):
        found.append(f"probable cause: {cause['cause']} (see {cause.get('docs')})")
    kmsg = health.get("kmsg")
    if isinstance(kmsg, dict) and kmsg.get("cause"):
        found.append(f"kernel log: {kmsg.get('why')}; {kmsg['cause']}")
    return found


def _connections_line(conn: dict[str, Any]) -> str:
    fds = conn.get("descriptors") or {}
    text = (
        f"Connections: {conn.get('open', 0)} open of {conn.get('max', 0)}, {conn.get('refused', 0)} refused"
    )
    if fds.get("open") is not None and fds.get("limit") is not None:
        text += f"; descriptors {fds['open']} of {fds['limit']}"
    return text


def _size(value: Any) -> str:
    size = float(value or 0)
    if size < 1024:
        return keep(f"{size:.0f} B")
    unit = "KiB"
    for unit in ("KiB", "MiB", "GiB", "TiB"):  # noqa: B007 (the unit the loop stops at is the one shown)
        size /= 1024
        if size < 1024:
            break
    return keep(f"{size:.1f} {unit}")


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _who(client: Any) -> str:
    """A client as ``job j7, rank 0`` (the names the client gave)."""
    if not isinstance(client, dict):
        return ""
    return ", ".join(f"{key} {value}" for key, value in client.items() if value is not None)


def _flush_risk_line(risk: dict[str, Any]) -> str:
    """The newest save a client predicted to miss its deadline, and how it ended when it did."""
    predicted, time_left = _number(risk.get("predicted_s")), _number(risk.get("time_left_s"))
    step = f"step {risk['step']}" if risk.get("step") is not None else "a save"
    text = f"Flush at risk: {step}"
    text += f" predicted to take {duration(predicted)}" if predicted is not None else " of unknown length"
    if time_left is not None:
        text += f" with {duration(time_left)} left"
    who = _who(risk.get("client"))
    if who:
        text += f" ({who})"
    outcome = risk.get("outcome") or {}
    took = _number(outcome.get("duration_s"))
    if outcome.get("phase"):
        text += f"; {outcome['phase']}" + (f" in {duration(took)}" if took is not None else "")
    else:
        text += "; still saving"
    return text


def _emergency_save_line(saved: dict[str, Any]) -> str:
    """The newest emergency save: where it went, why not the peer tier, predicted and actual, the slack."""
    took = _number(saved.get("duration_s"))
    if saved.get("phase") == "finished":
        outcome = f"in {duration(took)}" if took is not None else "(its duration not reported)"
    else:
        outcome = "FAILED"
    if saved.get("fallback_step") is not None:
        outcome += f", step {saved['fallback_step']} used instead"
    why = f" (fallback: {saved['fallback']})" if saved.get("fallback") else ""
    budget = []
    for key, label in (("predicted_s", "predicted {}"), ("time_left_s", "{} left"), ("slack_s", "slack {}")):
        value = _number(saved.get(key))
        if value is not None:
            budget.append(label.format(duration(value) if value >= 0 else f"-{duration(-value)}"))
    step = f"step {saved['step']}" if saved.get("step") is not None else "a step"
    return f"Last emergency save: {step} to {saved.get('tier') or 'durable'}{why} {outcome}" + (
        "; " + ", ".join(budget) if budget else ""
    )


def _ram_tier_line(tier: dict[str, Any]) -> str:
    if tier.get("state") != "ready":
        return f"RAM tier: {str(tier.get('state') or 'not reported').upper()}" + (
            f": {tier['error']}" if tier.get("error") else ""
        )
    jobs = tier.get("jobs") or {}
    steps = sum(len(job.get("steps") or []) for job in jobs.values())
    where = f"{tier.get('filesystem') or 'filesystem unknown'}" + ("" if tier.get("in_ram") else ": NOT RAM")
    return (
        f"RAM tier: {_size(tier.get('used_bytes'))} used of {_size(tier.get('cap_bytes'))}, "
        f"{_size(tier.get('reserved_bytes'))} reserved; {plural(steps, 'step')} of {plural(len(jobs), 'job')} "
        f"in {tier.get('path')} ({where})"
    )


# ----- preemptd watch ----------------------------------------------------------------------------------------

_INDENT = " " * len("HH:MM:SS ")  # continuation lines start under the event's type
_MAX_LINES = 4  # of one wrapped part (a long reason): the rest is elided, `--json` has it all
_MAX_LISTED = 10  # notices in a snapshot (`preemptd status` lists them all)


def _wrap(text: str, width: int, first: str = "", max_lines: int = _MAX_LINES) -> list[str]:
    """A part of an event: the first line starts with ``first`` and the rest are indented under the type."""
    return wrap(text, first or _INDENT, _INDENT, width, max_lines)


def _names(names: list[Any]) -> str:
    shown = ", ".join(str(name) for name in names[:3])
    return shown + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _headline(notice: dict[str, Any], now: datetime) -> str:
    """What a notice is and how long is left: ``termination critical from aws: 1m30s left (12:01:30 UTC)``;
    the deadline's date too when it is not today."""
    source = notice.get("source") or "an unnamed source"
    drill = " [drill]" if notice.get("drill") and source != "drill" else ""
    deadline = notice.get("deadline")
    moment = f"{left(deadline, now)} ({keep(when(deadline, now))})" if deadline else "no deadline"
    return f"{_what(notice)} from {source}{drill}: {moment}"


def _what(notice: dict[str, Any]) -> str:
    """A notice's kind and severity: ``termination critical``."""
    return " ".join(str(notice[key]) for key in ("kind", "severity") if notice.get(key)) or "a notice"


def _body(notice: dict[str, Any]) -> str:
    """A notice's id (what `preemptd drill --clear` takes) and reason."""
    return f"{notice.get('id') or 'no id'}: {notice.get('reason') or '(no reason given)'}"


def _ready_sentence(data: dict[str, Any]) -> str:
    """Who saved, how long after the notice and how much time was left: the ready event in words."""
    finished = list(data.get("finished") or [])
    failed = list(data.get("failed") or [])
    missing = list(data.get("missing") or [])
    expected = len(data.get("participants") or []) or len(finished) + len(failed) + len(missing)
    took, margin = _number(data.get("notice_to_ready_s")), _number(data.get("margin_s"))
    timing = f"{duration(took)} after the notice" if took is not None else "after the notice"
    if margin is not None:
        timing += f", with {duration(margin)} to spare" if margin > 0 else ", past the deadline"
    saved = f"{len(finished)} of {plural(expected, 'participant')} saved" + (
        f" ({_names(finished)})" if finished else ""
    )
    reason = data.get("reason")
    if reason == "all_participants":
        who = "the one participant" if expected == 1 else f"all {plural(expected, 'participant')}"
        sentence = f"{who} saved ({_names(finished)}) {timing}"
    elif reason == "no_participants":
        sentence = f"no participant was registered; ready {timing}"
    elif reason == "grace":
        sentence = f"the grace ran out {timing}: {saved}"
    elif reason == "deadline":
        sentence = f"the deadline came too near {timing}: {saved}"
    else:
        sentence = f"ready ({reason or 'no reason given'}) {timing}: {saved}"
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
    kind = str(doc.get("type") or "event")
    first = printable(f"{stamp} {kind.upper():<8} ")
    notice = doc.get("notice") or {}
    if kind == "snapshot":
        notices = doc.get("notices") or []
        lines = [f"{first}{plural(len(notices), 'active notice') if notices else 'no active notices'}"]
        for item in notices[:_MAX_LISTED]:
            lines += _wrap(_headline(item, now), width, max_lines=2)
            lines += _wrap(_body(item), width, _INDENT + "  ", max_lines=1)
        if len(notices) > _MAX_LISTED:
            lines.append(f"{_INDENT}... and {len(notices) - _MAX_LISTED} more (preemptd status lists them)")
        return "\n".join(lines)
    if kind == "ready":
        data = dict(doc.get("data") or {})
        notice_id = notice.get("id") or data.get("notice_id") or "with no id"
        return "\n".join(
            _wrap(f"{notice.get('kind') or 'notice'} {notice_id}: {_ready_sentence(data)}", width, first)
        )
    if kind == "membership":  # a job's change of membership (agent/cli/watch_jobs.py)
        return "\n".join(_wrap(f"job {doc.get('job')}: {doc.get('what')}", width, first, max_lines=2))
    if not notice:  # an event type this CLI does not know: show it rather than nothing
        return "\n".join(_wrap(json.dumps(doc, sort_keys=True), width, first))
    if kind == "cleared":
        why = (notice.get("detail") or {}).get("cleared_reason") or "no longer reported"
        headline = f"{_what(notice)} from {notice.get('source') or 'an unnamed source'}: {why}"
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
    parts = [
        f"{notice.get('kind') or 'notice'}: {left(notice.get('deadline'))}" for notice in active.values()
    ]
    prefix = "  >> "
    return prefix + textwrap.shorten(
        printable(" | ".join(parts)), width - 1 - len(prefix), placeholder=" ..."
    )
