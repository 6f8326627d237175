"""The RAM tier's books, on the event loop and without I/O: the committed steps, the reservations that count
against the cap until they are committed, released or expire, and the refusals when the cap is reached."""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from agent.ramtier.inventory import StepRecord, TierError


@dataclass(frozen=True)
class Reservation:
    id: str
    job: str
    step: int
    bytes: int
    uid: int
    expires: datetime
    durable_root: str | None = None


class Holdings:
    def __init__(self, cap_bytes: int, ttl_s: float) -> None:
        self.cap_bytes = cap_bytes
        self._ttl = timedelta(seconds=ttl_s)
        self.records: dict[tuple[str, int], StepRecord] = {}
        self.reservations: dict[str, Reservation] = {}
        self.refusals = 0

    @property
    def used_bytes(self) -> int:
        return sum(record.bytes for record in self.records.values())

    @property
    def reserved_bytes(self) -> int:
        return sum(r.bytes for r in self.reservations.values())

    @property
    def free_bytes(self) -> int:
        return max(0, self.cap_bytes - self.used_bytes - self.reserved_bytes)

    def expire(self, now: datetime) -> list[Reservation]:
        """Drop the reservations whose time is up; the caller removes the steps nobody committed."""
        gone = [r for r in self.reservations.values() if r.expires <= now]
        for reservation in gone:
            del self.reservations[reservation.id]
        return gone

    def _full(self, need: int) -> TierError:
        self.refusals += 1
        return TierError(
            507,
            f"ram tier full: need {need} bytes, free {self.free_bytes} of cap {self.cap_bytes} "
            f"(used {self.used_bytes}, reserved {self.reserved_bytes}): free the steps a job no longer needs "
            "(DELETE /v1/ram-tier/jobs/JOB) or raise ram_tier.cap_bytes",
            need_bytes=need,
            free_bytes=self.free_bytes,
            cap_bytes=self.cap_bytes,
        )

    def reserve(
        self, job: str, step: int, nbytes: int, uid: int, now: datetime, durable_root: str | None = None
    ) -> Reservation:
        if nbytes > self.free_bytes:
            raise self._full(nbytes)
        reservation = Reservation(secrets.token_hex(8), job, step, nbytes, uid, now + self._ttl, durable_root)
        self.reservations[reservation.id] = reservation
        return reservation

    def release(self, job: str, step: int | None = None) -> list[Reservation]:
        """Drop the reservations of ``job`` (of one ``step`` of it, if given)."""
        mine = [r for r in self.reservations.values() if r.job == job and step in (None, r.step)]
        for reservation in mine:
            del self.reservations[reservation.id]
        return mine

    def commit(self, record: StepRecord) -> list[Reservation]:
        """Hold ``record`` in place of every reservation of its step (several ranks of a host may each have
        reserved for their own files); refused when it holds more than they reserved and the tier has free."""
        key = (record.job, record.step)
        held = self.records.get(key)
        reserved = sum(r.bytes for r in self.reservations.values() if (r.job, r.step) == key)
        growth = record.bytes - reserved - (held.bytes if held is not None else 0)
        if growth > self.free_bytes:
            raise self._full(growth)
        self.records[key] = record
        return self.release(record.job, record.step)

    def forget(self, job: str, step: int | None = None) -> list[StepRecord]:
        gone = [r for k, r in self.records.items() if k[0] == job and step in (None, k[1])]
        for record in gone:
            del self.records[(record.job, record.step)]
        return gone

    def has(self, job: str, step: int | None = None) -> bool:
        return any(k[0] == job and step in (None, k[1]) for k in self.records) or any(
            r.job == job and step in (None, r.step) for r in self.reservations.values()
        )

    def jobs(self) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for (job, step), record in sorted(self.records.items()):
            entry = out.setdefault(job, {"steps": [], "bytes": 0})
            entry["steps"].append(step)
            entry["bytes"] += record.bytes
        return out

    def steps_of(self, job: str) -> list[StepRecord]:
        """Newest first."""
        return sorted((r for (j, _), r in self.records.items() if j == job), key=lambda r: -r.step)
