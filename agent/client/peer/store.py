"""The full-state store's peer tier (issue 24 item 7): :class:`PeerCheckpointStore`, a checkpoint store
for a job whose every rank holds the whole state (DDP), used by every rank together. With ``tier="peer"`` an
emergency save puts one copy of the step into the RAM tier of each host *without* a notice, written by the
host's lowest rank: nothing is sent, and a notified host writes nothing. A resume takes the newest step a host
holds whole (CRC-checked) when it is newer than the root's; a host without it receives it through the group.
The agents drain a step into the root when the store's RamTier has ``drain_to`` (agent/ramtier/drain.py)."""

from __future__ import annotations

import contextlib
import json
import socket
import time
import warnings
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TypeVar

from agent.checkpoint.durable import presealed
from agent.checkpoint.manifest import Checkpoint, CheckpointError, CheckpointWarning, FileEntry, Verify
from agent.client.dcp._commit import Ranks
from agent.client.frameworks.torch import load_agreed
from agent.client.peer.evacuate import PeerTierUnusable, Place, host_key, plan, receive_file, send_file
from agent.client.peer.ramtier import (
    TIER_FILE,
    RamTier,
    RamTierError,
    Reservation,
    file_entry,
    read_tier_file,
    resolve_job_id,
    write_tier_file,
)
from agent.client.preempted import record_emergency
from agent.client.store import CheckpointStore, Skipped, Writer
from agent.client.store_failure import fall_back, summary

__all__ = ["Copy", "PeerCheckpointStore", "newest_copy", "newest_held"]

# tier.json's mark of a full-state step: one host's files are the whole step (a sharded one's are a part).
LAYOUT = "full"

_Loaded = TypeVar("_Loaded")


@dataclass(frozen=True)
class Copy:
    """One host's whole copy of a step in its RAM tier, as its tier.json describes it."""

    host: str
    step: int
    run: int
    files: Mapping[str, tuple[int, int]]  # name -> (size, CRC32)
    doc: Mapping[str, Any]


def newest_copy(copies: Sequence[Copy], durable: tuple[int, int] | None) -> list[Copy]:
    """The copies of the newest step (by run, then step) that some host holds whole and that is newer than
    ``durable`` (the root's newest (run, step)), one per host; empty when there is none. Pure."""
    newer = [c for c in copies if durable is None or (c.run, c.step) > durable]
    best = max(((c.run, c.step) for c in newer), default=None)
    return sorted((c for c in newer if (c.run, c.step) == best), key=lambda c: c.host)


