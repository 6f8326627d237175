"""The facts the ledger keeps, as the agent received them: notices (from its events) and client reports. Pure
and standard library only: the agent turns events and reports into these, the database stores them, the
report (``preemptd report``) reads them back, over the socket as JSON or from the file."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from agent.core.notice import Event, EventType
from agent.core.reports import Report

NOTICE_EVENTS = (EventType.NOTICE, EventType.UPDATE, EventType.CLEARED)


@dataclass(frozen=True)
class NoticeFact:
    """One notice; times are Unix seconds. ``time``: its last change (retention goes by it)."""

    id: str
    kind: str
    source: str
    severity: str
    drill: bool
    detected_at: float
    deadline: float | None
    cleared_at: float | None
    time: float

    @property
    def lead_s(self) -> float | None:
        """How long before its deadline the notice came."""
        return None if self.deadline is None else self.deadline - self.detected_at


@dataclass(frozen=True)
class ReportFact:
    """One client report (a checkpoint started/finished/failed, a participant's registration, or an elastic
    job's membership: re-formed, left or stopped; agent/client/elastic.py). The membership fields and a
    snapshot's ``complete_s`` come last, with defaults: a ledger document or file from before them still
    loads."""

    time: float
    job: str
    pid: int | None
    rank: int | None
    gpus: int | None
    kind: str
    phase: str
    step: int | None
    duration_s: float | None
    bytes: int | None
    emergency: bool
    notice_id: str | None
    tier: str | None
    fallback_step: int | None
    # membership reports: the job's ranks after and before, how long the re-form (or the decision) took, and
    # why it stopped instead of shrinking
    world_size: int | None = None
    previous_world_size: int | None = None
    seconds: float | None = None
    reason: str | None = None
    # a peer snapshot (``tier`` "snapshot"): seconds from its start until committed on the peers
    complete_s: float | None = None


@dataclass(frozen=True)
class Facts:
    notices: tuple[NoticeFact, ...] = ()
    reports: tuple[ReportFact, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {
            "notices": [asdict(n) for n in self.notices],
            "reports": [asdict(r) for r in self.reports],
        }

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> Facts:
        """What :meth:`to_json` wrote (the agent's ``GET /v1/ledger``); ValueError when it is not that."""
        try:
            return cls(
                notices=tuple(NoticeFact(**n) for n in doc["notices"]),
                reports=tuple(ReportFact(**r) for r in doc["reports"]),
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"not a ledger document: {exc}") from None


def notice_fact(event: Event) -> NoticeFact | None:
    """The notice an event raised, changed or cleared, or None for other events."""
    notice = event.notice
    if event.type not in NOTICE_EVENTS or notice is None:
        return None
    cleared = notice.cleared_at or (event.time if event.type is EventType.CLEARED else None)
    return NoticeFact(
        id=notice.id,
        kind=notice.kind.value,
        source=notice.source,
        severity=notice.severity.value,
        drill=notice.drill,
        detected_at=notice.detected_at.timestamp(),
        deadline=notice.deadline.timestamp() if notice.deadline is not None else None,
        cleared_at=cleared.timestamp() if cleared is not None else None,
        time=event.time.timestamp(),
    )


def job_of(client: Mapping[str, Any], peer_pid: int | None) -> str:
    """Which job a report belongs to: the client's job id, else its name, else its process."""
    for key in ("job", "name"):
        value = client.get(key)
        if isinstance(value, str) and value:
            return value
    pid = client.get("pid", peer_pid)
    return f"pid {pid}" if pid is not None else "unknown"


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _float(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def report_fact(report: Report) -> ReportFact:
    client = report.client
    tier = report.flush.get("tier")
    membership = report.membership
    reason = membership.get("reason")
    return ReportFact(
        time=report.received_at.timestamp(),
        job=job_of(client, report.peer_pid),
        pid=_int(client.get("pid")) if client.get("pid") is not None else report.peer_pid,
        rank=_int(client.get("rank")),
        # Optional: a client that drives several GPUs per process says how many; one otherwise.
        gpus=_int(client.get("gpus")),
        kind=report.kind,
        phase=report.phase,
        step=report.step,
        duration_s=report.duration_s,
        bytes=report.bytes,
        emergency=report.emergency,
        notice_id=report.notice_id,
        tier=tier if isinstance(tier, str) else None,
        fallback_step=_int(report.flush.get("fallback_step")),
        world_size=_int(membership.get("world_size")),
        previous_world_size=_int(membership.get("previous_world_size")),
        seconds=_float(membership.get("seconds")),
        reason=reason if isinstance(reason, str) else None,
        complete_s=_float(report.flush.get("complete_s")),
    )
