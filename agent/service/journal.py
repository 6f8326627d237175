"""Native journal output: when stdout is the journal and systemd's Python binding (``systemd-python``, the
``journal`` extra) is installed, each log entry goes to journald as fields, so ``journalctl NOTICE_ID=…``
finds it: ``MESSAGE`` a sentence, ``PRIORITY``, ``SYSLOG_IDENTIFIER`` and every structured field upper-cased
(``NOTICE_ID``, ``NOTICE_KIND``, ``SOURCE``, ``DEADLINE``, …). Without the binding the agent keeps writing
JSON lines with a priority prefix (:mod:`agent.service.logs`).

:func:`journal_fields` is pure; :class:`JournalLogger` only hands its result to the binding.
"""

from __future__ import annotations

import importlib
import json
import logging
import re
from collections.abc import Callable, Mapping
from typing import Any

IDENTIFIER = "preemptd"
# syslog priorities, as journald stores them in PRIORITY.
PRIORITY = {"debug": 7, "info": 6, "warning": 4, "warn": 4, "error": 3, "exception": 3, "critical": 2}
# Fields that journald or this module sets itself.
_OWN = {"event", "level", "timestamp"}
# A notice's kind goes out as NOTICE_KIND: KIND alone would be ambiguous next to other kinds of things.
_RENAMED = {"kind": "NOTICE_KIND"}
_NOT_FIELD = re.compile(r"[^A-Z0-9_]")

JournalSend = Callable[..., None]


def load_send() -> JournalSend | None:
    """``systemd.journal.send`` when the binding is installed, else None."""
    try:
        binding = importlib.import_module("systemd.journal")
    except ImportError:
        return None
    send: JournalSend = binding.send
    return send


def field_name(key: str) -> str:
    """A journal field name: upper case, letters, digits and underscores, not starting with one (journald
    reserves a leading underscore for trusted fields) or a digit."""
    name = _NOT_FIELD.sub("_", key.upper()).lstrip("_")
    if not name or name[0].isdigit():
        name = "F_" + name
    return name[:64]


def _text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)) or value is None:
        return "" if value is None else str(value)
    return json.dumps(value, default=str, separators=(",", ":"))


def _left(seconds: Any) -> str:
    return f" ({seconds:.0f} s left)" if isinstance(seconds, (int, float)) else ""


def _notice_sentence(verb: str, e: Mapping[str, Any]) -> str:
    drill = "drill " if e.get("drill") else ""
    text = f"{str(e.get('severity', '')).capitalize()} {drill}{e.get('kind', 'unknown')} notice from "
    text += f"{e.get('source', '?')} {verb}: {e.get('reason', '')}".rstrip(": ")
    if e.get("deadline") and verb != "cleared":
        text += f"; deadline {e['deadline']}{_left(e.get('seconds_left'))}"
    return text.strip()


def _ready_sentence(e: Mapping[str, Any]) -> str:
    saved = e.get("finished") or []
    failed = e.get("failed") or []
    missing = e.get("missing") or []
    if not e.get("participants"):
        text = f"Notice {e.get('notice_id')} is ready: no participant was connected"
    else:
        text = f"Notice {e.get('notice_id')} is ready: {len(saved)} saved"
        if failed or missing:
            text += f", {len(failed)} failed, {len(missing)} did not report"
    margin = e.get("margin_s")
    if isinstance(margin, (int, float)):
        text += f", {margin:.0f} s before the deadline"
    return text