class PeerCheckpointStore(CheckpointStore):
    """A full-state store of the whole job (one ``root``, one ``job``): made on every rank after
    ``init_process_group`` (a collective: its own gloo group); :meth:`save` and :meth:`load_latest` on every rank.
    ``tier="peer"``: an emergency save with ``noticed`` (``decision.noticed``) goes into the RAM tier of each
    host without a notice (``writer`` runs there on the host's lowest rank), or to the root with a
    :class:`CheckpointWarning` saying why. Other saves go to ``root``, written by rank 0. ``job``: see
    :func:`.ramtier.resolve_job_id`; ``ram_tier``: the tier's client (``RamTier(drain_to=root)``: the agents
    then drain each peer step into ``root`` as an ordinary step); the rest is CheckpointStore's."""

    def __init__(
        self,
        root: str | Path,
        keep: int = 3,
        *,
        tier: str = "peer",
        job: str | None = None,
        group: Any = None,
        ram_tier: RamTier | None = None,
        socket_path: str | Path | None = None,
        **options: Any,
    ) -> None:
        if tier not in ("durable", "peer"):
            raise ValueError(f"tier must be 'durable' or 'peer', got {tier!r}")
        super().__init__(root, keep, socket_path=socket_path, **options)
        self.tier = tier
        self.tiers = ram_tier or RamTier(socket_path)
        self.job = resolve_job_id(job, self.tiers.socket) if tier == "peer" else job
        self.ranks = Ranks(group)

    def save(
        self,
        step: int,
        writer: Writer,
        *,
        emergency: bool = False,
        notice_id: str | None = None,
        metadata: Mapping[str, Any] | None = None,
        noticed: Collection[int] | None = None,
    ) -> Checkpoint:
        """``step`` on every rank together: a peer emergency step into the surviving hosts' RAM (``path``: this
        host's copy or the first survivor's; ``metadata["tier"] == "peer"``), else into ``root`` by rank 0."""
        if emergency and self.tier == "peer":
            done = self._evacuate(step, writer, notice_id, metadata, noticed)
            if done is not None:
                return done
        outcome: Checkpoint | CheckpointError | None = None
        try:
            if self.ranks.rank == 0:
                outcome = super().save(
                    step, writer, emergency=emergency, notice_id=notice_id, metadata=metadata
                )
        except CheckpointError as exc:
            outcome = exc
        outcome = self.ranks.from_zero(outcome)
        if isinstance(outcome, CheckpointError):
            raise outcome
        if self.ranks.rank != 0:
            self.last_save = outcome
            if emergency:  # every rank's exec learns of it (rank 0's recorded it in CheckpointStore.save)
                record_emergency(step, path=outcome.path, notice_id=notice_id)
        return outcome

    def _evacuate(
        self,
        step: int,
        writer: Writer,
        notice_id: str | None,
        metadata: Mapping[str, Any] | None,
        noticed: Collection[int] | None,
    ) -> Checkpoint | None:
        """The peer save; None (with the same warning on every rank) when the root must take the step."""
        started = time.monotonic()
        self._report("started", step, emergency=True, notice_id=notice_id)
        try:
            run = int(self.ranks.from_zero(self.run_for(step) if self.ranks.rank == 0 else 0))
            if noticed is None:
                raise PeerTierUnusable("the ranks with a notice are unknown: pass noticed=decision.noticed")
            path, entries = _Evacuation(self, step, run, notice_id, metadata).run(writer, noticed)
        except PeerTierUnusable as exc:
            why = f"step {step} was not saved into the RAM of the hosts without a notice ({exc})"
            warnings.warn(f"{why}; saving it to {self.root} instead", CheckpointWarning, stacklevel=3)
            return None
        except Exception as exc:  # the group failed under it (a rank died): nothing usable was committed
            error = CheckpointError(f"the peer save of step {step} failed: {summary(exc)}")
            error.fallback = fall_back(self.committed, step, notice_id, error, sharded=False)
            flush = {"fallback_step": error.fallback.step} if error.fallback is not None else None
            self._report("failed", step, emergency=True, notice_id=notice_id, flush=flush)
            raise error from exc
        duration = time.monotonic() - started
        extra = {"tier": "peer", "job": self.job, "world_size": self.ranks.world_size}
        held = Copy("", step, run, entries, {"notice_id": notice_id})
        checkpoint = replace(
            _checkpoint(held, path, datetime.now(timezone.utc)),
            duration_s=duration,
            metadata={**dict(metadata or {}), **extra},
        )
        self.last_save = checkpoint
        self._report(
            "finished",
            step,
            duration_s=duration,
            size=checkpoint.bytes,
            emergency=True,
            notice_id=notice_id,
            path=path,
        )
        record_emergency(step, path=path, notice_id=notice_id, tier="peer")
        return checkpoint

    def close(self, timeout: float = 10.0) -> None:
        """:meth:`CheckpointStore.close`, then the store's process group is destroyed (see
        :class:`agent.client.dcp._commit.Ranks`): the store saves and loads no more."""
        super().close(timeout)
        self.ranks.release()

    def load_latest(
        self, load: Callable[[Checkpoint], _Loaded], verify: Verify = "checksum"
    ) -> tuple[Checkpoint, _Loaded] | None:
        """On every rank together: with ``tier="peer"``, the newest step a host holds whole in RAM if newer than
        the root's (sent to the hosts without it, which keep it), loaded on every rank; then the older RAM
        steps newer than the root's newest, then the root's steps (read by every rank), each skipped on every
        rank alike when it fails to verify or load anywhere (a CheckpointWarning naming the step and why; when
        none is left, one more lists them)."""
        skipped = Skipped(self.root)
        if self.tier == "peer":
            found = _Resume(self).load(load, verify, skipped)
            if found is not None:
                return found
        if not self.ranks.distributed:
            return self._load_latest(load, verify, skipped)
        return load_agreed(self, load, self.ranks.group, verify, skipped)


