"""The RAM tier's books, on the event loop and without I/O: the committed steps, the reservations that count
against the cap until they are committed, released or expire, what the jobs' directories were last measured
to hold, and the refusals when the cap is reached. A job is ``(uid, job)``: its uid comes from the kernel
(SO_PEERCRED), never from a path, so no user can reach or squat another user's job id.

The rules (docs/ram-tier.md, "How much memory"):
- a step counts what was reserved for it until it is committed, then what its directory held at the commit;
  bytes found on the tier beyond that (written past a reservation, into a committed step, or outside any
  step) count too, as ``overrun``, so the cap holds whatever the jobs write;
- when one uid's reservation does not fit, reservations of uids above their fair share (the cap divided by
  the uids holding or asking) are revoked, newest first, while they are above it, as long as the asker stays
  within its own share;
- a uid holds at most ``max_reservations`` live reservations (429 beyond).
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from agent.ramtier.errors import TierError
from agent.ramtier.inventory import StepRecord

Key = tuple[int, str, int]  # uid, job, step
# What a job's directory holds by entry name (a step's number as text, or anything else found there).
Measured = Mapping[tuple[int, str], Mapping[str, int]]


@dataclass(frozen=True)
class Reservation:
    id: str
    uid: int
    gid: int
    job: str
    step: int
    bytes: int
    expires: datetime
    durable_root: str | None = None

    @property
    def key(self) -> Key:
        return (self.uid, self.job, self.step)


@dataclass(frozen=True)
class Overrun:
    """Bytes on the tier that nothing accounts for: in a step (``step`` set) beyond what it was given, or
    under a job's directory outside any step (``name``)."""

    uid: int
    job: str
    name: str
    step: int | None
    bytes: int
    accounted: int