SENTENCES: Mapping[str, Callable[[Mapping[str, Any]], str]] = {
    "notice_raised": lambda e: _notice_sentence("raised", e),
    "notice_updated": lambda e: _notice_sentence("updated", e),
    "notice_cleared": lambda e: _notice_sentence("cleared", e),
    "notice_ready": _ready_sentence,
    "drill_injected": lambda e: (
        f"Drill {e.get('kind')} notice {e.get('notice_id')} injected, deadline in {e.get('in_s')} s"
    ),
    "source_error": lambda e: f"Source {e.get('source', '?')} failed: {e.get('error')}",
    "source_recovered": lambda e: (
        f"Source {e.get('source', '?')} works again after {e.get('after_errors')} error(s)"
    ),
    "source_disabled": lambda e: f"Source {e.get('source', '?')} is disabled: {e.get('why')}",
    "nvml_unavailable": lambda e: (
        f"NVML unavailable: {e.get('why')}; probable cause: {e.get('cause')} (see {e.get('docs')})"
    ),
    "kmsg_unavailable": lambda e: f"Kernel log unavailable: {e.get('why')}; {e.get('cause')}",
    "event_loop_stalled": lambda e: (
        f"The event loop stalled for {e.get('stalled_s')} s (bound {e.get('bound_s')} s): /healthz answers 503"
    ),
    "cloud_identified": lambda e: f"Running on {e.get('cloud')}",
    "report_received": lambda e: (
        f"Checkpoint {e.get('phase')} reported"
        + (f" at step {e['step']}" if e.get("step") is not None else "")
    ),
    "reports_received": lambda e: (
        f"{e.get('total')} client report(s) received in {e.get('interval_s')} s: {e.get('kinds')}"
    ),
    "job_membership": lambda e: f"Job {e.get('job')}: {e.get('what')}",
    "job_snapshot_rate": lambda e: f"Job {e.get('job')}: {e.get('what')}",
    "agent_started": lambda e: f"preemptd {e.get('version')} started on {e.get('socket')}",
    "agent_stopping": lambda e: f"preemptd stopping with {e.get('active_notices')} active notice(s)",
    "agent_stopped": lambda e: "preemptd stopped",
    "config_invalid": lambda e: f"Configuration error: {e.get('error')}",
    "reload_failed": lambda e: f"Reload failed, keeping the running configuration: {e.get('error')}",
}


def sentence(event: str, fields: Mapping[str, Any]) -> str:
    """A human sentence for a log entry: a template for the events an operator looks for, else the event
    name in words with its error, reason or why."""
    template = SENTENCES.get(event)
    if template is not None:
        try:
            return template(fields)
        except (KeyError, TypeError, ValueError):
            pass
    words = event.replace("_", " ").strip().capitalize() or "Log entry"
    for key in ("error", "reason", "why"):
        if fields.get(key):
            return f"{words}: {_text(fields[key])}"
    return words


def journal_fields(method: str, event_dict: Mapping[str, Any]) -> dict[str, str]:
    """The journal fields of one log entry (pure)."""
    event = str(event_dict.get("event", ""))
    level = str(event_dict.get("level") or method)
    fields = {
        "MESSAGE": sentence(event, event_dict),
        "PRIORITY": str(PRIORITY.get(level, 6)),
        "SYSLOG_IDENTIFIER": IDENTIFIER,
        "EVENT": event,
    }
    for key, value in event_dict.items():
        if key in _OWN or value is None:
            continue
        name = _RENAMED.get(key) or field_name(key)
        if name not in fields:
            fields[name] = _text(value)
    return fields


def render(_: Any, method: str, event_dict: Mapping[str, Any]) -> dict[str, str]:
    """structlog's last processor in journal mode: the fields, which structlog passes to the logger as
    keyword arguments."""
    return journal_fields(method, event_dict)


JOURNAL_SOCKET = "/run/systemd/journal/socket"


class JournalLogger:
    """A structlog logger that sends the rendered fields to journald through the binding. An entry journald
    does not take (its socket gone, a full buffer) is written to ``fallback`` as a JSON line with the priority
    prefix instead of being lost."""

    def __init__(self, send: JournalSend, fallback: Callable[[str], None]) -> None:
        self._send = send
        self._fallback = fallback

    def msg(self, **fields: str) -> None:
        message = fields.get("MESSAGE", "")
        rest = {k: v for k, v in fields.items() if k != "MESSAGE"}
        try:
            self._send(message, **rest)
        except OSError:
            self._fallback(f"<{fields.get('PRIORITY', '6')}>{json.dumps(fields, separators=(',', ':'))}")

    debug = info = warning = warn = error = critical = exception = fatal = failure = msg


class JournalLoggerFactory:
    def __init__(self, send: JournalSend, fallback: Callable[[str], None]) -> None:
        self._send = send
        self._fallback = fallback

    def __call__(self, *args: Any) -> JournalLogger:
        return JournalLogger(self._send, self._fallback)


class JournalHandler(logging.Handler):
    """The standard library's records (aiohttp's errors) as journal entries, through the same fields."""

    def __init__(self, send: JournalSend, fallback: Callable[[str], None]) -> None:
        super().__init__()
        self._logger = JournalLogger(send, fallback)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            entry: dict[str, Any] = {"event": record.getMessage(), "logger": record.name}
            if record.exc_info:
                entry["exception"] = logging.Formatter().formatException(record.exc_info)
            self._logger.msg(**journal_fields(record.levelname.lower(), entry))
        except Exception:
            self.handleError(record)