class _Evacuation:
    """One peer save of a full-state step (a collective of the store's group)."""

    def __init__(
        self,
        store: PeerCheckpointStore,
        step: int,
        run: int,
        notice_id: str | None,
        metadata: Mapping[str, Any] | None,
    ) -> None:
        self.store, self.step, self.run_, self.notice_id = store, step, run, notice_id
        self.metadata = dict(metadata or {})  # the drained step's manifest carries it, as the root's would
        self.ranks = store.ranks

    def run(self, writer: Writer, noticed: Collection[int]) -> tuple[Path, dict[str, tuple[int, int]]]:
        """Each surviving host's leader writes the step into its tier and commits it; the path of this rank's
        host's copy (a notified rank: the first surviving host's) and the files. PeerTierUnusable when no
        host could keep it; a CheckpointWarning names the hosts that could not when another did."""
        places = self.ranks.gather(self._place(noticed))
        the_plan = plan(places)  # PeerTierUnusable when a tier cannot be used or every host has a notice
        host = the_plan.host_of(self.ranks.rank)
        outcome: tuple[str, dict[str, tuple[int, int]]] | str | None = None
        if host not in the_plan.notified and self.ranks.rank == the_plan.leader(host):
            outcome = self._write(writer, host)  # one copy per host: each of its ranks holds the same state
        everyone = self.ranks.gather(outcome)
        problems = "; ".join(sorted({o for o in everyone if isinstance(o, str)}))
        copies = [o for o in everyone if isinstance(o, tuple)]
        if not copies:
            raise PeerTierUnusable(problems)
        if problems and self.ranks.rank == 0:
            warnings.warn(
                f"step {self.step} is in RAM on fewer hosts: {problems}", CheckpointWarning, stacklevel=4
            )
        mine = everyone[the_plan.leader(host)]
        path, files = mine if isinstance(mine, tuple) else copies[0]  # a notified host: the first survivor's
        return Path(path), dict(files)

    def _place(self, noticed: Collection[int]) -> Place:
        rank = self.ranks.rank
        try:
            return Place(rank, host_key(self.store.tiers.info()), rank in noticed, 0)
        except RamTierError as exc:
            return Place(rank, f"{socket.gethostname()}:?", rank in noticed, 0, str(exc))

    def _write(self, writer: Writer, host: str) -> tuple[str, dict[str, tuple[int, int]]] | str:
        """Reserve (what the newest step took: a commit may exceed it if the tier has room), write, list
        with CRCs, write tier.json, commit; a sentence on failure (its step freed)."""
        store, job = self.store, str(self.store.job)
        last = store.last_save or store.newest()
        try:
            reservation = store.tiers.reserve(job, self.step, last.bytes if last is not None else 0)
        except RamTierError as exc:
            return f"host {host}: {exc}"
        try:
            files = _listed(reservation.path, self.ranks.rank, presealed(writer(reservation.path)))
            every = {name: int(entry["size"]) for name, entry in files.items()}
            write_tier_file(
                reservation.path,
                job=job,
                step=self.step,
                run=self.run_,
                world_size=self.ranks.world_size,
                files=files,
                complete=True,
                extra={
                    "layout": LAYOUT,
                    "step_files": every,
                    "notice_id": self.notice_id,
                    "metadata": self.metadata,
                },
            )
            store.tiers.commit(job, self.step, reservation.id)
        except Exception as exc:  # the writer's, the tier's (full) or tmpfs's failure: the root may take it
            with contextlib.suppress(RamTierError):
                store.tiers.free(job, self.step)
            return f"host {host}: cannot keep step {self.step} in its RAM tier: {summary(exc)}"
        return str(reservation.path), {name: (int(e["size"]), int(e["crc32"])) for name, e in files.items()}


