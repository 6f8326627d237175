"""Slurm's own tools as the Slurm bridge uses them: ``sinfo``/``squeue`` with JSON output to read nodes and
jobs, ``scontrol`` and ``scancel`` to drain, requeue, resume and signal.

The parsers are pure functions over the JSON documents (both the ``openapi/v0.0.3x`` shape of Slurm 21.08 and
22.05 and the ``data_parser`` shape of 23.02 on, where states became lists). :class:`SlurmCommands` runs each
tool as an argv list (never a shell string) in an asyncio subprocess with a timeout and bounded retries, and
hands back the command's stderr with every failure.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal as signals
import socket
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from agent.core.errors import ConfigError

# Job states in which a job holds the node's resources and has (or is about to have) steps there.
ACTIVE_JOB_STATES = frozenset({"RUNNING", "CONFIGURING", "SUSPENDED", "COMPLETING", "STAGE_OUT"})
# Node state flags under which Slurm schedules nothing new on the node.
DRAIN_FLAGS = frozenset({"DRAIN", "DRAINING", "DRAINED"})


class SlurmError(Exception):
    """A Slurm command failed, or its output was not what this Slurm should print; ``str()`` says which
    command, how it failed and what it wrote on stderr."""

    def __init__(self, message: str, *, argv: Sequence[str] = (), stderr: str = "", missing: bool = False):
        super().__init__(message)
        self.argv = tuple(argv)
        self.stderr = stderr
        self.missing = missing


@dataclass(frozen=True)
class SlurmNode:
    name: str
    hostname: str
    address: str
    states: frozenset[str]
    reason: str
    reason_set_by: str | None

    @property
    def drained(self) -> bool:
        """Whether Slurm places nothing new here (DRAIN flag, or a DRAINED/DRAINING base state)."""
        return bool(self.states & DRAIN_FLAGS)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "hostname": self.hostname,
            "address": self.address,
            "state": sorted(self.states),
            "reason": self.reason,
            "reason_set_by": self.reason_set_by,
        }


@dataclass(frozen=True)
class SlurmJob:
    job_id: int
    name: str
    user: str
    state: str
    requeue: bool
    nodes: str
    restarts: int = 0
    exit_code: int | None = None
    # When the job ended (Unix seconds); for a job still running Slurm gives its expected end instead.
    end_time: int | None = None
    # sbatch's jobs; only they can be requeued. A batch job's script runs on its batch host: the job cannot
    # outlive that node, even with --no-kill.
    batch: bool = True
    batch_host: str = ""

    @property
    def active(self) -> bool:
        return self.state in ACTIVE_JOB_STATES

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "job_id": self.job_id,
            "name": self.name,
            "user": self.user,
            "state": self.state,
            "requeue": self.requeue,
            "restarts": self.restarts,
        }
        if self.exit_code is not None and not self.active:  # a running job's exit code is Slurm's 0
            doc["exit_code"] = self.exit_code
        return doc


# --- pure parsers --------------------------------------------------------------------------------------


def _states(value: Any) -> frozenset[str]:
    """A state field as a set of upper-case names: a string (``"idle"``, ``"IDLE+DRAIN"``) or a list."""
    if isinstance(value, str):
        return frozenset(part.upper() for part in value.replace("+", " ").split() if part)
    if isinstance(value, list):
        return frozenset(str(part).upper() for part in value if part)
    return frozenset()


def _number(value: Any) -> int | None:
    """Slurm numbers: plain ints, or ``{"set": true, "number": N}`` in the data_parser shape."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, Mapping) and value.get("set") is not False:
        number = value.get("number")
        return number if isinstance(number, int) and not isinstance(number, bool) else None
    return None


def _wait_status(raw: int | None) -> int | None:
    """A wait status as a shell shows it: the exit status, or 128 + the signal that killed the process."""
    if raw is None:
        return None
    return os.WEXITSTATUS(raw) if os.WIFEXITED(raw) else 128 + os.WTERMSIG(raw)


