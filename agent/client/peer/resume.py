"""Resume from the RAM tiers (issue 24 item 4): the inventories of every rank's host, gathered over the store's
process group; the newest step complete across their union (newer than the newest durable step); each host
receives, through the group, the files its ranks need that it does not hold (CRC-checked), then DCP loads from
each host's own step directory, resharding to this world size; what a host held is CRC-checked against
tier.json too. A step that is incomplete (which file is missing, which host holds what), cannot be gathered,
is damaged or does not load is skipped on every rank with a :class:`CheckpointWarning`, and the next older RAM
step is tried, then the store's root.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from agent.checkpoint.manifest import (
    Checkpoint,
    CheckpointError,
    FileEntry,
    Verify,
    default_hash_workers,
    file_crc,
    hash_pool,
)
from agent.client.dcp._commit import DCP_METADATA, Ranks, ShardedCheckpoint, load_failure
from agent.client.peer._transfer import receive_file, send_file
from agent.client.peer.evacuate import host_key, resolve
from agent.client.peer.ramtier import RamTier, RamTierError, read_tier_file
from agent.client.store import Skipped


@dataclass(frozen=True)
class Holding:
    """What one rank's host holds of the job: its committed steps (step → its tier.json)."""

    rank: int
    host: str
    steps: Mapping[int, Mapping[str, Any]]
    problem: str | None = None


@dataclass(frozen=True)
class Choice:
    """The step to resume from: its files (name → size, CRC32), the hosts holding each, and its tier.json."""

    step: int
    run: int
    files: Mapping[str, tuple[int, int]]
    holders: Mapping[str, tuple[str, ...]]
    doc: Mapping[str, Any]


def candidates(
    holdings: Sequence[Holding], durable: tuple[int, int] | None
) -> list[Choice | tuple[int, str]]:
    """Every step (by run, then step, newest first) newer than ``durable`` (the newest durable step's (run,
    step)) that some host holds: a Choice when it is complete across the hosts' union, else (step, what is
    missing). Pure."""
    by_step: dict[int, list[tuple[str, Mapping[str, Any]]]] = {}
    seen: set[tuple[str, int]] = set()
    for holding in holdings:
        for step, doc in holding.steps.items():
            if (holding.host, step) not in seen:  # one host's ranks all see the same directory
                seen.add((holding.host, step))
                by_step.setdefault(step, []).append((holding.host, doc))
    found: list[Choice | tuple[int, str]] = []
    ordered = sorted(by_step.items(), key=lambda item: (_run(item[1]), item[0]), reverse=True)
    for step, parts in ordered:
        run = _run(parts)
        if durable is not None and (run, step) <= durable:
            break
        wanted: dict[str, int] = {}
        for _host, doc in parts:
            wanted.update({str(k): int(v) for k, v in dict(doc.get("step_files") or {}).items()})
        files: dict[str, tuple[int, int]] = {}
        holders: dict[str, list[str]] = {}
        for host, doc in parts:
            for name, entry in dict(doc.get("files") or {}).items():
                if wanted.get(name) == int(entry["size"]):
                    files[name] = (int(entry["size"]), int(entry["crc32"]))
                    holders.setdefault(name, []).append(host)
        missing = sorted(set(wanted) - set(files)) if wanted else ["(no list of the step's files)"]
        if not missing:
            found.append(Choice(step, run, files, {k: tuple(v) for k, v in holders.items()}, parts[0][1]))
            continue
        held = "; ".join(
            f"{host} holds {', '.join(sorted(dict(doc.get('files') or {})))}" for host, doc in parts
        )
        found.append((step, f"{', '.join(missing)} on no host ({held})"))
    return found


def choose(holdings: Sequence[Holding], durable: tuple[int, int] | None) -> tuple[Choice | None, list[str]]:
    """The newest step (by run, then step) complete across the hosts' union and newer than ``durable`` (the
    newest durable step's (run, step)); and a sentence for each newer step that is not complete. Pure."""
    notes: list[str] = []
    for found in candidates(holdings, durable):
        if isinstance(found, Choice):
            return found, notes
        notes.append(f"RAM step {found[0]} is incomplete: {found[1]}")
    return None, notes