def _listed(directory: Path, rank: int, sealed: Mapping[str, FileEntry]) -> dict[str, dict[str, int]]:
    """tier.json's entries for what a writer put into ``directory`` (plain files only, side by side); the
    CRC32 a writer computed as it wrote (``DurableFile``: ``torch_writer``) is not computed again."""
    files = {p.name: p for p in sorted(directory.iterdir()) if p.name != TIER_FILE}
    odd = [str(p) for p in files.values() if not p.is_file() or p.is_symlink()]
    if odd or not files:
        raise PeerTierUnusable(f"the RAM tier keeps plain files only: {', '.join(odd) or 'none was written'}")
    known = {
        n: {"size": e.bytes, "crc32": e.crc32, "rank": rank} for n, e in sealed.items() if e.crc32 is not None
    }
    return {name: known.get(name) or file_entry(path, rank) for name, path in files.items()}


def newest_held(tier: RamTier, job: str, durable: tuple[int, int] | None) -> Checkpoint | None:
    """This host's newest whole copy of a full-state step newer than ``durable`` whose CRCs check out (a
    damaged one is skipped with a CheckpointWarning, and the next older one tried); None when there is none.
    For a process without the group (Lightning's ``resume_path``)."""
    try:
        listed = tier.job(job)
    except RamTierError as exc:
        if exc.reason != "missing":  # else the tier holds nothing for the job
            raise
        return None
    path = Path(str(listed["path"]))
    every = [c for e in listed.get("steps", []) if (c := _entry("", path, e))]
    for copy in sorted(every, key=lambda c: (c.run, c.step), reverse=True):
        if durable is not None and (copy.run, copy.step) <= durable:
            break
        checkpoint = _checkpoint(copy, path / str(copy.step))
        try:
            checkpoint.verify("checksum")
        except CheckpointError as exc:
            warnings.warn(f"skipping RAM step {copy.step}: {exc}", CheckpointWarning, stacklevel=2)
            continue
        return checkpoint
    return None


class _GiveUp(Exception):
    """The RAM step cannot be resumed (why: the message), on every rank alike: the root is tried."""


