"""How the command line lays text out for people: lines of at most 80 columns wrapped at word boundaries and
indented under their first line, times in one form with their zone, durations rounded, counts with the noun
that fits. Pure and standard library only: every verb's screen (``status``, ``watch``, ``advise``,
``report``, the errors) uses it, and the details a line has no room for are in the verb's ``--json``.
"""

from __future__ import annotations

import textwrap
import unicodedata
from datetime import datetime, timedelta, timezone

from agent.core.durations import format_duration

WIDTH = 80  # the classic terminal, and narrow tmux panes
ELIDED = " ..."  # what ends a part cut short (``--json`` has it all)
KEEP = "\u00a0"  # a no-break space: the words it joins stay on one line (shown as a plain space)

# C0, DEL and C1 control characters, and the bidirectional overrides that reorder what a terminal shows.
_UNPRINTABLE = {
    code: f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"
    for code in (*range(0x20), *range(0x7F, 0xA0), *range(0x202A, 0x202F), *range(0x2066, 0x206A))
}


def printable(text: str) -> str:
    """``text`` with control characters written as escapes (``\\x1b``): what the agent reports (a drill's
    reason, a source's error) comes from other users and must not move the cursor or rewrite the screen."""
    return text.translate(_UNPRINTABLE)


def keep(text: str) -> str:
    """``text`` whose words :func:`wrap` keeps on one line (a time, ``12 GiB``)."""
    return text.replace(" ", KEEP)


def columns(text: str) -> int:
    """The columns a terminal gives ``text``: two for a wide (East Asian) character, none for a combining
    one."""
    if text.isascii():
        return len(text)
    return sum(_char_columns(char) for char in text)


def _char_columns(char: str) -> int:
    return 2 if unicodedata.east_asian_width(char) in "WF" else 0 if unicodedata.combining(char) else 1


def wrap(
    text: str,
    first: str = "",
    indent: str | None = None,
    width: int = WIDTH,
    max_lines: int | None = None,
) -> list[str]:
    """``text`` (escaped for the terminal) in lines of at most ``width`` columns, broken between words: the
    first line starts with ``first``, the others with ``indent`` (by default as many spaces as ``first``
    is long). With ``max_lines``, what does not fit ends in `` ...``. A word longer than a line (a long path)
    stands alone on its own line, whole: cut, it could not be copied."""
    rest = " " * len(first) if indent is None else indent
    lines = textwrap.wrap(
        printable(text),
        width,
        initial_indent=first,
        subsequent_indent=rest,
        break_on_hyphens=False,
        break_long_words=False,
        max_lines=max_lines,
        placeholder=ELIDED,
    ) or [first.rstrip()]
    return [piece.replace(KEEP, " ") for line in lines for piece in _fit(line, width, rest)]


def fill(text: str, first: str = "", indent: str | None = None, max_lines: int | None = None) -> str:
    """:func:`wrap`'s lines as one string."""
    return "\n".join(wrap(text, first, indent, max_lines=max_lines))


def _fit(line: str, width: int, indent: str) -> list[str]:
    """``line`` cut where it passes ``width`` columns: textwrap counts characters, and a wide character takes
    two columns (a cloud in China may describe its events in Chinese)."""
    if line.isascii():
        return [line]
    pieces, piece, used = [], "", 0
    for char in line:
        size = _char_columns(char)
        if used + size > width:
            pieces.append(piece)
            piece, used = indent, len(indent)
        piece += char
        used += size
    return [*pieces, piece]


def parse_time(text: str | None) -> datetime | None:
    """An RFC 3339 time from the agent (``Z`` or an offset), None for none."""
    if not text:
        return None
    return datetime.fromisoformat(text.replace("Z", "+00:00").replace("z", "+00:00"))


def when(value: datetime | str, now: datetime | None = None) -> str:
    """A time as people read it, in this machine's zone and named: ``2026-12-06 12:01:29 UTC``, to the
    second; with ``now``, the time of day alone when it is the same day (``12:01:29 UTC``)."""
    moment = parse_time(value) if isinstance(value, str) else value
    if moment is None:
        return "an unknown time"
    if moment.tzinfo is None:  # the agent writes UTC; a time without a zone is taken as UTC
        moment = moment.replace(tzinfo=timezone.utc)
    local = moment.astimezone()
    zone = local.tzname() or _offset(local.utcoffset())
    today = now is not None and now.astimezone(local.tzinfo).date() == local.date()
    return local.strftime("%H:%M:%S" if today else "%Y-%m-%d %H:%M:%S") + f" {zone}"


def _offset(offset: timedelta | None) -> str:
    minutes = round((offset or timedelta()).total_seconds() / 60)
    sign = "-" if minutes < 0 else "+"
    return f"UTC{sign}{abs(minutes) // 60:02d}:{abs(minutes) % 60:02d}"


def duration(seconds: float) -> str:
    """A duration rounded for people: ``5 ms`` below a second, then ``1.5s``, ``45s``, ``12m05s``,
    ``3h20m`` and past two days ``2.5 days``."""
    value = max(0.0, float(seconds))
    if value == 0:
        return "0s"
    if value < 1:
        return f"{round(value * 1000)} ms" if value >= 0.0005 else "under 1 ms"
    if value >= 2 * 86400:
        return f"{value / 86400:.1f} days"
    return format_duration(value)


def plural(count: int, word: str, many: str | None = None) -> str:
    """``1 step``, ``2 steps`` (``many``: the plural when it is not ``word`` + s)."""
    return f"{count} {word if count == 1 else many or word + 's'}"
