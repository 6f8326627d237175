"""Human durations for the command line: ``90``, ``90s``, ``4m``, ``1.5h``, ``2d``, ``1h30m``."""

from __future__ import annotations

import re

# The longest duration a command-line flag takes: 100 years. Every such value ends up added to or taken from
# the current time (a report's start, a drill's deadline, a notice's lead time), and datetime arithmetic
# overflows long before a float does (a timedelta ends at 999,999,999 days, a date at year 1 and 9999).
MAX_DAYS = 36500
MAX_DURATION_S = MAX_DAYS * 86400.0

_UNITS = {"": 1.0, "s": 1.0, "sec": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "d": 86400.0}
_PART = re.compile(r"(\d+(?:\.\d+)?)\s*(sec|min|s|m|h|d)?", re.IGNORECASE)


def parse_duration(text: str) -> float:
    """Seconds in ``text``, from 0 to :data:`MAX_DURATION_S`; a bare number is seconds. Raises ValueError with
    what was expected."""
    raw = text.strip().lower()
    if not raw:
        raise ValueError("expected a duration such as 90s, 4m or 1.5h, got an empty string")
    total = 0.0
    pos = 0
    for match in _PART.finditer(raw):
        if match.start() != pos and raw[pos : match.start()].strip():
            break
        total += float(match.group(1)) * _UNITS[(match.group(2) or "").lower()]
        pos = match.end()
    if pos != len(raw) or pos == 0:
        raise ValueError(f"expected a duration such as 90s, 4m or 1.5h, got {text!r}")
    if not total <= MAX_DURATION_S:  # also infinity: float("1" + 400 * "0")
        raise ValueError(f"expected a duration from 0s to {MAX_DAYS}d (100 years), got {text!r}")
    return total


def format_duration(seconds: float) -> str:
    """A short human form: ``45s``, ``12m05s``, ``3h20m``."""
    value = max(0.0, seconds)
    if value < 60:
        return f"{value:.0f}s" if value >= 10 else f"{value:.1f}s"
    if value < 3600:
        minutes, secs = divmod(round(value), 60)
        return f"{minutes}m{secs:02d}s"
    hours, rest = divmod(round(value), 3600)
    return f"{hours}h{rest // 60:02d}m"