class _Resume:
    """Finds, spreads and loads the newest full-state RAM step that loads (a collective of the store's group)."""

    def __init__(self, store: PeerCheckpointStore) -> None:
        self.store, self.ranks, self.job = store, store.ranks, str(store.job)
        self.path: Path | None = None  # the job's directory in this host's tier, once listed

    def load(
        self, load: Callable[[Checkpoint], _Loaded], verify: Verify, skipped: Skipped
    ) -> tuple[Checkpoint, _Loaded] | None:
        """The RAM steps newer than the root's newest, newest first: the first that every rank loads, or None
        (the root follows). Each one passed over goes into ``skipped``, rank 0 warning why."""
        speaks = self.ranks.rank == 0
        newest = self.store.newest() if speaks else None  # the root's, by run then step
        durable = self.ranks.from_zero((newest.run, newest.step) if newest is not None else None)
        held = self.ranks.gather(self._held(durable))
        every = [c for h in held if not isinstance(h, str) for c in h[1]]
        unreachable = [h for h in held if isinstance(h, str)]
        newer = newest_copy(every, durable)
        if not newer:
            return None
        if unreachable:  # a host's tier cannot be asked: no RAM step can be gathered
            why = f"it cannot be gathered: {'; '.join(unreachable)}"
            skipped.add(f"RAM step {newer[0].step}", why, loud=speaks)
            return None
        hosts: dict[str, list[int]] = {}
        for rank, (name, _) in enumerate(held):  # every rank's (host, copies), none unreachable
            hosts.setdefault(name, []).append(rank)
        host = held[self.ranks.rank][0]
        while copies := newest_copy(every, durable):
            try:
                return self._load(copies, hosts, host, load, verify)
            except _GiveUp as exc:
                skipped.add(f"RAM step {copies[0].step}", exc, loud=speaks)
            every = [c for c in every if (c.run, c.step) != (copies[0].run, copies[0].step)]
        return None

    def _load(
        self,
        copies: Sequence[Copy],
        hosts: Mapping[str, list[int]],
        host: str,
        load: Callable[[Checkpoint], _Loaded],
        verify: Verify,
    ) -> tuple[Checkpoint, _Loaded]:
        """Check the hosts' copies of one step, spread a good one to the hosts without it, load it on every
        rank; _GiveUp on every rank alike when any of it fails (a ``mismatch`` is raised)."""
        # A holder whose copy fails its CRCs drops out; a host without a good copy receives the first one's.
        good = self.ranks.gather(
            self._check(copies, host, verify) if self.ranks.rank == hosts[host][0] else None
        )
        holders = [c for c in copies if c.host in good]
        if not holders:
            raise _GiveUp(f"no copy of it checks out: {'; '.join(g[1:] for g in good if g)}")
        checkpoint = _checkpoint(holders[0], self._spread(holders[0], hosts, host, {c.host for c in holders}))
        try:
            outcome: tuple[str | None, Any] = (None, load(checkpoint))
        except CheckpointError as exc:
            if exc.reason == "mismatch":
                raise
            outcome = (f"rank {self.ranks.rank}: {exc}", None)
        _give_up_if("it does not load", [f for f in self.ranks.gather(outcome[0]) if f])
        return checkpoint, outcome[1]

    def _held(self, durable: tuple[int, int] | None) -> tuple[str, list[Copy]] | str:
        """This rank's host and the whole copies of the job's steps it holds (freeing those not newer than
        ``durable``); a sentence when its tier cannot be asked."""
        try:
            host = host_key(self.store.tiers.info())
        except RamTierError as exc:
            return f"rank {self.ranks.rank}: {exc}"
        try:
            listed = self.store.tiers.job(self.job)
        except RamTierError as exc:  # "missing": the tier holds nothing for the job
            return (host, []) if exc.reason == "missing" else f"rank {self.ranks.rank}: {exc}"
        self.path = Path(str(listed["path"]))
        copies = []
        for entry in listed.get("steps", []):
            copy = _entry(host, self.path, entry)
            if copy is not None and durable is not None and (copy.run, copy.step) <= durable:
                with contextlib.suppress(RamTierError):
                    self.store.tiers.free(self.job, copy.step)
            elif copy is not None:
                copies.append(copy)
        return (host, copies)

    def _check(self, copies: Sequence[Copy], host: str, verify: Verify) -> str | None:
        """The host's leader checks its copy (if it holds one): its host, or "!why" when it is damaged."""
        mine = next((c for c in copies if c.host == host), None)
        if mine is None or self.path is None:
            return None
        try:
            _checkpoint(mine, self.path / str(mine.step)).verify(verify, self.store.hash_workers)
        except CheckpointError as exc:  # damaged: freed, so that this host can receive a good copy
            with contextlib.suppress(RamTierError):
                self.store.tiers.free(self.job, mine.step)
            return f"!{host}: {exc}"
        return host

    def _spread(self, source: Copy, hosts: Mapping[str, list[int]], host: str, holding: set[str]) -> Path:
        """Every host without a good copy receives the source's files (leader to leader, CRC-checked) and
        commits them to its own tier; this rank's host's step directory."""
        answer: str | None = None
        reservation: Reservation | None = None
        if self.ranks.rank == hosts[host][0]:
            try:
                if host in holding and self.path is not None:
                    answer = str(self.path / str(source.step))
                else:
                    need = sum(size for size, _ in source.files.values())
                    reservation = self.store.tiers.reserve(self.job, source.step, need)
                    answer = str(reservation.path)
            except RamTierError as exc:
                answer = f"!{host}: {exc}"
        answers = self.ranks.gather(answer)
        problems = [a[1:] for a in answers if isinstance(a, str) and a.startswith("!")]
        sender = hosts[source.host][0]
        for receiver_host, ranks in hosts.items():  # the same order on every rank
            if receiver_host in holding or problems:
                continue
            for name, (size, crc) in sorted(source.files.items()):
                if self.ranks.rank == sender:
                    send_file(self.ranks.group, ranks[0], Path(str(answers[sender])) / name, size)
                elif self.ranks.rank == ranks[0]:
                    got, problem = receive_file(self.ranks.group, sender, Path(str(answer)) / name, size)
                    if problem is None and got != crc:
                        problem = f"{name} does not match its CRC32 in tier.json"
                    if problem is not None:
                        problems.append(f"rank {self.ranks.rank}: {problem}")
        if reservation is not None and not problems:
            problems += self._keep(source, reservation)
        found = sorted({p for mine in self.ranks.gather(problems) for p in mine})
        if found and reservation is not None:
            with contextlib.suppress(RamTierError):
                self.store.tiers.free(self.job, source.step)
        _give_up_if("it could not be gathered", found)
        return Path(str(answers[hosts[host][0]]))

    def _keep(self, source: Copy, reservation: Reservation) -> list[str]:
        """Commit a received copy to this host's tier (its tier.json the source's), so it outlives the load."""
        try:
            staged = reservation.path / f".{TIER_FILE}.received"
            staged.write_text(json.dumps(dict(source.doc), indent=1))
            staged.rename(reservation.path / TIER_FILE)
            self.store.tiers.commit(self.job, source.step, reservation.id)
        except (OSError, RamTierError) as exc:
            return [f"rank {self.ranks.rank}: cannot keep step {source.step} in its RAM tier: {exc}"]
        return []