def _run(parts: Sequence[tuple[str, Mapping[str, Any]]]) -> int:
    run = parts[0][1].get("run")
    return run if isinstance(run, int) and not isinstance(run, bool) else 0


class PeerResume:
    """Loads the newest complete RAM step into a state (a collective of the store's group)."""

    def __init__(self, ranks: Ranks, group: Any, tier: RamTier, job: str) -> None:
        self.ranks = ranks
        self.group = group
        self.tier = tier
        self.job = job

    def load(
        self,
        state: Mapping[str, Any],
        durable: tuple[int, int] | None,
        verify: Verify = "checksum",
        skipped: Skipped | None = None,
    ) -> ShardedCheckpoint | None:
        """Load into ``state`` the newest RAM step newer than ``durable`` that is complete across the hosts,
        can be gathered, verifies and loads, trying the older ones in turn; None when there is none. Each step
        passed over goes into ``skipped`` (rank 0 warns: a CheckpointWarning naming the step and why), and
        every rank passes over the same ones. A ``mismatch`` is raised."""
        skipped = skipped if skipped is not None else Skipped("the RAM tiers")
        speaks = self.ranks.rank == 0
        holdings = self.ranks.gather(self._holding(), self.group)
        hosts = _hosts(holdings)
        mine = holdings[self.ranks.rank]
        if durable is not None and hosts[mine.host][0] == self.ranks.rank:
            self._free_stale(mine, durable)
        unusable = "; ".join(f"rank {h.rank}: {h.problem}" for h in holdings if h.problem)
        for found in candidates([h for h in holdings if h.problem is None], durable):
            if not isinstance(found, Choice):
                skipped.add(f"RAM step {found[0]}", f"it is incomplete: {found[1]}", loud=speaks)
                continue
            if unusable:  # a host's tier cannot be asked: no RAM step can be gathered
                skipped.add(f"RAM step {found.step}", f"it cannot be gathered: {unusable}", loud=speaks)
                return None
            try:
                return self._load_step(found, state, holdings, hosts, verify)
            except CheckpointError as exc:
                if exc.reason == "mismatch":
                    raise
                skipped.add(f"RAM step {found.step}", exc, loud=speaks)
        return None

    def _load_step(
        self,
        choice: Choice,
        state: Mapping[str, Any],
        holdings: Sequence[Holding],
        hosts: Mapping[str, tuple[int, ...]],
        verify: Verify,
    ) -> ShardedCheckpoint:
        """Gather ``choice`` onto every host (each receives the files its ranks read that it lacks,
        CRC-checked as they arrive; what it held is checked against tier.json's CRC32s), then DCP loads it;
        CheckpointError on every rank alike when any of it fails."""
        directory = self._directories(choice, hosts)
        metadata_moves = _moves(choice, hosts, {h: {DCP_METADATA} for h in hosts})
        self._move(metadata_moves, choice, directory)
        self._verify_held(choice, directory, hosts, {h: {DCP_METADATA} for h in hosts}, verify)
        needed = self.ranks.gather(self._needed(state, directory, choice), self.group)
        wanted: dict[str, set[str]] = {}
        for rank, names in enumerate(needed):
            wanted.setdefault(holdings[rank].host, set()).update(names)
        self._move(_moves(choice, hosts, wanted, metadata_moves), choice, directory)
        shards = {h: n - {DCP_METADATA} for h, n in wanted.items()}
        self._verify_held(choice, directory, hosts, shards, "size" if verify == "checksum" else verify)
        error: CheckpointError | None = None
        with hash_pool(default_hash_workers()) as pool:
            # The CRC32s of the shards a host held, on the pool while DCP reads the same pages (the resume
            # takes no longer for them where there is a core to spare); a mismatch skips the step after all.
            damaged = (
                self._held_crcs(pool, choice, directory, hosts, shards) if verify == "checksum" else None
            )
            try:
                dcp_load(dict(state), storage_reader=FileSystemReader(directory), process_group=self.group)
            except (CheckpointException, OSError) as exc:
                error = load_failure(directory, exc)
            problem = damaged() if damaged is not None else None
        if problem is not None:
            error = CheckpointError(f"damaged in a RAM tier: {problem}")
        self.ranks.agree(error, self.group)
        return _checkpoint(choice, directory)

    def _held_crcs(
        self,
        pool: Executor,
        choice: Choice,
        directory: Path,
        hosts: Mapping[str, tuple[int, ...]],
        names: Mapping[str, set[str]],
    ) -> Callable[[], str | None]:
        """Start the CRC32s of this rank's share of the files of ``names`` its host held (see
        :meth:`_verify_held`) on ``pool``; the returned function waits for them and says what does not match
        tier.json's (None: all match)."""
        host, _, share = self._held(choice, hosts, names)
        started = [(name, file_crc(pool, directory / name, choice.files[name][0])) for name in share]

        def damaged() -> str | None:
            for name, crc in started:
                try:
                    found = crc()
                except (OSError, CheckpointError) as exc:
                    return f"{host}: {directory / name}: unreadable ({exc})"
                if found != choice.files[name][1]:
                    return f"{host}: {directory / name}: checksum mismatch (corrupt)"
            return None

        return damaged

    def _held(
        self, choice: Choice, hosts: Mapping[str, tuple[int, ...]], names: Mapping[str, set[str]]
    ) -> tuple[str, list[str], list[str]]:
        """This rank's host, the files of ``names`` it held already (those it received were checked as they
        came) and this rank's share of them (by index among the host's ranks)."""
        host = _host_of(hosts, self.ranks.rank)
        here = hosts[host]
        held = sorted(n for n in names.get(host, ()) if host in choice.holders.get(n, ()))
        return host, held, held[here.index(self.ranks.rank) :: len(here)]

    def _verify_held(
        self,
        choice: Choice,
        directory: Path,
        hosts: Mapping[str, tuple[int, ...]],
        names: Mapping[str, set[str]],
        verify: Verify,
    ) -> None:
        """The files of ``names`` that each host held already (those it received were checked as they
        came): sizes, and (``checksum``) CRC32s against tier.json's, shared out between the host's ranks; one
        gather. CheckpointError on every rank when one is damaged. (``.metadata`` is checked so before DCP
        unpickles it; the shards' CRCs run beside DCP's read: :meth:`_held_crcs`.)"""
        host, held, share = self._held(choice, hosts, names)
        problem: str | None = None
        if held and verify != "none":
            checkpoint = _checkpoint(choice, directory).checkpoint
            try:
                replace(checkpoint, files=tuple(FileEntry(n, *choice.files[n]) for n in held)).verify("size")
                if verify == "checksum":
                    replace(checkpoint, files=tuple(FileEntry(n, *choice.files[n]) for n in share)).verify()
            except CheckpointError as exc:
                problem = f"{host}: {exc}"
        problems = [p for p in self.ranks.gather(problem, self.group) if p]
        if problems:
            raise CheckpointError(f"damaged in a RAM tier: {'; '.join(problems)}")

    def _holding(self) -> Holding:
        rank = self.ranks.rank
        try:
            info = self.tier.info()
            listed = self.tier.job(self.job)
        except RamTierError as exc:
            return Holding(rank, f"{socket.gethostname()}:?", {}, str(exc))
        steps: dict[int, Mapping[str, Any]] = {}
        for entry in listed.get("steps", []):
            doc = read_tier_file(Path(str(listed["path"])) / str(entry["step"]))
            if entry.get("complete") and doc is not None:
                steps[int(entry["step"])] = doc
        return Holding(rank, host_key(info), steps)

    def _free_stale(self, mine: Holding, durable: tuple[int, int]) -> None:
        """The host's leader frees the job's RAM steps that are not newer than the newest durable step:
        a resume never chooses them."""
        for step, doc in mine.steps.items():
            if (_run([(mine.host, doc)]), step) <= durable:
                with contextlib.suppress(RamTierError):  # freed by another process meanwhile
                    self.tier.free(self.job, step)

    def _directories(self, choice: Choice, hosts: Mapping[str, tuple[int, ...]]) -> Path:
        """Each host's leader reserves the step's directory on its host (where it is already, or where the
        files it lacks will go); every rank learns its own. CheckpointError on every rank when one cannot."""
        answer: str | None = None
        host = _host_of(hosts, self.ranks.rank)
        if hosts[host][0] == self.ranks.rank:
            lacking = sum(
                size for name, (size, _) in choice.files.items() if host not in choice.holders[name]
            )
            try:
                answer = str(self.tier.reserve(self.job, choice.step, lacking).path)
            except RamTierError as exc:
                answer = f"!{host}: {exc}"
        answers = self.ranks.gather(answer, self.group)
        refused = [a[1:] for a in answers if isinstance(a, str) and a.startswith("!")]
        if refused:
            raise CheckpointError(f"it cannot be gathered: {'; '.join(refused)}")
        return Path(str(answers[hosts[host][0]]))

    def _needed(self, state: Mapping[str, Any], directory: Path, choice: Choice) -> list[str]:
        """The files this rank's DCP load reads (from the plan DCP makes of ``state``); every file when the
        plan cannot be made here (DCP then says why)."""
        try:
            metadata = FileSystemReader(directory).read_metadata()
            planner = DefaultLoadPlanner()
            planner.set_up_planner(resolve(state), metadata, self.ranks.rank == 0)
            items = planner.create_local_plan().items
            names = {metadata.storage_data[item.storage_index].relative_path for item in items}
        except Exception:  # a mismatch or a bad file: the load itself raises it with DCP's words
            names = set(choice.files)
        return sorted(names | {DCP_METADATA})

    def _move(self, moves: Sequence[tuple[int, int, str]], choice: Choice, directory: Path) -> None:
        """Run every (sender, receiver, file) in the same order on every rank (so no two wait on each other);
        CheckpointError on every rank when a file did not arrive whole."""
        problems: list[str] = []
        for sender, receiver, name in moves:
            size = choice.files[name][0]
            if sender == self.ranks.rank:
                send_file(self.group, receiver, directory / name, size)
            elif receiver == self.ranks.rank:
                crc, problem = receive_file(self.group, sender, directory / name, size)
                if problem is None and crc != choice.files[name][1]:
                    problem = f"{name} does not match its CRC32 in tier.json"
                if problem is not None:
                    problems.append(f"rank {self.ranks.rank}: {problem}")
        everyone = self.ranks.gather(problems, self.group)
        found = [p for mine in everyone for p in mine]
        if found:
            raise CheckpointError(f"it could not be gathered: {'; '.join(found)}")


