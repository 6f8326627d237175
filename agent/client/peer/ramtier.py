"""The client of the agent's RAM tier: a directory on tmpfs that the agent owns, where a job's ranks put the
files of a checkpoint step to outlive their processes (not the host), reserving room first and committing the
step once the host's part is complete (``tier.json``, written here). The paths come from the agent, never
from a guess; :func:`job_id` (or :func:`resolve_job_id`, which asks the agent too) names the job so that two
jobs on the same hosts never mix. Standard library only (over :mod:`agent.client.transport`); the contract is
docs/ram-tier.md's.
"""

from __future__ import annotations

import json
import os
import re
import urllib.parse
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from agent.checkpoint.checksum import crc32
from agent.client.transport import AgentHTTPError, AgentUnavailable, request_json
from agent.core.domain import Domain

TIER_FILE = "tier.json"
_JOB_ID = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
# Reservations and commits touch only the agent's bookkeeping; a listing reads tier.json files.
_TIMEOUT_S = 10.0


class RamTierError(RuntimeError):
    """The RAM tier cannot be used: ``reason`` is ``unreachable`` (no agent, or no answer), ``disabled``
    (``[ram_tier]`` is off on that host), ``unavailable`` (its directory cannot be used, or it is being read
    back after a start), ``full`` (the cap leaves no room), ``missing`` (no such job or step), ``refused``
    (any other refusal: the message says which)."""

    def __init__(self, message: str, reason: str, status: int | None = None) -> None:
        super().__init__(message)
        self.reason = reason
        self.status = status


@dataclass(frozen=True)
class Reservation:
    """Room reserved for one step of a job on this host: write the files into ``path``, then commit."""

    job: str
    step: int
    path: Path
    id: str
    bytes: int


class NoJobId(ValueError):
    """Nothing names the job: no explicit id, none in the environment (and, from :func:`resolve_job_id`, none
    the agent knows)."""


def job_id(explicit: str | None = None, env: Mapping[str, str] | None = None) -> str:
    """The id of this job for the RAM tier: ``explicit``, else ``PREEMPTD_JOB_ID``, else torchrun's
    ``TORCHELASTIC_RUN_ID`` (unless ``none``, its default), else ``SLURM_JOB_ID`` (with ``_`` and
    ``SLURM_ARRAY_TASK_ID`` for an array task). :class:`NoJobId` saying how to set one when there is none,
    ValueError when it is not ``[A-Za-z0-9._-]{1,128}``."""
    environ = os.environ if env is None else env
    found: list[tuple[str, str]] = []
    if explicit is not None:
        found.append(("the job id given", explicit))
    if environ.get("PREEMPTD_JOB_ID"):
        found.append(("PREEMPTD_JOB_ID", environ["PREEMPTD_JOB_ID"]))
    run_id = environ.get("TORCHELASTIC_RUN_ID", "")
    if run_id and run_id != "none":
        found.append(("TORCHELASTIC_RUN_ID", run_id))
    if environ.get("SLURM_JOB_ID"):
        task = environ.get("SLURM_ARRAY_TASK_ID")
        found.append(("SLURM_JOB_ID", environ["SLURM_JOB_ID"] + (f"_{task}" if task else "")))
    if not found:
        raise NoJobId(
            "no job id for the RAM tier: pass job=... to the store, or set PREEMPTD_JOB_ID (torchrun's "
            "--rdzv-id and Slurm's SLURM_JOB_ID are used when present); the same on every rank of the job "
            "and different from every other job on these hosts"
        )
    where, value = found[0]
    if not _JOB_ID.match(value):
        raise ValueError(
            f"{where} {value!r} is not a valid RAM-tier job id: use 1 to 128 characters of A-Z a-z 0-9 . _ -"
        )
    return value


def resolve_job_id(
    explicit: str | None = None, socket: str | Path | None = None, timeout: float = _TIMEOUT_S
) -> str:
    """:func:`job_id`, else the job the agent at ``socket`` knows this process by (``GET
    /v1/ram-tier/job-id``: the owner of the pod it runs in, with the Kubernetes bridge on). :class:`NoJobId`
    saying what each said when neither names one."""
    try:
        return job_id(explicit)
    except NoJobId as exc:
        unnamed = exc
    try:
        body = request_json("GET", "/v1/ram-tier/job-id", None, socket_path=socket, timeout=timeout)
    except AgentUnavailable as exc:
        raise NoJobId(f"{unnamed} (and the agent could not be asked: {exc})") from None
    except AgentHTTPError as exc:
        said = exc.body.get("error") if isinstance(exc.body, Mapping) else exc.body
        if exc.status == 404 and said is None:
            said = "the agent's RAM tier is off"
        raise NoJobId(f"{unnamed} (and the agent knows none: {said})") from None
    except (OSError, ValueError) as exc:
        raise NoJobId(f"{unnamed} (and the agent could not be asked: {exc})") from None
    value = body.get("job") if isinstance(body, Mapping) else None
    if not isinstance(value, str) or not _JOB_ID.match(value):
        raise NoJobId(f"{unnamed} (and the agent's answer names no valid job: {body!r})")
    return value