def _give_up_if(what: str, problems: Sequence[str]) -> None:
    if problems:
        raise _GiveUp(f"{what}: {'; '.join(problems)}")


def _entry(host: str, path: Path, entry: Mapping[str, Any]) -> Copy | None:
    doc = read_tier_file(path / str(entry["step"]))
    return _copy(host, int(entry["step"]), doc) if entry.get("complete") and doc else None


def _copy(host: str, step: int, doc: Mapping[str, Any]) -> Copy | None:
    """A host's copy from its tier.json, when it is a full-state step whose files are all there; else None."""
    if doc.get("layout") != LAYOUT:
        return None
    try:
        files = {str(n): (int(e["size"]), int(e["crc32"])) for n, e in dict(doc["files"]).items()}
        every = {str(n): int(s) for n, s in dict(doc["step_files"]).items()}
        run = doc.get("run")
    except (KeyError, TypeError, ValueError):
        return None
    if not every or any(files.get(n, (-1, 0))[0] != size for n, size in every.items()):
        return None
    run = run if isinstance(run, int) and not isinstance(run, bool) else 0
    return Copy(host, step, run, {n: files[n] for n in every}, doc)


def _checkpoint(copy: Copy, directory: Path, moment: datetime | None = None) -> Checkpoint:
    if moment is None:
        moment = datetime.now(timezone.utc)
        with contextlib.suppress(TypeError, ValueError):
            moment = datetime.fromisoformat(str(copy.doc.get("time")).replace("Z", "+00:00"))
    notice = copy.doc.get("notice_id")
    entries = tuple(FileEntry(name, size, crc) for name, (size, crc) in sorted(copy.files.items()))
    return Checkpoint(
        step=copy.step,
        path=directory,
        time=moment,
        bytes=sum(e.bytes for e in entries),
        files=entries,
        emergency=True,
        notice_id=notice if isinstance(notice, str) else None,
        metadata={"tier": "peer", "world_size": int(copy.doc.get("world_size", 0) or 0)},
        run=copy.run,
    )
