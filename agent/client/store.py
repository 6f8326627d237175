"""The checkpoint store: atomic, durable, format-agnostic checkpoint directories with a manifest.

``save(step, writer)`` gives ``writer`` a fresh temporary directory to fill with any files, then fsyncs them
(checksumming in parallel with the fsync), writes ``manifest.json``, renames the directory to ``step-N`` and
fsyncs the parent: a checkpoint either exists whole or not at all. ``latest()`` finds the newest checkpoint that
verifies, skipping incomplete, corrupt or malformed ones with a :class:`CheckpointWarning`. "Newest" is by run,
then step: a save of a step lower than the newest one starts a new run that outranks the older one (see
:meth:`CheckpointStore.save`). Every failure to save or read is a :class:`CheckpointError` naming its cause.
Each save is reported to the agent (started, finished or failed) so the advisor learns what a checkpoint costs.

The manifest and its verification live in :mod:`agent.checkpoint.manifest`, the fsyncs, the sealing and
:class:`DurableFile` in :mod:`agent.checkpoint.durable`, the reading of a failure's cause in
:mod:`agent.client.store_failure`.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import time
import uuid
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

from agent.checkpoint.durable import (
    CHECKSUM_NOW,
    ChecksumThreads,
    DurableFile,
    add_checksums,
    fsync_dir,
    fsync_file,
    presealed,
    seal,
)
from agent.checkpoint.manifest import (
    FORMAT,
    FORMAT_VERSION,
    HASH_PIECE,
    MANIFEST,
    Checkpoint,
    CheckpointError,
    CheckpointWarning,
    FileEntry,
    Verify,
    crc32_combine,
    default_hash_workers,
    reason_of,
    run_of,
)
from agent.client.preempted import record_emergency
from agent.client.reporting import Reporter
from agent.client.store_failure import convertible, fall_back, free_bytes, save_failure

# What other modules (and users) import from here: the on-disk format comes from agent.checkpoint.manifest, the
# durable files from agent.checkpoint.durable.
__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "HASH_PIECE",
    "MANIFEST",
    "Checkpoint",
    "CheckpointError",
    "CheckpointStore",
    "CheckpointWarning",
    "ChecksumThreads",
    "DurableFile",
    "FileEntry",
    "Skipped",
    "Verify",
    "Writer",
    "crc32_combine",
    "fsync_dir",
    "fsync_file",
    "loaded_only",
    "seal",
    "valid_only",
]

_STEP_DIR = re.compile(r"^step-(\d+)$")
_TMP_PREFIX = ".tmp-"
_TRASH_PREFIX = ".trash-"

Writer = Callable[[Path], Any]
_Loaded = TypeVar("_Loaded")


class CheckpointStore:
    """Checkpoints under ``root`` as ``step-<N>`` directories; keeps the newest ``keep`` (0 keeps all).

    ``checksum=False`` skips CRCs (sizes are still recorded and checked). With ``defer_emergency_checksum``
    an emergency save returns as soon as its data is durable and the CRCs are added to its manifest on a
    background thread (an atomic manifest rewrite; :meth:`wait_checksums` or :meth:`close` waits for them):
    inside a notice window durability comes first. ``reporter`` sends save reports to the agent; pass
    ``report=False`` for none.
    """

    def __init__(
        self,
        root: str | Path,
        keep: int = 3,
        *,
        checksum: bool = True,
        reporter: Reporter | None = None,
        report: bool = True,
        socket_path: str | Path | None = None,
        hash_workers: int | None = None,
        defer_emergency_checksum: bool = True,
    ) -> None:
        if keep < 0:
            raise ValueError(f"keep must be 0 (keep all) or more, got {keep}")
        self.root = Path(root)
        self.keep = keep
        self.checksum = checksum
        self.reporter = reporter if reporter is not None or not report else Reporter(socket_path)
        self.hash_workers = hash_workers or default_hash_workers()
        self.defer_emergency_checksum = defer_emergency_checksum
        self.last_save: Checkpoint | None = None
        self._checksummers = ChecksumThreads()
        self._runs: dict[str, tuple[tuple[int, int, int], int | None]] = {}
        self._new_run = False

    # -- saving -----------------------------------------------------------------------------------------

    def save(
        self,
        step: int,
        writer: Writer,
        *,
        emergency: bool = False,
        notice_id: str | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> Checkpoint:
        """Write a checkpoint for ``step`` atomically; ``writer(directory)`` puts the files in it.

        Returns when the checkpoint is durable (files, manifest and the rename are fsynced). An existing
        checkpoint of the same step is replaced. A step lower than the newest committed one starts a new run
        in the root (with a :class:`CheckpointWarning`): its steps outrank the earlier run's, so a resume
        loads them and pruning removes the earlier run's first.

        On failure the temporary directory is removed, a ``failed`` report is sent and
        :class:`CheckpointError` is raised naming the cause (no space: how much was free and what the save
        used; permission; I/O error), the original exception chained. A failed emergency save falls back to
        the newest earlier committed checkpoint when there is one: it is recorded for ``preemptd exec`` (which
        then exits 75), reported with the failure, and set as the error's ``fallback``.
        """
        if step < 0:
            raise ValueError(f"step must be non-negative, got {step}")
        started = time.monotonic()
        self._report("started", step, emergency=emergency, notice_id=notice_id)
        tmp = self.root / f"{_TMP_PREFIX}{_owner_tag()}-{uuid.uuid4().hex[:8]}"
        defer = emergency and self.checksum and self.defer_emergency_checksum
        checksum_now = self.checksum and not defer
        run = self._open_run(step, emergency, notice_id)
        free_before = free_bytes(self.root)
        try:
            tmp.mkdir()
            token = CHECKSUM_NOW.set(checksum_now)
            try:
                written = writer(tmp)
            finally:
                CHECKSUM_NOW.reset(token)
            sealed = seal(
                tmp,
                step,
                checksum=checksum_now,
                hash_workers=self.hash_workers,
                emergency=emergency,
                notice_id=notice_id,
                metadata=metadata,
                started=started,
                presealed=presealed(written),
                run=run,
                deferred=defer,
            )
            final = self._commit(tmp, step)
        except BaseException as exc:
            error = self._failed(exc, step, tmp, free_before, emergency, notice_id)
            if error is exc:
                raise
            raise error from exc
        checkpoint = replace(sealed, path=final, duration_s=time.monotonic() - started)
        self._finished(checkpoint, emergency=emergency, notice_id=notice_id, defer=defer)
        return checkpoint

    def _open_run(self, step: int, emergency: bool, notice_id: str | None) -> int:
        """The root made and the run ``step`` belongs to; a failure is reported and raised as the save's."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            return self.run_for(step)
        except OSError as exc:
            self._report("failed", step, emergency=emergency, notice_id=notice_id)
            raise save_failure(exc, step, self.root, None, None, self.newest) from exc
        except CheckpointError:  # the root cannot be listed: it says so already
            self._report("failed", step, emergency=emergency, notice_id=notice_id)
            raise

    def _commit(self, tmp: Path, step: int) -> Path:
        """The sealed ``tmp`` renamed to ``step``'s directory, durably; that directory."""
        final = self.path_of(step)
        # A deferred checksum of this step still running would write the old manifest into the new one.
        self._checksummers.join_named(f"preemptd-checksum {final.name}")
        self._replace(tmp, final)
        fsync_dir(self.root)
        return final

    def _failed(
        self,
        exc: BaseException,
        step: int,
        tmp: Path,
        free_before: int | None,
        emergency: bool,
        notice_id: str | None,
    ) -> BaseException:
        """What a save that raised ``exc`` raises, its temporary directory removed and its failure reported:
        an interrupt or exit as it is, else the :class:`CheckpointError` naming the cause (with an emergency
        save's fallback)."""
        if not convertible(exc):  # an interrupt or exit: not a storage failure, passed on as it is
            shutil.rmtree(tmp, ignore_errors=True)
            self._report("failed", step, emergency=emergency, notice_id=notice_id)
            return exc
        error = save_failure(exc, step, self.root, tmp, free_before, self.newest)
        shutil.rmtree(tmp, ignore_errors=True)
        flush = None
        if emergency:
            error.fallback = fall_back(self.committed, step, notice_id, error, sharded=False)
            flush = {"fallback_step": error.fallback.step} if error.fallback is not None else None
        self._report("failed", step, emergency=emergency, notice_id=notice_id, flush=flush)
        return error

    def _finished(
        self, checkpoint: Checkpoint, *, emergency: bool, notice_id: str | None, defer: bool
    ) -> None:
        """A durable save recorded and reported; its deferred checksums started, or older checkpoints pruned."""
        final = checkpoint.path
        self.last_save = checkpoint
        self._new_run = False
        if emergency:  # durable now: `preemptd exec` may turn the launcher's failure into 75
            record_emergency(checkpoint.step, path=final, notice_id=notice_id)
        self._report(
            "finished",
            checkpoint.step,
            duration_s=checkpoint.duration_s,
            size=checkpoint.bytes,
            emergency=emergency,
            notice_id=notice_id,
            path=final,
        )
        if defer:
            self._checksummers.start(
                f"preemptd-checksum {final.name}", add_checksums, final, self.hash_workers
            )
        if not emergency:  # never spend a notice window deleting old checkpoints: the next save prunes
            self.prune(protect=final)

    def wait_checksums(self, timeout: float | None = None) -> bool:
        """Wait for deferred checksums (bounded by ``timeout`` in all); False if some are still running."""
        return self._checksummers.wait(timeout)

    def close(self, timeout: float = 10.0) -> None:
        """Before exit: finish deferred checksums and deliver queued reports, each bounded by ``timeout``."""
        self.wait_checksums(timeout)
        if self.reporter is not None:
            self.reporter.close(timeout)

    def _replace(self, tmp: Path, final: Path) -> None:
        if final.exists():
            trash = self.root / f"{_TRASH_PREFIX}{final.name}-{uuid.uuid4().hex[:8]}"
            os.rename(final, trash)
            os.rename(tmp, final)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.rename(tmp, final)

    def _report(self, phase: str, step: int, **fields: Any) -> None:
        if self.reporter is not None:
            self.reporter.checkpoint(phase, step, **fields)

    # -- listing, resuming, pruning ---------------------------------------------------------------------

    def steps(self) -> list[int]:
        """Steps of the committed checkpoint directories, newest first: the latest run first, then by step
        (not verified; a step whose manifest cannot be read is placed in the latest run, so that a resume
        warns about it)."""
        return [step for _run, step in self._ordered()]

    def _ordered(self) -> list[tuple[int, int]]:
        """(run, step) of every step directory, newest first."""
        found = self._scan()
        latest = max((run for run, _step in found if run is not None), default=0)
        return sorted(((latest if run is None else run, step) for run, step in found), reverse=True)

    def _scan(self) -> list[tuple[int | None, int]]:
        """(run, step) of every step directory; the run is None where the manifest cannot be read."""
        try:
            entries = list(self.root.iterdir())
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise CheckpointError(
                f"{self.root}: cannot list the checkpoint root ({exc.strerror})", reason=reason_of(exc)
            ) from exc
        found = []
        for entry in entries:
            match = _STEP_DIR.match(entry.name)
            if match and entry.is_dir():
                found.append((self._run_of(entry), int(match.group(1))))
        return found

    def _run_of(self, directory: Path) -> int | None:
        """run_of, remembered while the manifest stays the same file (a root that keeps every step would
        otherwise have every manifest read again at each save)."""
        try:
            stat = (directory / MANIFEST).stat()
        except OSError:
            return None
        key = (stat.st_ino, stat.st_mtime_ns, stat.st_size)
        known = self._runs.get(directory.name)
        if known is not None and known[0] == key:
            return known[1]
        run = run_of(directory)
        self._runs[directory.name] = (key, run)
        return run

    def start_run(self) -> None:
        """Make the next save start a new run in this root, whatever its step and without a warning: for a
        job that trains from scratch (it does not resume) where an earlier run left its steps. That run's
        steps are then older than every step of the new one."""
        self._new_run = True

    def run_for(self, step: int) -> int:
        """The run a save of ``step`` belongs to: the newest committed step's, or the next one (with a
        CheckpointWarning) when ``step`` is lower than that step, since a new run is then starting here."""
        newest = max(((run, at) for run, at in self._scan() if run is not None), default=None)
        if self._new_run:  # until a save of the new run is committed
            return 0 if newest is None else newest[0] + 1
        if newest is None or step >= newest[1]:
            return 0 if newest is None else newest[0]
        run, at = newest
        warnings.warn(
            f"saving step {step} into {self.root}, whose newest checkpoint is step {at}: this starts run "
            f"{run + 1} there, whose steps a resume prefers to the earlier run's (those are pruned first). "
            "If that root belongs to another job, stop and give this one its own checkpoint root; if this job "
            "starts afresh there on purpose, call start_run() before its first save.",
            CheckpointWarning,
            stacklevel=3,
        )
        return run + 1

    def path_of(self, step: int) -> Path:
        return self.root / f"step-{step:012d}"

    def committed(self) -> list[Path]:
        """The committed step directories, newest first (not verified)."""
        return [self.path_of(step) for step in self.steps()]

    def get(self, step: int, verify: Verify = "checksum") -> Checkpoint:
        """The checkpoint of ``step``, verified; CheckpointError when it is missing, incomplete or corrupt: a
        file missing, of another size or failing its CRC32, a file without the CRC32 its manifest promised
        (an emergency save whose deferred CRCs were never written), a file the manifest does not list."""
        # This process's own deferred checksums of the step, still running: the step verifies once they end.
        self._checksummers.join_named(f"preemptd-checksum {self.path_of(step).name}")
        checkpoint = Checkpoint.load(self.path_of(step))
        if checkpoint.step != step:
            raise CheckpointError(f"{checkpoint.path}: the manifest says step {checkpoint.step}")
        if verify != "none":
            checkpoint.check_listed()
        checkpoint.verify(verify, self.hash_workers)
        return checkpoint

    def checkpoints(self, verify: Verify = "checksum") -> Iterator[Checkpoint]:
        """Valid checkpoints, newest first; invalid ones are skipped with a CheckpointWarning."""
        return valid_only(self.steps(), lambda step: self.get(step, verify), _step)

    def latest(self, verify: Verify = "checksum") -> Checkpoint | None:
        """The newest checkpoint that verifies, or None; each one skipped raises a CheckpointWarning naming
        the step and why, and when none verifies one more lists them all."""
        skipped = Skipped(self.root)
        for step in self.steps():
            try:
                return self.get(step, verify)
            except CheckpointError as exc:
                skipped.add(_step(step), exc)
        skipped.none_left()
        return None

    def load_latest(
        self, load: Callable[[Checkpoint], _Loaded], verify: Verify = "checksum"
    ) -> tuple[Checkpoint, _Loaded] | None:
        """The newest checkpoint that verifies *and* loads, with what ``load(checkpoint)`` returned (e.g.
        :func:`agent.client.torch.load_torch`); None when there is none. A step that fails verification
        (:meth:`get`) or whose ``load`` raises CheckpointError (torch cannot read it) is skipped with a
        CheckpointWarning naming the step and why, and the next older one is tried; when none is left, one
        more warning lists what was skipped. A ``mismatch`` (the state does not fit) is raised: every older
        step would not fit either."""
        return self._load_latest(load, verify, Skipped(self.root))

    def _load_latest(
        self, load: Callable[[Checkpoint], _Loaded], verify: Verify, skipped: Skipped
    ) -> tuple[Checkpoint, _Loaded] | None:
        for step in self.steps():
            try:
                checkpoint = self.get(step, verify)
                return checkpoint, load(checkpoint)
            except CheckpointError as exc:
                if exc.reason == "mismatch":
                    raise
                skipped.add(_step(step), exc)
        skipped.none_left()
        return None

    def newest(self) -> Checkpoint | None:
        """The newest committed checkpoint whose manifest reads, not verified (for figures and fallbacks);
        None when there is none or the root cannot be listed."""
        try:
            committed = self.committed()
        except CheckpointError:
            return None
        for directory in committed:
            try:
                return Checkpoint.load(directory)
            except CheckpointError:
                continue
        return None

    def prune(self, protect: Path | None = None) -> list[Path]:
        """Remove checkpoints beyond the newest ``keep``, and temporary directories this host's dead
        processes left behind; never ``protect`` (the step just committed). Returns what was removed."""
        removed: list[Path] = []
        if self.keep:
            for step in self.steps()[self.keep :]:
                victim = self.path_of(step)
                if victim == protect:
                    continue
                trash = self.root / f"{_TRASH_PREFIX}{victim.name}-{uuid.uuid4().hex[:8]}"
                try:
                    os.rename(victim, trash)  # atomic: never seen half-deleted as a checkpoint
                except OSError:
                    continue
                shutil.rmtree(trash, ignore_errors=True)
                removed.append(victim)
        if self.root.is_dir():
            for entry in self.root.iterdir():
                if entry.name.startswith(_TRASH_PREFIX) or (
                    entry.name.startswith(_TMP_PREFIX) and _abandoned(entry.name)
                ):
                    shutil.rmtree(entry, ignore_errors=True)
                    removed.append(entry)
        return removed


