"""Client reports (``POST /v1/reports``): validation of the JSON body into a frozen :class:`Report`.

Pure functions; the API handler only reads the body, calls :func:`parse_report` and answers 4xx with the
message of a :class:`~agent.core.errors.ReportError`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from agent.core.errors import ReportError
from agent.core.notice import format_time

PHASES = ("started", "finished", "failed")
# A ``participant`` report registers a training process as soon as it starts (its watcher connected), so a
# notice that arrives before its first checkpoint waits for its emergency save all the same.
REGISTERED = "registered"
# A ``membership`` report says the job's ranks re-formed at another size (``reformed``), that this node left it
# (``left``), or that it stopped instead of shrinking (``stopped``): see agent/client/elastic.py.
MEMBERSHIP_PHASES = ("reformed", "left", "stopped")
# A ``snapshot_rate`` report says the job's peer snapshots come more often under a hazard (``raised``) or as
# usual again (``relaxed``): see agent/client/hazard.py.
RATE_PHASES = ("raised", "relaxed")
KINDS = ("checkpoint", "participant", "membership", "snapshot_rate")
PHASES_OF_KIND = {
    "checkpoint": PHASES,
    "participant": (REGISTERED,),
    "membership": MEMBERSHIP_PHASES,
    "snapshot_rate": RATE_PHASES,
}
_CLIENT_KEYS = {
    "pid": int,
    "host": str,
    "rank": int,
    "world_size": int,
    "job": str,
    "name": str,
    "participant": bool,
    "gpus": int,  # GPUs this process drives (the ledger's GPU-hours; one when absent)
    "slurm_job_id": str,  # the Slurm job it runs in (the Slurm bridge's elastic jobs)
    "min_nodes": int,  # an elastic launch's MIN and MAX nodes (torchrun --nnodes MIN:MAX under exec)
    "max_nodes": int,
}
MAX_TEXT = 512
# Bounds that keep every accepted value usable downstream (``timedelta``, float arithmetic, int64 metrics).
MAX_DURATION_S = 7 * 24 * 3600.0
MAX_COUNT = 2**63 - 1


@dataclass(frozen=True)
class Report:
    kind: str
    phase: str
    received_at: datetime
    step: int | None = None
    duration_s: float | None = None
    bytes: int | None = None
    emergency: bool = False
    notice_id: str | None = None
    path: str | None = None
    client: Mapping[str, Any] = field(default_factory=dict)
    peer_pid: int | None = None
    peer_uid: int | None = None
    flush: Mapping[str, Any] = field(default_factory=dict)
    membership: Mapping[str, Any] = field(default_factory=dict)
    rate: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "phase": self.phase,
            "received_at": format_time(self.received_at),
            "step": self.step,
            "duration_s": self.duration_s,
            "bytes": self.bytes,
            "emergency": self.emergency,
            "notice_id": self.notice_id,
            "path": self.path,
            "client": dict(self.client),
            "peer_pid": self.peer_pid,
            "peer_uid": self.peer_uid,
            **({"flush": dict(self.flush)} if self.flush else {}),
            **({"membership": dict(self.membership)} if self.membership else {}),
            **({"rate": dict(self.rate)} if self.rate else {}),
        }


# The fields a report may have.
_FIELDS = frozenset(
    {
        "kind",
        "phase",
        "step",
        "duration_s",
        "bytes",
        "emergency",
        "notice_id",
        "path",
        "client",
        "flush",
        "membership",
        "rate",
    }
)


def parse_report(
    doc: Any, received_at: datetime, peer_pid: int | None = None, peer_uid: int | None = None
) -> Report:
    """Validate a decoded JSON report; raise ReportError naming the field and what was expected."""
    _check_fields(doc)
    kind, phase = _kind_and_phase(doc)
    step = _optional_int(doc, "step")
    size = _optional_int(doc, "bytes")
    duration = _duration(doc, phase)
    emergency = doc.get("emergency", False)
    if not isinstance(emergency, bool):
        raise ReportError(f"field 'emergency' must be true or false, got {emergency!r}")
    notice_id = _optional_text(doc, "notice_id")
    path = _optional_text(doc, "path")
    client = _client(doc.get("client") or {})
    flush = _checked(doc.get("flush"), "flush", _FLUSH_KEYS)
    membership = _checked(doc.get("membership"), "membership", _MEMBERSHIP_KEYS)
    if kind == "membership" and "world_size" not in membership:
        raise ReportError("a 'membership' report needs 'membership.world_size' (the job's ranks now)")
    rate = _checked(doc.get("rate"), "rate", _RATE_KEYS)
    if kind == "snapshot_rate" and not 1 <= rate.get("every", 0) <= MAX_COUNT:
        raise ReportError(
            "a 'snapshot_rate' report needs 'rate.every', the steps between snapshots now (>= 1)"
        )
    if kind == "participant" and client.get("participant") is not True:
        raise ReportError(
            "a 'participant' report registers the process as a participant: it needs 'client.participant': true"
        )
    return Report(
        kind=kind,
        phase=phase,
        received_at=received_at,
        step=step,
        duration_s=duration,
        bytes=size,
        emergency=emergency,
        notice_id=notice_id,
        path=path,
        client=client,
        peer_pid=peer_pid,
        peer_uid=peer_uid,
        flush=flush,
        membership=membership,
        rate=rate,
    )


def _check_fields(doc: Any) -> None:
    """Refuse a report that is not a JSON object or has a field no report has."""
    if not isinstance(doc, Mapping):
        raise ReportError(f"a report must be a JSON object, got {_json_type(doc)}")
    unknown = sorted(set(doc) - _FIELDS)
    if unknown:
        shown = ", ".join(brief(name) for name in unknown[:5]) + (
            f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
        )
        raise ReportError(f"unknown field(s) {shown}; known: {', '.join(sorted(_FIELDS))}")


def _kind_and_phase(doc: Mapping[str, Any]) -> tuple[str, str]:
    """The report's ``kind`` and a ``phase`` that kind has."""
    kind = doc.get("kind")
    if kind not in KINDS:
        raise ReportError(f"field 'kind' must be one of {', '.join(map(repr, KINDS))}, got {brief(kind)}")
    phase = doc.get("phase")
    phases = PHASES_OF_KIND[kind]
    if phase not in phases:
        raise ReportError(
            f"field 'phase' of a {kind!r} report must be one of {', '.join(map(repr, phases))}, got {brief(phase)}"
        )
    return kind, phase