def _document(text: str, what: str, key: str) -> list[Mapping[str, Any]]:
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise SlurmError(f"{what} printed no JSON ({exc}); this Slurm may lack JSON output") from exc
    if not isinstance(doc, Mapping) or not isinstance(doc.get(key), list):
        raise SlurmError(f"{what} printed JSON without a {key!r} list")
    errors = [e for e in doc.get("errors") or [] if e]
    if errors:
        raise SlurmError(f"{what} reported errors: {json.dumps(errors)[:500]}")
    return [item for item in doc[key] if isinstance(item, Mapping)]


def parse_nodes(text: str) -> list[SlurmNode]:
    """Nodes from ``sinfo --json``."""
    nodes = []
    for item in _document(text, "sinfo --json", "nodes"):
        name = item.get("name")
        if not isinstance(name, str) or not name:
            continue
        states = _states(item.get("state")) | _states(item.get("state_flags"))
        set_by = item.get("reason_set_by_user")
        nodes.append(
            SlurmNode(
                name=name,
                hostname=str(item.get("hostname") or ""),
                address=str(item.get("address") or ""),
                states=states,
                reason=str(item.get("reason") or ""),
                reason_set_by=set_by if isinstance(set_by, str) and set_by else None,
            )
        )
    return nodes


def parse_jobs(text: str) -> list[SlurmJob]:
    """Jobs from ``squeue --json``."""
    jobs = []
    for item in _document(text, "squeue --json", "jobs"):
        job_id = _number(item.get("job_id"))
        if job_id is None:
            continue
        state = sorted(_states(item.get("job_state")) & _BASE_JOB_STATES) or sorted(
            _states(item.get("job_state"))
        )
        exit_code = item.get("exit_code")
        if isinstance(exit_code, Mapping):  # data_parser: {"status": [...], "return_code": N}
            code = _number(exit_code.get("return_code"))
        else:  # openapi/v0.0.3x: the raw wait status (75 << 8 for an exit with 75)
            code = _wait_status(_number(exit_code))
        jobs.append(
            SlurmJob(
                job_id=job_id,
                name=str(item.get("name") or ""),
                user=str(item.get("user_name") or ""),
                state=state[0] if state else "UNKNOWN",
                requeue=item.get("requeue") is True,
                nodes=str(item.get("nodes") or ""),
                restarts=_number(item.get("restart_cnt")) or 0,
                exit_code=code,
                end_time=_number(item.get("end_time")),
                batch=item.get("batch_flag") is not False,
                batch_host=str(item.get("batch_host") or ""),
            )
        )
    return jobs


_BASE_JOB_STATES = frozenset(
    {
        "PENDING",
        "RUNNING",
        "SUSPENDED",
        "COMPLETE",
        "COMPLETED",
        "CANCELLED",
        "FAILED",
        "TIMEOUT",
        "NODE_FAIL",
        "PREEMPTED",
        "BOOT_FAIL",
        "DEADLINE",
        "OUT_OF_MEMORY",
        "CONFIGURING",
        "COMPLETING",
        "STAGE_OUT",
    }
)


def running_or_ended_since(jobs: Iterable[SlurmJob], since: float) -> list[SlurmJob]:
    """The jobs that hold their node now or ended at ``since`` (Unix seconds) or later; not pending ones."""
    return [job for job in jobs if job.active or (job.state != "PENDING" and (job.end_time or 0) >= since)]


# The ended jobs a requeue brings back: one that failed (exit 75 after its flush, or stopped by the signal)
# or lost its node. One that completed, was cancelled or ran out of time or memory stays as it ended.
REQUEUE_ENDED = frozenset({"FAILED", "NODE_FAIL", "PREEMPTED"})


