"""Structured logging: one JSON object per line on stdout, structlog's console renderer on a terminal, and
under systemd native journal fields (:mod:`agent.service.journal`) or, without the binding, JSON lines with the
syslog priority prefix journald reads.

The standard library's logging (aiohttp's access and error logs) is routed through the same processors.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import MutableMapping
from typing import Any, TextIO

import structlog

from agent.service import journal
from agent.service.journal import JOURNAL_SOCKET, JournalSend, load_send

LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}
# syslog priorities understood by journald in a "<N>" line prefix (SyslogLevelPrefix=).
PRIORITY = {"debug": 7, "info": 6, "warning": 4, "warn": 4, "error": 3, "exception": 3, "critical": 2}


def stream_is_journal(stream: TextIO, env: MutableMapping[str, str] | None = None) -> bool:
    """True when ``stream`` is the journal: ``JOURNAL_STREAM`` names its device and inode."""
    value = (os.environ if env is None else env).get("JOURNAL_STREAM", "")
    dev, sep, ino = value.partition(":")
    if not sep:
        return False
    try:
        st = os.fstat(stream.fileno())
        return st.st_dev == int(dev) and st.st_ino == int(ino)
    except (OSError, ValueError, AttributeError):
        return False


def _journal_prefix(_: Any, method: str, event: Any) -> Any:
    # Runs after the JSON renderer: ``event`` is the rendered line.
    return f"<{PRIORITY.get(method, 6)}>{event}"


_DETECT: Any = object()


def native_journal_send(journal_send: Any = _DETECT) -> JournalSend | None:
    """The binding's ``send`` when entries can go to journald natively: the binding is installed (unless
    ``journal_send`` says otherwise: None for "absent", a callable to use) and journald's socket exists."""
    send = load_send() if journal_send is _DETECT else journal_send
    if send is None or (journal_send is _DETECT and not os.path.exists(JOURNAL_SOCKET)):
        return None
    return send


def configure_logging(
    fmt: str = "auto", level: str = "info", stream: TextIO | None = None, journal_send: Any = _DETECT
) -> str:
    """Set up structlog and stdlib logging; returns the format chosen: ``json``, ``console``, ``journal``
    (JSON lines with a priority prefix) or ``journal-native`` (fields through systemd's binding; see
    :mod:`agent.service.journal`)."""
    out = stream or sys.stdout
    if fmt == "auto":
        if stream_is_journal(out):
            chosen = "journal"
        elif out.isatty():
            chosen = "console"
        else:
            chosen = "json"
    else:
        chosen = fmt
    if chosen == "json" and stream_is_journal(out):
        chosen = "journal"
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    send = native_journal_send(journal_send) if chosen == "journal" else None
    if send is not None:
        return _configure_native(send, shared, level, out)
    final: list[Any]
    if chosen == "console":
        final = [structlog.dev.ConsoleRenderer(colors=out.isatty())]
    else:
        final = [structlog.processors.format_exc_info, structlog.processors.JSONRenderer(sort_keys=False)]
        if chosen == "journal":
            final.append(_journal_prefix)
    structlog.configure(
        processors=[*shared, structlog.processors.StackInfoRenderer(), *final],
        wrapper_class=structlog.make_filtering_bound_logger(LEVELS[level]),
        logger_factory=structlog.PrintLoggerFactory(out),
        cache_logger_on_first_use=False,
    )
    handler = logging.StreamHandler(out)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=shared,
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *final],
        )
    )
    _install_root_handler(handler, level)
    return chosen


def _configure_native(send: JournalSend, shared: list[Any], level: str, out: TextIO) -> str:
    def fallback(line: str) -> None:
        print(line, file=out, flush=True)

    structlog.configure(
        processors=[
            *shared,
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            journal.render,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(LEVELS[level]),
        logger_factory=journal.JournalLoggerFactory(send, fallback),
        cache_logger_on_first_use=False,
    )
    _install_root_handler(journal.JournalHandler(send, fallback), level)
    return "journal-native"


def _install_root_handler(handler: logging.Handler, level: str) -> None:
    root = logging.getLogger()
    for old in list(root.handlers):
        if getattr(old, "_preemptd", False):
            root.removeHandler(old)
    handler._preemptd = True  # type: ignore[attr-defined]
    root.addHandler(handler)
    root.setLevel(LEVELS[level])
    # aiohttp logs every request at INFO on its access logger, and httpx2 (the Kubernetes bridge's client, through
    # lightkube) every API call; the agent logs what matters itself (kubernetes_call_failed and the counters).
    for name in ("aiohttp.access", "httpx2", "httpx"):
        logging.getLogger(name).setLevel(logging.WARNING)


def get_logger(**context: Any) -> Any:
    return structlog.get_logger("preemptd").bind(**context)