def _duration(doc: Mapping[str, Any], phase: str) -> float | None:
    """``duration_s``, which a ``finished`` report must have."""
    duration = doc.get("duration_s")
    if duration is not None:
        duration = seconds(duration, "duration_s", MAX_DURATION_S, ReportError)
    if phase == "finished" and duration is None:
        raise ReportError("a 'finished' report needs 'duration_s' (seconds the checkpoint blocked training)")
    return duration


def _client(value: Any) -> dict[str, Any]:
    """The ``client`` object: the keys the agent knows, checked (the others are dropped)."""
    if not isinstance(value, Mapping):
        raise ReportError(f"field 'client' must be an object, got {_json_type(value)}")
    checked: dict[str, Any] = {}
    for key, item in value.items():
        expected = _CLIENT_KEYS.get(key)
        if expected is None:
            continue  # clients may add their own descriptive fields; they are dropped, not rejected
        if not isinstance(item, expected) or (expected is int and isinstance(item, bool)):
            raise ReportError(f"field 'client.{key}' must be {expected.__name__}, got {brief(item)}")
        if isinstance(item, str) and len(item) > MAX_TEXT:
            raise ReportError(f"field 'client.{key}' is longer than {MAX_TEXT} characters")
        checked[key] = item
    return checked


# What a client says about a flush besides its timing (sharded saves, the deadline budget): name → type.
_FLUSH_KEYS: dict[str, type] = {
    "sharded": bool,
    "world_size": int,
    "predicted_s": float,
    "time_left_s": float,
    "predicted_miss": bool,
    "async": str,
    # A failed emergency save: the earlier committed step the notice was handled with instead.
    "fallback_step": int,
    # Where the flush went ("durable", "peer": the RAM tiers of other hosts); the ledger reports it.
    "tier": str,
    # Why the peer tier was not used ("all_hosts_noticed", "no_room", "agent_unreachable", ...).
    "fallback": str,
    # Seconds left before the deadline when the save ended: negative when it ended after it.
    "slack_s": float,
    "complete_s": float,  # a peer snapshot (tier "snapshot"): seconds until committed on the peers
}
# What a membership report says (agent/client/elastic.py's Reform): name → type.
_MEMBERSHIP_KEYS: dict[str, type] = {
    "world_size": int,
    "previous_world_size": int,
    "nodes": int,
    "previous_nodes": int,
    "seconds": float,
    "reason": str,
}
# What a snapshot_rate report says (agent/client/hazard.py): name → type.
_RATE_KEYS: dict[str, type] = {"every": int, "usual": int, "factor": float, "reason": str}
# Keys of seconds that may be negative.
_SIGNED = frozenset({"slack_s"})