# -- helpers ----------------------------------------------------------------------------------------------


_Key = TypeVar("_Key")
_Found = TypeVar("_Found")


def valid_only(
    keys: Iterable[_Key], get: Callable[[_Key], _Found], label: Callable[[_Key], str] | None = None
) -> Iterator[_Found]:
    """``get(key)`` for each key in order, skipping each one whose checkpoint raises CheckpointError with a
    CheckpointWarning that names the file (and ``label(key)``: the step): the resume rule of every store and
    callback."""
    for key in keys:
        try:
            found = get(key)
        except CheckpointError as exc:
            what = "checkpoint" if label is None else label(key)
            warnings.warn(f"skipping {what}: {exc}", CheckpointWarning, stacklevel=3)
            continue
        yield found


class Skipped:
    """The steps a resume passed over, each with why: each one is warned about as it is skipped (a
    CheckpointWarning naming the step and the reason), and :meth:`none_left` says, in one more warning, that
    none is left to load and lists them; the resume then starts without a checkpoint, as with none.
    ``loud=False``: collected but not warned about (a rank other than the one that speaks for the job)."""

    def __init__(self, where: object, *, loud: bool = True) -> None:
        self.where = where
        self.loud = loud
        self.skipped: list[str] = []

    def add(self, what: str, why: object, *, loud: bool | None = None) -> None:
        self.skipped.append(f"{what} ({why})")
        if self.loud if loud is None else loud:
            warnings.warn(f"skipping {what}: {why}", CheckpointWarning, stacklevel=3)

    def none_left(self) -> None:
        if self.skipped and self.loud:
            warnings.warn(
                f"no checkpoint in {self.where} could be loaded, so none is resumed (the job starts as without "
                f"one); skipped: {'; '.join(self.skipped)}",
                CheckpointWarning,
                stacklevel=3,
            )


def _step(step: int) -> str:
    return f"step {step}"


def loaded_only(
    found: Iterable[_Found], load: Callable[[_Found], _Loaded]
) -> Iterator[tuple[_Found, _Loaded]]:
    """Each checkpoint with what ``load`` made of it, skipping (with a CheckpointWarning) those whose load
    fails as storage (CheckpointError); a ``mismatch`` (the state does not fit) is raised, as every older
    step would not fit either."""
    for checkpoint in found:
        try:
            loaded = load(checkpoint)
        except CheckpointError as exc:
            if exc.reason == "mismatch":
                raise
            warnings.warn(f"skipping checkpoint: {exc}", CheckpointWarning, stacklevel=3)
            continue
        yield checkpoint, loaded


def _owner_tag() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


def _abandoned(name: str) -> bool:
    """Whether a temporary directory belongs to a process of this host that is gone."""
    rest = name[len(_TMP_PREFIX) :]
    host, _, _tail = rest.rpartition("-")  # tail: the random suffix
    host, _, pid_text = host.rpartition("-")
    if host != socket.gethostname() or not pid_text.isdigit():
        return False
    pid = int(pid_text)
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False
