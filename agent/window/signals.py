"""The signal action's limits on the notice window (docs/window.md), from ``[[actions.signals]]``: a rule
that escalates (``escalate_after_s``) kills what is still alive that long after its signal, which it sends at
the notice; and a unit a rule signals is stopped by systemd at shutdown (GCP's ACPI soft-off comes with the
notice) and SIGKILLed its ``TimeoutStopSec`` later, read with ``systemctl show``. Blocking (runs systemctl):
call :func:`signal_limits` in a thread."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterable

from agent.config.actions import SignalRuleConfig
from agent.window.limits import Limit

SYSTEMCTL_TIMEOUT_S = 2.0
_SPAN = re.compile(r"(\d+(?:\.\d+)?)\s*(us|ms|s|min|h|d|w|month|y)\b")
_SECONDS = {
    "us": 1e-6,
    "ms": 1e-3,
    "s": 1.0,
    "min": 60.0,
    "h": 3600.0,
    "d": 86400.0,
    "w": 604800.0,
    "month": 2629800.0,
    "y": 31557600.0,
}


def parse_timespan(text: str) -> float | None:
    """Seconds in a systemd time span as ``systemctl show`` prints it (``1min 30s``, ``500ms``); None for
    ``infinity`` or text that is not one."""
    text = text.strip()
    parts = _SPAN.findall(text)
    if not parts or _SPAN.sub("", text).strip():
        return None
    return round(sum(float(number) * _SECONDS[unit] for number, unit in parts), 6)


def unit_timeout(unit: str, systemctl: str = "systemctl") -> float | None:
    """A unit's ``TimeoutStopSec`` in seconds (None: infinity); raises OSError/CalledProcessError/ValueError
    when systemd cannot say."""
    name = unit if "." in unit else unit + ".service"
    out = subprocess.run(
        [systemctl, "show", "--property=TimeoutStopUSec", "--value", "--", name],
        capture_output=True,
        text=True,
        timeout=SYSTEMCTL_TIMEOUT_S,
        check=True,
    ).stdout.strip()
    seconds = parse_timespan(out)
    if seconds is None and out != "infinity":
        raise ValueError(f"systemctl show printed {out[:80]!r} for TimeoutStopUSec")
    return seconds


def signal_limits(rules: Iterable[SignalRuleConfig], systemctl: str = "systemctl") -> list[Limit]:
    found: list[Limit] = []
    for rule in rules:
        kinds = tuple(rule.kinds)
        if rule.escalate_after_s > 0:
            found.append(
                Limit(
                    "signal_escalation",
                    rule.escalate_after_s,
                    f"[[actions.signals]] {rule.name!r}: {rule.escalate_signal} {rule.escalate_after_s:g} s after "
                    f"its {rule.signal} at the notice",
                    lengthen=f"raise escalate_after_s of the [[actions.signals]] rule {rule.name!r}, or set it to 0",
                    kinds=kinds,
                )
            )
        for unit in rule.units:
            source = (
                f"unit {unit}: TimeoutStopSec (systemd SIGKILLs it this long after stopping it at shutdown)"
            )
            try:
                seconds = unit_timeout(unit, systemctl)
            except (OSError, subprocess.SubprocessError, ValueError) as exc:
                stderr = getattr(exc, "stderr", None)
                why = (stderr.strip() if isinstance(stderr, str) and stderr.strip() else str(exc))[:300]
                found.append(Limit("unit_stop", None, source, detail=why, kinds=kinds))
                continue
            if seconds is not None:
                found.append(
                    Limit(
                        "unit_stop",
                        seconds,
                        source,
                        lengthen=f"raise TimeoutStopSec= of {unit} (systemctl edit {unit})",
                        kinds=kinds,
                    )
                )
    return found
