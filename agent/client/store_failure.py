"""Why a checkpoint save failed, in words a user can act on: the errno found anywhere in the exception
(torch DCP's CheckpointException carries every rank's), or a file system left full when torch hid it; and,
for a failed emergency save, the earlier committed step the notice is handled with instead. Standard library
only.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from agent.checkpoint.manifest import MANIFEST, Checkpoint, CheckpointError, reason_of
from agent.client.preempted import record_emergency

# Free space below this share of the file system (at most 1 MiB) right after a failed write means the write
# filled it: torch's zip writer reports a failed write as "unexpected pos", without the errno.
_FULL_SHARE = 0.01
_FULL_AT_MOST = 1 << 20


def convertible(exc: BaseException) -> bool:
    """Whether a save's exception becomes a CheckpointError: any Exception, and torch DCP's
    CheckpointException (a BaseException carrying every rank's failure); never an interrupt or an exit."""
    return isinstance(exc, Exception) or isinstance(getattr(exc, "failures", None), Mapping)


def free_bytes(path: Path) -> int | None:
    """Bytes an unprivileged writer may still use on the file system of ``path``; None when unknown."""
    try:
        stat = os.statvfs(path)
    except OSError:
        return None
    return stat.f_bavail * stat.f_frsize


def os_error(exc: BaseException) -> OSError | None:
    """The first OSError with an errno in ``exc``, its causes and contexts, and the per-rank failures of a
    DCP CheckpointException."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        current = todo.pop(0)
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno is not None:
            return current
        todo += [current.__cause__, current.__context__]
        failures = getattr(current, "failures", None)
        if isinstance(failures, Mapping):
            todo += [v[0] if isinstance(v, tuple) else v for v in failures.values()]
    return None


def summary(exc: BaseException) -> str:
    """What went wrong, in one line: the per-rank causes of a DCP CheckpointException (deduplicated, no
    tracebacks), else the exception's type and message."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, Mapping) and failures:
        causes: dict[str, list[str]] = {}
        for rank, value in sorted(failures.items()):
            cause = value[0] if isinstance(value, tuple) else value
            causes.setdefault(f"{type(cause).__name__}: {cause}", []).append(str(rank))
        return "; ".join(f"rank {', '.join(ranks)}: {cause}" for cause, ranks in causes.items())
    return f"{type(exc).__name__}: {exc}"


def _size(count: int | None) -> str:
    if count is None:
        return "an unknown amount"
    return f"{count} bytes ({count / 2**20:.1f} MiB)"


def _written(tmp: Path | None) -> int:
    if tmp is None:
        return 0
    total = 0
    for path in tmp.rglob("*"):
        try:
            total += path.stat().st_size if path.is_file() else 0
        except OSError:
            continue
    return total


def _filled(tmp: Path | None) -> bool:
    """Whether the file system of ``tmp`` is (nearly) full right now, before the failed save is removed."""
    if tmp is None:
        return False
    try:
        stat = os.statvfs(tmp if tmp.exists() else tmp.parent)
    except OSError:
        return False
    total = stat.f_blocks * stat.f_frsize
    return stat.f_bavail * stat.f_frsize <= min(_FULL_AT_MOST, total * _FULL_SHARE)


def save_failure(
    exc: BaseException,
    step: int,
    root: Path,
    tmp: Path | None,
    free_before: int | None,
    newest: Callable[[], Checkpoint | None],
) -> CheckpointError:
    """The CheckpointError for a failed save of ``step``, naming its cause. Call it before the temporary
    directory ``tmp`` is removed: what it holds and the space left then tell a full disk apart when torch
    hid the errno."""
    if isinstance(exc, CheckpointError) and exc.reason is not None:
        return CheckpointError(f"checkpoint save of step {step} failed: {exc}", reason=exc.reason)
    found = os_error(exc)
    reason = reason_of(found) if found is not None else ("no_space" if _filled(tmp) else None)
    where = (found.filename if found is not None else None) or root
    if reason == "no_space":
        last_step = newest()
        last = (
            f"; the newest committed step, {last_step.step}, takes {_size(last_step.bytes)}"
            if last_step
            else ""
        )
        told = "" if found is not None else f" (the writer reported {summary(exc)})"
        why = (
            f"no space left on the file system of {root}{told}: {_size(free_before)} were free when the save "
            f"started and it needs more ({_size(_written(tmp))} written before it failed){last}. Free space "
            "there (a lower keep helps) or move the checkpoint root"
        )
    elif reason == "permission":
        why = (
            f"permission denied on {where} ({found}): this user ({os.getuid()}) cannot write there; check "
            f"the owner and mode of {root}"
        )
    elif reason == "io":
        why = (
            f"I/O error on {where} ({found}): the disk or network file system failed; see the kernel log "
            "(dmesg) and the storage's health"
        )
    elif reason == "read_only":
        why = f"the file system of {root} is read-only ({found}); remount it read-write or move the root"
    elif found is not None:
        why = f"{found} ({summary(exc)})" if found is not exc else str(found)
    else:
        why = summary(exc)
    return CheckpointError(f"checkpoint save of step {step} under {root} failed: {why}", reason=reason)


def fall_back(
    committed: Callable[[], Iterable[Path]],
    step: int,
    notice_id: str | None,
    error: CheckpointError,
    *,
    sharded: bool,
    manifest: str = MANIFEST,
) -> Checkpoint | None:
    """After a failed emergency save: the newest earlier committed checkpoint (its manifest reads and its
    files have their sizes) of the step directories ``committed()`` lists, newest first, recorded for
    ``preemptd exec`` as the one the notice was handled with, so the job still exits 75 and is requeued; None
    when there is none (or the root cannot be listed)."""
    try:
        directories = list(committed())
    except CheckpointError:
        return None
    for directory in directories:
        try:
            checkpoint = Checkpoint.load(directory, manifest)
            checkpoint.verify("size")
        except CheckpointError:
            continue
        record_emergency(
            checkpoint.step,
            path=checkpoint.path,
            notice_id=notice_id,
            sharded=sharded,
            fallback=True,
            failed_step=step,
            error=str(error)[:2000],
        )
        return checkpoint
    return None