def requeue_verdict(job: SlurmJob, restarts_at_notice: int, tried: bool) -> tuple[str, str] | None:
    """Whether to requeue ``job`` (as read now) for a notice that found it with ``restarts_at_notice``: None
    to requeue it, else the outcome for the record (``ok``, ``skipped``, ``not_requeueable``) and the
    status. ``tried``: a requeue of ours was sent and may have landed although it failed here."""
    if not job.requeue:
        return "not_requeueable", "left alone: not requeueable (submitted with --no-requeue)"
    if not job.batch:
        return "not_requeueable", "left alone: not a batch job (Slurm requeues only jobs that sbatch started)"
    if job.restarts > restarts_at_notice:
        # Requeued since the notice found it: by a try of ours that timed out, or by Slurm itself
        # (RequeueExit=75); a second requeue would stop the run that has started again.
        return (
            ("ok", "requeued") if tried else ("skipped", f"already requeued (restart count {job.restarts})")
        )
    if job.state == "PENDING":
        return "skipped", "already pending"
    if not job.active and job.state not in REQUEUE_ENDED:
        return "skipped", f"left alone: ended {job.state} (exit {job.exit_code}), not requeued"
    return None


def match_node(nodes: Iterable[SlurmNode], names: Iterable[str]) -> SlurmNode | None:
    """The node whose NodeHostname, NodeAddr or NodeName is one of ``names`` (this host's hostnames and
    addresses), in that order of preference; None when no node or more than one matches equally."""
    wanted = {n.lower() for n in names if n}
    nodes = list(nodes)
    for attribute in ("hostname", "address", "name"):
        found = [n for n in nodes if getattr(n, attribute).lower() in wanted]
        if len(found) == 1:
            return found[0]
        if len(found) > 1:
            return None
    return None


def host_names() -> list[str]:
    """This host's names and addresses as Slurm may know them: hostname, FQDN and the interface addresses."""
    names = {socket.gethostname(), socket.getfqdn(), socket.gethostname().split(".")[0]}
    for addresses in psutil.net_if_addrs().values():
        for address in addresses:
            if address.family in (socket.AF_INET, socket.AF_INET6):
                names.add(address.address.split("%")[0])
    return sorted(n for n in names if n)


def parse_signal(value: str, key: str = "actions.slurm.signal") -> str:
    """The signal as scancel takes it (a name without ``SIG``, or a number); ConfigError naming ``key``."""
    text = value.strip()
    if not text:
        return ""
    if text.isdigit():
        number = int(text)
        if number in {int(s) for s in signals.Signals}:
            return str(number)
    else:
        name = text.upper()
        name = name if name.startswith("SIG") else "SIG" + name
        if name in signals.Signals.__members__:
            return name.removeprefix("SIG")
    raise ConfigError(
        f"{key}: {value!r} is not a signal; use a name such as 'USR1' or 'TERM', or a number, or '' for none"
    )


# --- running the tools ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class CommandResult:
    argv: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str
    attempts: int
    duration_s: float