class Holdings:
    def __init__(self, cap_bytes: int, ttl_s: float, max_reservations: int = 256) -> None:
        self.cap_bytes = cap_bytes
        self._ttl = timedelta(seconds=ttl_s)
        self.max_reservations = max_reservations
        self.records: dict[Key, StepRecord] = {}
        self.reservations: dict[str, Reservation] = {}
        self.overruns: list[Overrun] = []
        self.refusals = 0

    @property
    def committed_bytes(self) -> int:
        return sum(record.bytes for record in self.records.values())

    @property
    def overrun_bytes(self) -> int:
        return sum(o.bytes - o.accounted for o in self.overruns)

    @property
    def used_bytes(self) -> int:
        """What the committed steps hold, and whatever else was found written on the tier."""
        return self.committed_bytes + self.overrun_bytes

    @property
    def reserved_bytes(self) -> int:
        return sum(r.bytes for r in self.reservations.values())

    @property
    def free_bytes(self) -> int:
        return max(0, self.cap_bytes - self.used_bytes - self.reserved_bytes)

    def held_by(self, uid: int) -> int:
        """Everything ``uid`` holds: committed, reserved and overrun bytes."""
        return (
            sum(r.bytes for k, r in self.records.items() if k[0] == uid)
            + sum(r.bytes for r in self.reservations.values() if r.uid == uid)
            + sum(o.bytes - o.accounted for o in self.overruns if o.uid == uid)
        )

    def accounted(self, uid: int, job: str, step: int) -> int:
        """What a step may hold: its committed bytes, and what is reserved for it."""
        record = self.records.get((uid, job, step))
        reserved = sum(r.bytes for r in self.reservations.values() if r.key == (uid, job, step))
        return (record.bytes if record is not None else 0) + reserved

    def measure(self, measured: Measured) -> list[Overrun]:
        """Take what the jobs' directories hold now; the entries that hold more than they were given."""
        found: list[Overrun] = []
        for (uid, job), entries in measured.items():
            for name, nbytes in entries.items():
                step = int(name) if name.isdigit() else None
                given = 0 if step is None else self.accounted(uid, job, step)
                if nbytes > given:
                    found.append(Overrun(uid, job, name, step, nbytes, given))
        self.overruns = found
        return found

    def over_cap(self) -> list[Overrun]:
        """The overruns to evict, largest first, until the tier is back within its cap (none while it is)."""
        excess = self.used_bytes + self.reserved_bytes - self.cap_bytes
        chosen: list[Overrun] = []
        for overrun in sorted(self.overruns, key=lambda o: o.accounted - o.bytes):
            if excess <= 0:
                break
            chosen.append(overrun)
            excess -= overrun.bytes - overrun.accounted + self._freed_with(overrun)
        return chosen

    def _freed_with(self, overrun: Overrun) -> int:
        """What else goes when an overrun step goes: its committed bytes and its reservations."""
        return 0 if overrun.step is None else self.accounted(overrun.uid, overrun.job, overrun.step)

    def expire(self, now: datetime) -> list[Reservation]:
        """Drop the reservations whose time is up; the caller removes the steps nobody committed."""
        gone = [r for r in self.reservations.values() if r.expires <= now]
        for reservation in gone:
            del self.reservations[reservation.id]
        return gone

    def _full(self, need: int, uid: int) -> TierError:
        self.refusals += 1
        return TierError(
            507,
            f"ram tier full: need {need} bytes, free {self.free_bytes} of cap {self.cap_bytes} "
            f"(used {self.used_bytes}, reserved {self.reserved_bytes}; uid {uid} holds {self.held_by(uid)} of "
            f"a fair share of {self.fair_share(uid)}): free the steps a job no longer needs "
            "(DELETE /v1/ram-tier/jobs/JOB) or raise ram_tier.cap_bytes",
            need_bytes=need,
            free_bytes=self.free_bytes,
            cap_bytes=self.cap_bytes,
        )

    def fair_share(self, asker: int) -> int:
        """The cap divided by the uids holding anything on the tier, the asker counted."""
        uids = {k[0] for k in self.records} | {r.uid for r in self.reservations.values()} | {asker}
        return self.cap_bytes // len(uids)

    def revocable(self, uid: int, need: int) -> list[Reservation]:
        """The other uids' reservations to revoke so that ``need`` fits, newest first from the uids that hold
        more than their fair share (while they do); none when ``uid`` would go above its own share, or when
        revoking all that may be revoked would not make room."""
        share = self.fair_share(uid)
        if self.held_by(uid) + need > share:
            return []
        room = self.free_bytes
        held = {r.uid: self.held_by(r.uid) for r in self.reservations.values()}
        chosen: list[Reservation] = []
        for reservation in sorted(self.reservations.values(), key=lambda r: r.expires, reverse=True):
            if room >= need:
                break
            if reservation.uid == uid or held[reservation.uid] <= share:
                continue
            held[reservation.uid] -= reservation.bytes
            room += reservation.bytes
            chosen.append(reservation)
        return chosen if room >= need else []

    def reserve(
        self,
        key: Key,
        nbytes: int,
        gid: int,
        now: datetime,
        durable_root: str | None = None,
    ) -> tuple[Reservation, list[Reservation]]:
        """A reservation of ``nbytes`` for the step ``key``, and the reservations of other uids revoked to
        make room for it (their steps, if never committed, are the caller's to remove)."""
        uid = key[0]
        mine = sum(1 for r in self.reservations.values() if r.uid == uid)
        if mine >= self.max_reservations:
            raise TierError(
                429,
                f"uid {uid} holds {mine} live reservations, the most the tier gives one user "
                "(ram_tier.max_reservations_per_uid): commit or free the steps it reserved, or wait for "
                "their reservation_ttl_s",
            )
        revoked: list[Reservation] = []
        if nbytes > self.free_bytes:
            revoked = self.revocable(uid, nbytes)
            if not revoked:
                raise self._full(nbytes, uid)
            for reservation in revoked:
                del self.reservations[reservation.id]
        reservation = Reservation(
            secrets.token_hex(8), uid, gid, key[1], key[2], nbytes, now + self._ttl, durable_root
        )
        self.reservations[reservation.id] = reservation
        return reservation, revoked

    def release(self, uid: int, job: str, step: int | None = None) -> list[Reservation]:
        """Drop the reservations of ``job`` (of one ``step`` of it, if given)."""
        mine = [
            r for r in self.reservations.values() if (r.uid, r.job) == (uid, job) and step in (None, r.step)
        ]
        for reservation in mine:
            del self.reservations[reservation.id]
        return mine

    def commit(self, record: StepRecord) -> list[Reservation]:
        """Hold ``record`` in place of every reservation of its step (several ranks of a host may each have
        reserved for their own files); refused when it holds more than they reserved and the tier has free."""
        key = (record.uid, record.job, record.step)
        held = self.records.get(key)
        reserved = sum(r.bytes for r in self.reservations.values() if r.key == key)
        growth = record.bytes - reserved - (held.bytes if held is not None else 0)
        # An overrun already measured in this step is the same bytes as the growth: not counted twice.
        overrun = sum(o.bytes - o.accounted for o in self.overruns if (o.uid, o.job, o.step) == key)
        if growth > self.free_bytes + overrun:
            raise self._full(growth, record.uid)
        self.records[key] = record
        self.overruns = [o for o in self.overruns if (o.uid, o.job, o.step) != key]
        return self.release(record.uid, record.job, record.step)

    def forget(self, uid: int, job: str, step: int | None = None) -> list[StepRecord]:
        gone = [r for k, r in self.records.items() if k[:2] == (uid, job) and step in (None, k[2])]
        for record in gone:
            del self.records[(record.uid, record.job, record.step)]
        self.overruns = [
            o for o in self.overruns if (o.uid, o.job) != (uid, job) or step not in (None, o.step)
        ]
        return gone

    def has(self, uid: int, job: str, step: int | None = None) -> bool:
        return any(k[:2] == (uid, job) and step in (None, k[2]) for k in self.records) or any(
            (r.uid, r.job) == (uid, job) and step in (None, r.step) for r in self.reservations.values()
        )

    def jobs(self, uid: int | None = None) -> dict[str, dict[str, Any]]:
        """The jobs of ``uid`` by id (every uid's, as ``<uid>/<job>``, when None)."""
        out: dict[str, dict[str, Any]] = {}
        for (owner, job, step), record in sorted(self.records.items()):
            if uid is not None and owner != uid:
                continue
            entry = out.setdefault(job if uid is not None else f"{owner}/{job}", {"steps": [], "bytes": 0})
            entry["steps"].append(step)
            entry["bytes"] += record.bytes
            # Where the newest step's copies are: the ranks whose files this host holds, and the job's placement.
            entry["newest"] = {
                "step": step,
                "kind": record.kind,
                "ranks_here": sorted({f.rank for f in record.files.values()}),
                "placement": {host: dict(where) for host, where in record.placement.items()},
            }
        return out

    def steps_of(self, uid: int, job: str) -> list[StepRecord]:
        """Newest first."""
        return sorted((r for k, r in self.records.items() if k[:2] == (uid, job)), key=lambda r: -r.step)
