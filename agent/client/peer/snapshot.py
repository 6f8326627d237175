"""Peer snapshots (issue 38): a step kept in the RAM of two hosts, so that a host lost without a notice loses
no more than the steps since the newest snapshot.

On the training thread, every rank reserves room in its host's RAM tier (its own shard and those it will hold
for ranks of other hosts) and DCP stages its shard into CPU memory; that copy is all a snapshot blocks training
for. In the background, on the store's second gloo group, DCP writes the staged shard into the host's RAM tier,
each rank sends its files to its buddy on the host that holds its host's copy (chosen as an evacuation chooses:
another capacity pool first, the host's own pool last, else the next host in the ring), the ranks agree that
every file of the step is in the RAM of two hosts with one CRC32, and each host commits the step with the files
it holds. A resume takes the newest step complete across the hosts' union (:mod:`agent.client.peer.resume`),
so it finds a snapshot whole after the loss of any one host. Each store keeps its newest ``keep`` snapshots and
frees older ones.

Nothing is committed when any part fails (a full tier, a lost peer, a rank that died): the snapshot is
reported ``failed`` and training goes on. A snapshot never races an evacuation: an emergency save first waits
for the one in flight (:meth:`PeerSnapshots.settle`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.state_dict_saver import async_save as dcp_async_save

from agent.client.background import InFlight, OneInFlight
from agent.client.dcp._commit import Ranks
from agent.client.peer._plan import PeerTierUnusable, Plan, phases, placement_json, ring, second_ring
from agent.client.peer._transfer import SummingFileSystem
from agent.client.peer.evacuate import Evacuation, estimate, resolve
from agent.client.peer.ramtier import RamTier
from agent.client.store_failure import summary

_log = logging.getLogger("agent.client.peer")

__all__ = ["PeerSnapshots", "Snapshot", "SnapshotRun", "phases", "ring"]


@dataclass
class SnapshotRun(InFlight):
    """One snapshot (see :class:`InFlight`): ``complete_s``, how long until it was committed on every host
    (or failed: ``error``)."""

    complete_s: float | None = None
    holders: Mapping[str, tuple[str, ...]] | None = None  # each file's hosts, once committed


class Snapshot(Evacuation):
    """One snapshot of the store's group (a collective): :meth:`stage` on the training thread, then what it
    returns on a thread of its own, whose collectives run on ``ranks.async_group``."""

    def __init__(self, ranks: Ranks, tier: RamTier, job: str, thread_count: int = 1) -> None:
        super().__init__(ranks, ranks.group, tier, job, thread_count)
        self.sent_bytes = 0

    def stage(
        self, step: int, state: Mapping[str, Any], avoid: Collection[str] = ()
    ) -> Callable[[int], Mapping[str, tuple[str, ...]]]:
        """Reserve and stage; returns the rest of the snapshot, to run in the background with the run
        number: it returns each file's holders once the step is committed on every host. ``avoid``: capacity
        pools where the job lost hosts lately, holders there a last choice (:func:`ring`)."""
        resolved = resolve(state)
        place = dataclasses.replace(self._place((), estimate(resolved)), avoid=tuple(sorted(avoid)))
        places = self.ranks.gather(place, self.group)
        the_plan = ring(places)
        second = second_ring(places, the_plan)  # a third copy where the holder shares the host's pool
        host = the_plan.host_of(self.ranks.rank)
        also = second.buddy if second is not None else {}
        directory, reservation = self._reserve(the_plan, step, places, host, also)
        sums = SummingFileSystem()
        writer = FileSystemWriter(directory, sync_files=False, thread_count=self.thread_count)
        writer.fs = sums
        try:
            future: Any = dcp_async_save(
                resolved, storage_writer=writer, process_group=self.ranks.async_group
            )
        except BaseException:
            if self.ranks.rank == the_plan.leader(host):
                self._free(step)
            raise

        def rest(run: int) -> Mapping[str, tuple[str, ...]]:
            self.group = self.ranks.async_group  # from here on, the background's collectives
            try:
                future.result()
                copies = (the_plan, second)
                return self._replicate(copies, step, run, host, directory, reservation, sums.sums)
            except Exception:
                if self.ranks.rank == the_plan.leader(host):
                    self._free(step)
                raise

        return rest

    def _replicate(
        self,
        copies: tuple[Plan, Plan | None],
        step: int,
        run: int,
        host: str,
        directory: Path,
        reservation: str,
        sums: Mapping[str, tuple[int, int]],
    ) -> Mapping[str, tuple[str, ...]]:
        the_plan, second = copies
        listed = self._agree(self._own_files(directory, {}), "listing the shard files")
        described = [files for files, _ in listed]
        sends = 1 + int(second is not None and self.ranks.rank in second.buddy)
        self.sent_bytes = sends * sum(
            described[self.ranks.rank].values()
        )  # this rank's shard, to its buddies
        received = self._exchange(the_plan, directory, described, sums)
        if second is not None:  # the second copies, after the first are all in
            received = _merged(received, self._exchange(second, directory, described, sums))
        # What this rank holds, as a survivor of an evacuation would: its own files and those it received.
        kept = self._held(replace(the_plan, buddy={}), directory, described, received, sums)
        held = self._agree(kept, "confirming the copies")
        files, holders = self._twice(the_plan, held, described)
        mine = {name: entry for name, entry in files.items() if host in holders[name]}
        extra = {
            "step_files": {n: int(e["size"]) for n, e in files.items()},
            "snapshot": True,
            "placement": placement_json(the_plan, second),  # where each host's copies went, and why (status)
        }
        self._commit(
            the_plan, step, run, host, directory, reservation, mine, dict.fromkeys(mine, host), extra
        )
        return holders

    def _exchange(
        self,
        the_plan: Plan,
        directory: Path,
        described: list[dict[str, int]],
        sums: Mapping[str, tuple[int, int]],
    ) -> dict[str, int] | str:
        """Each rank sends its files to its buddy (if it has one in ``the_plan``) and receives those of the ranks
        it is the buddy of, host by host in :func:`phases`; the files received (name → CRC32), or a problem."""
        rank = self.ranks.rank
        order = [host for host, _ in the_plan.hosts]
        placed = [the_plan.placement.get(host) for host in order]
        phase = phases([None if p is None else order.index(p.holder) for p in placed])
        mine = phase[order.index(the_plan.host_of(rank))] if rank in the_plan.buddy else -1
        senders = the_plan.senders_to(rank)
        sender_phase = {s: phase[order.index(the_plan.host_of(s))] for s in senders}
        received: dict[str, int] = {}
        problems: list[str] = []
        for current in range(max(phase) + 1):
            if current == mine:
                self._send_files(the_plan.buddy[rank], directory, described[rank], sums)
            for sender in (s for s in senders if sender_phase[s] == current):
                self._receive_files(sender, directory, described[sender], (), received, problems)
        return "; ".join(problems) if problems else received

    def _twice(
        self, the_plan: Plan, held: list[dict[str, dict[str, int]]], described: list[dict[str, int]]
    ) -> tuple[dict[str, dict[str, int]], dict[str, tuple[str, ...]]]:
        """Every file of the step held by two hosts, with its size and one CRC32: the files and their hosts."""
        files: dict[str, dict[str, int]] = {}
        hosts: dict[str, set[str]] = {}
        crcs: dict[str, set[int]] = {}
        for rank, entries in enumerate(held):
            for name, entry in entries.items():
                files[name] = dict(entry)
                hosts.setdefault(name, set()).add(the_plan.host_of(rank))
                crcs.setdefault(name, set()).add(int(entry["crc32"]))
        sizes = {name: size for own in described for name, size in own.items()}
        short = sorted(
            n
            for n, size in sizes.items()
            if len(hosts.get(n, ())) < 2 or files[n]["size"] != size or len(crcs[n]) != 1
        )
        if short:
            raise PeerTierUnusable(f"not in the RAM of two hosts with one CRC32: {', '.join(short)}")
        return files, {name: tuple(sorted(found)) for name, found in hosts.items()}


def _merged(first: dict[str, int] | str, second: dict[str, int] | str) -> dict[str, int] | str:
    """The files received in two exchanges, or their problems."""
    problems = [found for found in (first, second) if isinstance(found, str)]
    if problems:
        return "; ".join(problems)
    assert isinstance(first, dict) and isinstance(second, dict)
    return {**first, **second}


class PeerSnapshots(OneInFlight[SnapshotRun]):
    """A store's snapshots: at most one in flight, ``keep`` newest committed ones kept in the RAM tiers."""

    what = "the snapshot"

    def __init__(
        self,
        ranks: Ranks,
        tier: RamTier,
        job: str,
        report: Callable[..., None],
        thread_count: int = 1,
        keep: int = 2,
    ) -> None:
        if keep < 1:
            raise ValueError(f"keep must be at least 1, got {keep!r}")
        self.ranks = ranks
        self.tier = tier
        self.job = job
        self.thread_count = thread_count
        self.keep = keep
        self._report = report
        super().__init__()
        self.committed: list[int] = []  # the snapshot steps this store committed and keeps, oldest first

    def start(
        self, step: int, run: int, state: Mapping[str, Any], avoid: Collection[str] = ()
    ) -> SnapshotRun | None:
        """Snapshot ``state`` as ``step`` (after waiting for the one in flight), holders in the pools in ``avoid``
        a last choice; the run in flight, or None when it could not start (a warning and a ``failed`` report
        say why; training goes on)."""
        self.settle()
        handle = SnapshotRun(step=step, started=time.monotonic())
        flush: dict[str, Any] = {"sharded": True, "world_size": self.ranks.world_size, "tier": "snapshot"}
        self._report("started", step, flush=flush)
        snapshot = Snapshot(self.ranks, self.tier, self.job, self.thread_count)
        try:
            rest = snapshot.stage(step, state, avoid)
        except Exception as exc:
            self._failed(handle, exc, flush)
            return None
        handle.blocked_s = time.monotonic() - handle.started
        self._launch(
            self.ranks, handle, self._complete, (rest, run, flush, snapshot), f"preemptd-snapshot {step}"
        )
        return handle

    def _complete(
        self,
        handle: SnapshotRun,
        rest: Callable[[int], Mapping[str, tuple[str, ...]]],
        run: int,
        flush: dict[str, Any],
        snapshot: Snapshot,
    ) -> None:
        try:
            handle.holders = rest(run)
        except BaseException as exc:  # kept for settle(), which says it
            handle.error = exc
            self._report("failed", handle.step, flush=flush)
            return
        handle.complete_s = time.monotonic() - handle.started
        self._report(
            "finished",
            handle.step,
            duration_s=handle.blocked_s,
            size=snapshot.sent_bytes,
            flush={**flush, "complete_s": round(handle.complete_s, 3)},
        )
        self._evict(handle.step)

    def _evict(self, step: int) -> None:
        """Keep the newest ``keep`` snapshots: every rank asks its own host's agent to free the older ones (the
        first rank of a host frees the step; the others find it gone, which is no error here)."""
        self.committed.append(step)
        old, self.committed = self.committed[: -self.keep], self.committed[-self.keep :]
        for gone in old:
            with contextlib.suppress(Exception):  # the agent removes what it cannot (its cap, a restart)
                self.tier.free(self.job, gone)

    def settle(self, timeout: float | None = None) -> SnapshotRun | None:
        """Wait for the snapshot in flight (an emergency save does, before it evacuates); it, or None. A
        failure is a warning here, not an error: the snapshot was never committed."""
        handle = self._join(timeout)
        if handle is not None and handle.error is not None:
            _log.warning("the snapshot of step %s was not committed: %s", handle.step, summary(handle.error))
        return handle

    def _failed(self, handle: SnapshotRun, exc: Exception, flush: dict[str, Any]) -> None:
        handle.error = exc
        self._report("failed", handle.step, flush=flush)
        _log.warning("the snapshot of step %s was not taken: %s", handle.step, summary(exc))
