"""Evacuate, don't flush: an emergency sharded save into the RAM tiers of the hosts that stay.

Every rank of a host without a notice writes its DCP shard into its own host's RAM tier (tmpfs, reserved from
the agent first); each rank of a host with a notice streams its shard, as DCP writes it, through a gloo group
of the store's own (no new listener; :mod:`agent.client.peer._stream`) to a buddy rank on the next host in
the ring that has none, which writes it into its own RAM tier beside its own DCP write (without a stream
group, it writes its shard into its own host's tier and sends the files through the store's group after the
save); one gather
confirms that every file of the step is in some surviving host's RAM with its CRC32; each surviving host
writes ``tier.json`` and commits the step to its agent; the notified hosts free their copy. Nothing is written
under the durable root. When the peer tier cannot be used (every host has a notice, an agent is unreachable or
its tier disabled or full, a transfer fails) every rank raises the same :class:`PeerTierUnusable` and the
store saves to the durable root instead.

A "host" is the RAM tier a rank's agent serves (the host name and the tier's path): one agent per host.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.checkpoint.stateful import Stateful

from agent.checkpoint.manifest import Checkpoint, FileEntry
from agent.client.dcp._commit import Ranks, owner, zip_crc_off
from agent.client.peer._plan import PeerTierUnusable, Place, Plan, fallback_reason, plan
from agent.client.peer._stream import Streams
from agent.client.peer._transfer import file_crc, receive_file, send_file
from agent.client.peer.ramtier import TIER_FILE, RamTier, RamTierError, write_tier_file
from agent.client.store_failure import convertible, summary

# Room reserved beyond the tensors' bytes: DCP's framing per rank, and rank 0's .metadata.
_SLACK = 1.05
_SLACK_BYTES = 4 << 20

__all__ = [  # send_file and receive_file: re-exported from _transfer, where they live
    "Evacuated",
    "Evacuation",
    "PeerTierUnusable",
    "Place",
    "Plan",
    "SurvivorsKeep",
    "estimate",
    "fallback_reason",
    "host_key",
    "plan",
    "receive_file",
    "resolve",
    "send_file",
]


@dataclass(frozen=True)
class Evacuated:
    """A step held in the surviving hosts' RAM tiers: ``path`` is this rank's files' holder's step
    directory; ``files`` every file of the step (name → size, CRC32, owning rank); ``holders`` the host of
    each file."""

    step: int
    job: str
    path: Path
    files: Mapping[str, Mapping[str, int]]
    holders: Mapping[str, str]
    sent_bytes: int  # what this rank sent to its buddy (its own shard's bytes when it saved them itself)

    def checkpoint(
        self, notice_id: str | None, metadata: Mapping[str, Any], run: int, duration_s: float
    ) -> Checkpoint:
        """The step as the stores describe one (its path a RAM tier's step directory)."""
        entries = tuple(FileEntry(n, int(e["size"]), int(e["crc32"])) for n, e in sorted(self.files.items()))
        return Checkpoint(
            step=self.step,
            path=self.path,
            time=datetime.now(timezone.utc),
            bytes=sum(e.bytes for e in entries),
            files=entries,
            emergency=True,
            notice_id=notice_id,
            duration_s=duration_s,
            metadata=dict(metadata),
            run=run,
        )


def host_key(info: Mapping[str, Any]) -> str:
    """This host as the evacuation knows it: its name and the RAM tier's path (tests run one agent per
    simulated host on one machine, each with its own tier)."""
    return f"{socket.gethostname()}:{os.path.realpath(str(info.get('path', '')))}"


def estimate(state: Any) -> int:
    """Bytes the tensors of a (nested) state dict take on this rank, DTensors by their local shard."""
    if isinstance(state, torch.Tensor):
        local = state.to_local() if hasattr(state, "to_local") else state
        return int(local.numel() * local.element_size())
    if isinstance(state, Mapping):
        return sum(estimate(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(estimate(v) for v in state)
    return 0


class SurvivorsKeep(DefaultSavePlanner):
    """DCP's save planner, except that an item (a tensor, a value) that a rank of a host without a notice
    also holds — a DDP replica, a full-state copy — is never written by a rank of a notified host: those
    ranks write (and send) only what no survivor has. DCP's own deduplication then spreads the rest."""

    def __init__(self, notified: Collection[int]) -> None:
        super().__init__()
        self.notified = frozenset(notified)

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        kept = {
            i.index for rank, plan in enumerate(all_plans) if rank not in self.notified for i in plan.items
        }
        narrowed = [
            replace(plan, items=[i for i in plan.items if i.index not in kept])
            if rank in self.notified
            else plan
            for rank, plan in enumerate(all_plans)
        ]
        return super().create_global_plan(narrowed)


def resolve(state: Mapping[str, Any]) -> dict[str, Any]:
    """The state dict DCP would save: each ``Stateful`` replaced by its ``state_dict()`` (once)."""
    return {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in state.items()}


class Evacuation:
    """One emergency step evacuated by every rank of the store's group (a collective throughout)."""

    def __init__(
        self, ranks: Ranks, group: Any, tier: RamTier, job: str, thread_count: int = 1, stream: Any = None
    ) -> None:
        """``stream``: the gloo group the notified ranks stream their shards on (never ``group``, where DCP's
        collectives run); None: they write them into their own RAM tier and send the files afterwards."""
        self.ranks = ranks
        self.group = group
        self.stream = stream
        self.tier = tier
        self.job = job
        self.thread_count = thread_count

    def run(
        self,
        step: int,
        run: int,
        state: Mapping[str, Any],
        noticed: Collection[int],
        notice_id: str | None = None,
    ) -> Evacuated:
        """Evacuate ``state`` as ``step`` (of ``run``); ``noticed``: the ranks whose host has a notice.
        PeerTierUnusable on every rank when it cannot be done (nothing is committed then)."""
        resolved = resolve(state)
        # The step's notice is the notified ranks' (the hosts that commit it have none of their own), so that
        # a resume anywhere marks it handled instead of flushing for it again.
        notice_id = next((n for n in self.ranks.gather(notice_id, self.group) if n), None)
        places = self.ranks.gather(self._place(noticed, estimate(resolved)), self.group)
        the_plan = plan(places)
        host = the_plan.host_of(self.ranks.rank)
        directory, reservation = self._reserve(the_plan, step, places, host)
        try:
            streams = self._save(the_plan, step, resolved, directory)
            sums = streams.fs
            listed = self._agree(self._own_files(directory, streams.sent), "listing the shard files")
            described = [files for files, _ in listed]
            streamed = [sent for _, sent in listed]
            received = self._transfer(the_plan, directory, described, streamed, sums.sums)
            received = self._streamed(the_plan, described, streamed, streams, received)
            kept = self._held(the_plan, directory, described, received, sums.sums)
            held = self._agree(kept, "confirming the copies")
            files, holders = self._confirm(the_plan, held, described)
            extra = {
                "step_files": {n: int(e["size"]) for n, e in files.items()},
                "notice_id": notice_id,
                "placement": the_plan.placement_json(),  # where each notified host's shards went, and why
            }
            self._commit(the_plan, step, run, host, directory, reservation, files, holders, extra)
        except Exception:  # nothing committed: the host's reservation goes
            if self.ranks.rank == the_plan.leader(host):
                self._free(step)
            raise
        if host in the_plan.notified and self.ranks.rank == the_plan.leader(host):
            self._free(step)  # every file of the step is in a survivor's RAM now
        directories = self.ranks.gather(str(directory), self.group)
        holder = the_plan.host_of(the_plan.buddy.get(self.ranks.rank, self.ranks.rank))
        sent = sum(described[self.ranks.rank].values())
        return Evacuated(step, self.job, Path(directories[the_plan.leader(holder)]), files, holders, sent)

    # -- the phases, each ending in one collective every rank takes part in -------------------------------

    def _save(self, the_plan: Plan, step: int, state: dict[str, Any], directory: Path) -> Streams:
        """DCP's save of every rank's shard, each file's CRC32 summed as it is written: a notified rank's
        shard files streamed to its buddy (with a stream group), the others' into their RAM tier."""
        rank = self.ranks.rank
        buddy = the_plan.buddy.get(rank) if self.stream is not None else None
        senders = the_plan.senders_to(rank) if self.stream is not None else []
        try:
            with zip_crc_off(), Streams(self.stream, buddy, senders, directory) as streams:
                writer = FileSystemWriter(directory, sync_files=False, thread_count=self.thread_count)
                writer.fs = streams.fs  # each file's CRC32 as it is written (or streamed)
                planner = SurvivorsKeep(the_plan.buddy)
                dcp_save(state, storage_writer=writer, planner=planner, process_group=self.group)
        except BaseException as exc:
            if not convertible(exc) or isinstance(exc, RuntimeError):  # DCP gathers its own failures:
                raise  # a bare one is the group failing under the save (a rank died mid-stream)
            raise PeerTierUnusable(f"writing step {step} into the RAM tier failed: {summary(exc)}") from exc
        return streams

    def _place(self, noticed: Collection[int], nbytes: int) -> Place:
        rank = self.ranks.rank
        try:
            info = self.tier.info()
        except RamTierError as exc:
            where = f"{socket.gethostname()}:?"
            return Place(rank, where, rank in noticed, nbytes, str(exc), fallback_reason(exc))
        return Place(rank, host_key(info), rank in noticed, nbytes, domain=RamTier.domain_of(info))

    def _reserve(
        self, the_plan: Plan, step: int, places: Sequence[Place], host: str, also: Mapping[int, int] = {}
    ) -> tuple[Path, str]:
        """The host's leader reserves room for its ranks' shards and for those its ranks receive (from their
        buddies in ``the_plan``, and in ``also``: a snapshot's second copies); every rank learns its host's
        step directory."""
        answer: tuple[str, str] | PeerTierUnusable = ("", "")  # (path, reservation), or the refusal
        if self.ranks.rank == the_plan.leader(host):
            own = set(dict(the_plan.hosts)[host])
            ranks = set(own)
            if host in the_plan.notified and self.stream is not None:  # its shards are streamed to buddies:
                ranks = set()  # at most a .metadata lands here
            senders = [*the_plan.buddy.items(), *also.items()]
            ranks |= {s for s, r in senders if r in own}
            need = sum(int(places[r].estimate * _SLACK) for r in ranks) + _SLACK_BYTES
            try:
                reservation = self.tier.reserve(self.job, step, need)
                answer = (str(reservation.path), reservation.id)
            except RamTierError as exc:
                answer = PeerTierUnusable(f"host {host}: {exc}", fallback_reason(exc))
        everyone = self.ranks.gather(answer, self.group)
        refused = [a for a in everyone if isinstance(a, PeerTierUnusable)]
        if refused:
            if isinstance(answer, tuple) and answer[1]:
                self._free(step)
            raise PeerTierUnusable("; ".join(sorted({str(a) for a in refused})), refused[0].reason)
        mine = everyone[the_plan.leader(host)]
        return Path(mine[0]), str(mine[1])

    def _own_files(self, directory: Path, sent: dict[str, int]) -> tuple[dict[str, int], list[str]] | str:
        """This rank's files of the step (name → size), those in ``directory`` and those it streamed
        (``sent``), and the names of the streamed ones."""
        world = self.ranks.world_size
        try:
            written = {
                p.name: p.stat().st_size
                for p in sorted(directory.iterdir())
                if p.is_file()
                and p.name != TIER_FILE
                and owner(p.name, world) == self.ranks.rank
                and not p.name.endswith(".tmp")
            }
        except OSError as exc:
            return f"rank {self.ranks.rank}: cannot list {directory}: {exc}"
        return {**written, **sent}, sorted(sent)

    def _agree(self, mine: Any, what: str) -> list[Any]:
        """Gather every rank's value; PeerTierUnusable on every rank when one of them is a problem."""
        everyone = self.ranks.gather(mine, self.group)
        problems = [v for v in everyone if isinstance(v, str)]
        if problems:
            raise PeerTierUnusable(f"{what}: {'; '.join(problems)}")
        return everyone

    def _transfer(
        self,
        the_plan: Plan,
        directory: Path,
        described: list[dict[str, int]],
        streamed: list[list[str]],
        sums: Mapping[str, tuple[int, int]],
    ) -> dict[str, int] | str:
        """Senders send the files they did not stream, chunk by chunk, then each file's CRC32 (``sums``: as
        it was written); receivers write them into their RAM tier and check the CRC. Returns the files
        received (name → CRC32), or a problem."""
        rank = self.ranks.rank
        if rank in the_plan.buddy:
            self._send_files(the_plan.buddy[rank], directory, described[rank], sums, streamed[rank])
            return {}
        received: dict[str, int] = {}
        problems: list[str] = []
        for sender in the_plan.senders_to(rank):
            self._receive_files(sender, directory, described[sender], streamed[sender], received, problems)
        return "; ".join(problems) if problems else received

    def _send_files(
        self,
        to: int,
        directory: Path,
        files: Mapping[str, int],
        sums: Mapping[str, tuple[int, int]],
        skip: Collection[str] = (),
    ) -> None:
        """Send ``files`` (name → size; but ``skip``) from ``directory`` to rank ``to``, each with its CRC32 as
        it was written when ``sums`` has it whole."""
        for name, size in sorted(files.items()):
            if name in skip:
                continue
            crc, written = sums.get(name, (None, -1))
            send_file(self.group, to, directory / name, size, crc=crc if written == size else None)

    def _receive_files(
        self,
        sender: int,
        directory: Path,
        files: Mapping[str, int],
        skip: Collection[str],
        received: dict[str, int],
        problems: list[str],
    ) -> None:
        """Receive what :meth:`_send_files` sends from ``sender`` into ``directory``: each file's CRC32 into
        ``received``, or its problem into ``problems``."""
        for name, size in sorted(files.items()):
            if name in skip:
                continue
            crc, problem = receive_file(self.group, sender, directory / name, size)
            if problem:
                problems.append(f"rank {self.ranks.rank}: {problem}")
            else:
                received[name] = crc

    def _streamed(
        self,
        the_plan: Plan,
        described: list[dict[str, int]],
        streamed: list[list[str]],
        streams: Streams,
        received: dict[str, int] | str,
    ) -> dict[str, int] | str:
        """``received`` with the files streamed to this rank, each whole (the size its sender lists) and
        with its CRC32; a problem when one is missing or the stream broke."""
        problems = [received] if isinstance(received, str) else []
        problems += [f"rank {self.ranks.rank}: {streams.problem}"] if streams.problem else []
        got = dict(received) if isinstance(received, dict) else {}
        for sender in the_plan.senders_to(self.ranks.rank):
            for name in streamed[sender]:
                crc, size = streams.received.get(name, (0, -1))
                if size != described[sender][name]:
                    problems.append(f"rank {self.ranks.rank}: {name} from rank {sender} did not arrive whole")
                got[name] = crc
        return "; ".join(problems) if problems else got

    def _held(
        self,
        the_plan: Plan,
        directory: Path,
        described: list[dict[str, int]],
        received: dict[str, int] | str,
        sums: Mapping[str, tuple[int, int]],
    ) -> dict[str, dict[str, int]] | str:
        """What this rank holds in a surviving host's RAM, with CRC32s (a notified rank holds nothing): its
        own files' as they were written (``sums``; read back only for one that was not summed whole)."""
        rank = self.ranks.rank
        if isinstance(received, str):
            return received
        if rank in the_plan.buddy:
            return {}
        held: dict[str, dict[str, int]] = {}
        world = self.ranks.world_size
        for name, size in described[rank].items():
            crc, written = sums.get(name, (0, -1))
            try:
                crc = crc if written == size else file_crc(directory / name)
                held[name] = {"size": size, "crc32": crc, "rank": owner(name, world)}
            except OSError as exc:
                return f"rank {rank}: cannot read back {directory / name}: {exc}"
        for name, crc in received.items():
            size = next(own[name] for own in described if name in own)
            held[name] = {"size": size, "crc32": crc, "rank": owner(name, world)}
        return held

    def _confirm(
        self, the_plan: Plan, held: list[dict[str, dict[str, int]]], described: list[dict[str, int]]
    ) -> tuple[dict[str, dict[str, int]], dict[str, str]]:
        """Every file of the step is held by some survivor, with its size: the files and their hosts."""
        files: dict[str, dict[str, int]] = {}
        holders: dict[str, str] = {}
        for rank, entries in enumerate(held):
            for name, entry in entries.items():
                files[name] = dict(entry)
                holders[name] = the_plan.host_of(rank)
        sizes = {name: size for own in described for name, size in own.items()}
        missing = sorted(n for n, size in sizes.items() if n not in files or files[n]["size"] != size)
        if missing:
            raise PeerTierUnusable(f"not in any surviving host's RAM: {', '.join(missing)}")
        return files, holders

    def _commit(
        self,
        the_plan: Plan,
        step: int,
        run: int,
        host: str,
        directory: Path,
        reservation: str,
        files: Mapping[str, Mapping[str, int]],
        holders: Mapping[str, str],
        extra: Mapping[str, Any],
    ) -> None:
        """Each surviving host's leader writes tier.json (the files its host holds; ``extra``'s ``step_files``
        names every file of the step, so a resume can tell whether the union of the hosts is complete) and commits
        the step to its agent; one gather says whether every commit took."""
        outcome: str | None = None
        if host not in the_plan.notified and self.ranks.rank == the_plan.leader(host):
            mine = {name: entry for name, entry in files.items() if holders[name] == host}
            try:
                write_tier_file(
                    directory,
                    job=self.job,
                    step=step,
                    run=run,
                    world_size=self.ranks.world_size,
                    files=mine,
                    complete=True,
                    extra=extra,
                )
                self.tier.commit(self.job, step, reservation)
            except (OSError, RamTierError) as exc:
                outcome = f"host {host}: cannot commit step {step}: {exc}"
        self._agree(outcome or {}, "committing the step")

    def _free(self, step: int) -> None:
        # Failing that, the agent removes a step without tier.json when its reservation expires.
        with contextlib.suppress(RamTierError):
            self.tier.free(self.job, step)
