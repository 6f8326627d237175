"""Structured logging: one JSON object per line on stdout (with the syslog priority prefix journald reads
when stdout is the journal), or structlog's console renderer on a terminal.

The standard library's logging (aiohttp's access and error logs) is routed through the same processors.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import MutableMapping
from typing import Any, TextIO

import structlog

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


def configure_logging(fmt: str = "auto", level: str = "info", stream: TextIO | None = None) -> str:
    """Set up structlog and stdlib logging; returns the format chosen (``json``, ``journal`` or ``console``)."""
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
    root = logging.getLogger()
    for old in list(root.handlers):
        if getattr(old, "_preemptd", False):
            root.removeHandler(old)
    handler._preemptd = True  # type: ignore[attr-defined]
    root.addHandler(handler)
    root.setLevel(LEVELS[level])
    # aiohttp logs every request at INFO on its access logger; the agent logs what matters itself.
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    return chosen


def get_logger(**context: Any) -> Any:
    return structlog.get_logger("preemptd").bind(**context)