def _checked(value: Any, name: str, keys: Mapping[str, type]) -> dict[str, Any]:
    """An optional object of a report (``flush``, ``membership``), checked key by key (unknown keys are
    dropped)."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ReportError(f"field {name!r} must be an object, got {_json_type(value)}")
    checked: dict[str, Any] = {}
    for key, item in value.items():
        expected = keys.get(key)
        if expected is None or item is None:
            continue
        if expected is float:
            signed = (
                key in _SIGNED and isinstance(item, (int, float)) and not isinstance(item, bool) and item < 0
            )
            value = seconds(-item if signed else item, f"{name}.{key}", MAX_DURATION_S, ReportError)
            checked[key] = -value if signed else value
            continue
        if not isinstance(item, expected) or (expected is int and isinstance(item, bool)):
            raise ReportError(f"field '{name}.{key}' must be {expected.__name__}, got {brief(item)}")
        if isinstance(item, str) and len(item) > MAX_TEXT:
            raise ReportError(f"field '{name}.{key}' is longer than {MAX_TEXT} characters")
        checked[key] = item
    return checked


def _optional_int(doc: Mapping[str, Any], name: str) -> int | None:
    value = doc.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_COUNT:
        raise ReportError(f"field {name!r} must be an integer from 0 to 2**63-1, got {brief(value)}")
    return value


def _optional_text(doc: Mapping[str, Any], name: str) -> str | None:
    value = doc.get(name)
    if value is None:
        return None
    if not isinstance(value, str) or len(value) > 4096:
        raise ReportError(f"field {name!r} must be a string of at most 4096 characters, got {brief(value)}")
    return value


def seconds(value: Any, name: str, maximum: float, error: type[Exception]) -> float:
    """A JSON number of seconds from 0 to ``maximum`` as a float; raises ``error`` naming the field. A
    huge integer is refused here rather than overflowing later in float or ``timedelta`` arithmetic."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise error(f"field {name!r} must be a finite number of seconds, got {brief(value)}")
    if isinstance(value, int) and not -maximum <= value <= maximum:
        value = math.inf if value > 0 else -math.inf
    if not math.isfinite(value) or not 0 <= value <= maximum:
        raise error(f"field {name!r} must be a number of seconds from 0 to {maximum:.0f}, got {brief(value)}")
    return float(value)


def brief(value: Any, limit: int = 60) -> str:
    """``repr(value)`` cut to ``limit`` characters: an error message quotes what it refuses, never all of it."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**limit:
        return f"an integer of {len(str(abs(value)))} digits"
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text)} characters)"


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return type(value).__name__