def _hosts(holdings: Sequence[Holding]) -> dict[str, tuple[int, ...]]:
    grouped: dict[str, list[int]] = {}
    for holding in sorted(holdings, key=lambda h: h.rank):
        grouped.setdefault(holding.host, []).append(holding.rank)
    return {host: tuple(ranks) for host, ranks in grouped.items()}


def _host_of(hosts: Mapping[str, tuple[int, ...]], rank: int) -> str:
    return next(host for host, ranks in hosts.items() if rank in ranks)


def _moves(
    choice: Choice,
    hosts: Mapping[str, tuple[int, ...]],
    wanted: Mapping[str, set[str]],
    done: Sequence[tuple[int, int, str]] = (),
) -> list[tuple[int, int, str]]:
    """(sender, receiver, file) for each file a host wants and does not hold: from the leader of its first
    holder to the host's leader, in one order every rank computes alike. Pure."""
    moved = {(receiver, name) for _, receiver, name in done}
    moves = []
    for host, ranks in hosts.items():
        for name in sorted(wanted.get(host, ())):
            holders = choice.holders.get(name, ())
            if not holders or host in holders or (ranks[0], name) in moved:
                continue
            moves.append((hosts[holders[0]][0], ranks[0], name))
    return moves


def _checkpoint(choice: Choice, directory: Path) -> ShardedCheckpoint:
    entries = tuple(FileEntry(name, size, crc) for name, (size, crc) in sorted(choice.files.items()))
    world_size = int(choice.doc.get("world_size", 0) or 0)
    notice = choice.doc.get("notice_id")
    moment = datetime.now(timezone.utc)
    with contextlib.suppress(TypeError, ValueError):
        moment = datetime.fromisoformat(str(choice.doc.get("time")).replace("Z", "+00:00"))
    checkpoint = Checkpoint(
        step=choice.step,
        path=directory,
        time=moment,
        bytes=sum(e.bytes for e in entries),
        files=entries,
        emergency=True,
        notice_id=notice if isinstance(notice, str) else None,
        metadata={"tier": "peer", "world_size": world_size},
        run=choice.run,
    )
    return ShardedCheckpoint(checkpoint, world_size)