class RamTier:
    """This host's RAM tier, through the agent at ``socket`` (``PREEMPTD_SOCKET`` or the default path when
    None). Every call raises :class:`RamTierError` with a reason when the tier cannot be used.

    ``drain_to``: the job's durable checkpoint root (the ``ShardedStore``'s, seen by every host); each step
    committed through this client is then copied there by the agent as an ordinary committed step
    (docs/ram-tier.md, "Drain")."""

    def __init__(
        self,
        socket: str | Path | None = None,
        timeout: float = _TIMEOUT_S,
        drain_to: str | Path | None = None,
    ) -> None:
        self.socket = socket
        self.timeout = timeout
        self.drain_to = None if drain_to is None else os.path.abspath(drain_to)

    def info(self) -> dict[str, Any]:
        """The tier as the agent sees it: path, cap, used/reserved/free bytes, jobs, and the host's failure
        domain (``domain``: :meth:`domain_of` reads it)."""
        return dict(self._call("GET", "/v1/ram-tier"))

    @staticmethod
    def domain_of(info: Mapping[str, Any]) -> Domain | None:
        """The failure domain of the host whose :meth:`info` this is; None when its agent does not know it
        (no cloud identified yet, an older agent, a document that is not a domain)."""
        return Domain.from_json(info.get("domain"))

    def job(self, job: str) -> dict[str, Any]:
        """What the tier holds for ``job``: its path and its steps (newest first)."""
        return dict(self._call("GET", f"/v1/ram-tier/jobs/{_quote(job)}"))

    def reserve(self, job: str, step: int, nbytes: int) -> Reservation:
        """Reserve ``nbytes`` for ``step`` of ``job``; the step directory exists (writable by this uid) when
        it returns. RamTierError with reason ``full`` when the cap leaves no room."""
        body = self._call(
            "POST", f"/v1/ram-tier/jobs/{_quote(job)}/reserve", {"step": step, "bytes": int(nbytes)}
        )
        return Reservation(job, step, Path(body["path"]), str(body["reservation"]), int(nbytes))

    def commit(self, job: str, step: int, reservation: str) -> dict[str, Any]:
        """Hand the step (its ``tier.json`` written, see :func:`write_tier_file`) to the agent's inventory,
        to be drained to ``drain_to`` when set."""
        doc: dict[str, Any] = {"reservation": reservation}
        if self.drain_to is not None:
            doc["durable_root"] = self.drain_to
        body = self._call("POST", f"/v1/ram-tier/jobs/{_quote(job)}/steps/{step}/commit", doc)
        return dict(body or {})

    def free(self, job: str, step: int | None = None) -> None:
        """Free one step of ``job``, or all of it."""
        path = f"/v1/ram-tier/jobs/{_quote(job)}" + ("" if step is None else f"/steps/{step}")
        self._call("DELETE", path)

    def _call(self, method: str, path: str, body: Any = None) -> Any:
        try:
            return request_json(method, path, body, socket_path=self.socket, timeout=self.timeout)
        except AgentUnavailable as exc:
            raise RamTierError(f"RAM tier: {exc}", "unreachable") from exc
        except AgentHTTPError as exc:
            said = exc.body.get("error") if isinstance(exc.body, Mapping) else exc.body
            reason = {404: "missing", 503: "unavailable", 507: "full"}.get(exc.status, "refused")
            if exc.status == 404 and path == "/v1/ram-tier":
                reason = "disabled"
            raise RamTierError(f"RAM tier: {method} {path}: {said}", reason, exc.status) from exc
        except (OSError, ValueError) as exc:  # a timeout, a reset, a reply that is not JSON
            raise RamTierError(f"RAM tier: {method} {path}: {exc}", "unreachable") from exc


def _quote(job: str) -> str:
    return urllib.parse.quote(job, safe="")


def file_entry(path: Path, rank: int) -> dict[str, int]:
    """The tier.json entry of a file: its size, CRC32 and the rank that wrote it."""
    crc = 0
    size = 0
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 22):
            crc = crc32(chunk, crc)
            size += len(chunk)
    return {"size": size, "crc32": crc, "rank": rank}


def write_tier_file(
    directory: Path,
    *,
    job: str,
    step: int,
    run: int,
    world_size: int,
    files: Mapping[str, Mapping[str, int]],
    complete: bool,
    extra: Mapping[str, Any] | None = None,
) -> Path:
    """Write ``tier.json`` into a step directory last and atomically (a temporary file, then a rename), as
    the agent reads a step without it as incomplete."""
    doc = {
        "job": job,
        "step": step,
        "run": run,
        "world_size": world_size,
        "files": {name: dict(entry) for name, entry in sorted(files.items())},
        "complete": complete,
        "time": datetime.now(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z"),
        **dict(extra or {}),
    }
    staged = directory / f".{TIER_FILE}.{uuid.uuid4().hex[:8]}"
    staged.write_text(json.dumps(doc, indent=1))
    os.rename(staged, directory / TIER_FILE)
    return directory / TIER_FILE


def read_tier_file(directory: Path) -> dict[str, Any] | None:
    """A step directory's tier.json, or None when it is missing or unreadable (an incomplete step)."""
    try:
        doc = json.loads((directory / TIER_FILE).read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None