@dataclass
class SlurmCommands:
    """Runs Slurm's tools. ``bin_dir`` empty means PATH; ``slurm_conf`` sets ``SLURM_CONF`` for them."""

    bin_dir: str = ""
    slurm_conf: str = ""
    timeout_s: float = 10.0
    retries: int = 2
    retry_delay_s: float = 0.5
    env: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))

    def tool(self, name: str) -> str:
        """The path of tool ``name``; SlurmError(missing=True) when it is not installed."""
        if self.bin_dir:
            path = Path(self.bin_dir) / name
            if os.access(path, os.X_OK):
                return str(path)
            raise SlurmError(f"{name} not found in {self.bin_dir} (actions.slurm.bin_dir)", missing=True)
        found = shutil.which(name, path=self.env.get("PATH", os.defpath))
        if found is None:
            raise SlurmError(
                f"{name} is not on PATH; install Slurm's client tools or set actions.slurm.bin_dir",
                missing=True,
            )
        return found

    async def run(self, name: str, *args: str, retry: bool = True) -> CommandResult:
        """Run tool ``name`` with ``args``; retried up to ``retries`` times when it fails or times out.
        Raises SlurmError with the last stderr when every attempt failed."""
        argv = (self.tool(name), *args)
        env = dict(self.env)
        if self.slurm_conf:
            env["SLURM_CONF"] = self.slurm_conf
        attempts = 1 + (max(0, self.retries) if retry else 0)
        started = time.monotonic()
        failure = ""
        stderr = ""
        for attempt in range(1, attempts + 1):
            if attempt > 1:
                await asyncio.sleep(self.retry_delay_s * 2 ** (attempt - 2))
            try:
                code, out, stderr = await _exec(argv, env, self.timeout_s)
            except asyncio.TimeoutError:
                failure, stderr = f"timed out after {self.timeout_s:g} s", ""
                continue
            except OSError as exc:
                raise SlurmError(f"{name} could not be started: {exc}", argv=argv, missing=True) from exc
            if code == 0:
                return CommandResult(argv, code, out, stderr, attempt, round(time.monotonic() - started, 3))
            failure = f"exited with status {code}"
        shown = " ".join(argv[1:])
        tail = f": {stderr.strip()}" if stderr.strip() else ""
        raise SlurmError(
            f"{name} {shown} {failure} after {attempts} attempt(s){tail}", argv=argv, stderr=stderr.strip()
        )

    # --- the calls the bridge makes ---

    async def nodes(self) -> list[SlurmNode]:
        return parse_nodes((await self.run("sinfo", "--json")).stdout)

    async def find_node(self, names: list[str]) -> SlurmNode:
        """The node whose NodeHostname/NodeAddr is one of ``names`` (this host's names and addresses)."""
        nodes = await self.nodes()
        node = match_node(nodes, names)
        if node is None:
            known = ", ".join(f"{n.name} ({n.hostname}/{n.address})" for n in nodes[:10]) or "none"
            raise SlurmError(
                f"no Slurm node has this host's name or address as NodeHostname/NodeAddr "
                f"(this host: {', '.join(names[:6])}; nodes: {known}); set actions.slurm.node"
            )
        return node

    async def node(self, name: str) -> SlurmNode:
        result = await self.run("sinfo", "--json", "--nodes", name)
        for node in parse_nodes(result.stdout):
            if node.name == name:
                return node
        raise SlurmError(f"Slurm knows no node named {name!r} (sinfo --json --nodes {name})")

    async def jobs_on(self, node: str, ended_since: float | None = None) -> list[SlurmJob]:
        """The jobs that run on ``node`` now (filtered here too: older squeue --json ignored some filters),
        and with ``ended_since`` (Unix seconds) also those that ended there since then: a job that exited
        after its flush while the controller could not be asked is still the notice's job."""
        if ended_since is None:
            result = await self.run("squeue", "--json", "--nodelist", node)
            return [job for job in parse_jobs(result.stdout) if job.active]
        result = await self.run("squeue", "--json", "--states", "all", "--nodelist", node)
        return running_or_ended_since(parse_jobs(result.stdout), ended_since)

    async def jobs(self, job_ids: Iterable[int]) -> list[SlurmJob]:
        """These jobs in whatever state the controller still holds them."""
        ids = sorted(set(job_ids))
        if not ids:
            return []
        result = await self.run("squeue", "--json", "--states", "all", "--jobs", ",".join(map(str, ids)))
        return [job for job in parse_jobs(result.stdout) if job.job_id in ids]

    # The changes run once per call: one that timed out may still have reached the controller, so only the
    # caller, after reading the node or job again, may try once more.

    async def drain(self, node: str, reason: str) -> CommandResult:
        return await self.run(
            "scontrol", "update", f"NodeName={node}", "State=DRAIN", f"Reason={reason}", retry=False
        )

    async def resume(self, node: str) -> CommandResult:
        return await self.run("scontrol", "update", f"NodeName={node}", "State=RESUME", retry=False)

    async def requeue(self, job_id: int) -> CommandResult:
        return await self.run("scontrol", "requeue", str(job_id), retry=False)

    async def signal(self, job_id: int, signal: str) -> CommandResult:
        # Without --batch/--full scancel signals the job's steps only, as sbatch --signal does.
        return await self.run("scancel", f"--signal={signal}", str(job_id))


async def _exec(argv: Sequence[str], env: Mapping[str, str], timeout: float) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=dict(env),
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
    except (asyncio.TimeoutError, asyncio.CancelledError):
        if proc.returncode is None:
            proc.kill()
        await proc.wait()
        raise
    assert proc.returncode is not None
    return proc.returncode, out.decode(errors="replace"), err.decode(errors="replace")
