"""The RAM tier's HTTP routes on the agent's socket (``/v1/ram-tier``): thin handlers over the component's
books and the inventory's directory work (run in a thread); every refusal is ``{"error": ...}`` with the
status of its :class:`~agent.ramtier.errors.TierError`. A job is the asking uid's (SO_PEERCRED): ``?uid=N``
names another uid's job, for root, the agent's user and the admin group alone."""

from __future__ import annotations

import asyncio
import functools
import json
import os
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from agent.core.domain import DOMAIN, Domain
from agent.core.jobs import JOB_NAMES, JobNameRegistry
from agent.core.peers import is_admin, peer_credentials
from agent.ramtier.errors import TierError
from agent.ramtier.inventory import (
    Root,
    check_file_name,
    check_job,
    check_step,
    job_dir,
    open_checked,
    read_step,
    remove_tree,
    step_dir,
)
from agent.ramtier.ports import TierView

BODY_TIMEOUT_S = 10.0
FETCH_CHUNK = 4 * 1024 * 1024
MAX_RESERVE_BYTES = 2**62
Route = Callable[[web.Request], Awaitable[web.StreamResponse]]


def routes(tier: TierView) -> list[tuple[str, str, Route]]:
    def bind(handler: Callable[[TierView, web.Request], Awaitable[web.StreamResponse]]) -> Route:
        @functools.wraps(handler)
        async def serve(request: web.Request) -> web.StreamResponse:
            try:
                try:
                    return await handler(tier, request)
                except PermissionError as exc:
                    raise _not_permitted(exc) from exc
                except OSError as exc:  # the file system said no (full, read-only, too many files)
                    raise TierError(
                        503,
                        f"the RAM tier's file system refused: {exc.strerror or exc} ({exc.filename or 'tier'})",
                    ) from exc
            except TierError as exc:
                # Bounded: any socket user can ask for refusals in a loop.
                level = "info" if exc.status in (404, 429, 507) else "warning"
                tier.mistakes.note(
                    level, "ram_tier_refused", path=request.path, status=exc.status, error=str(exc)
                )
                return web.json_response({"error": str(exc), **exc.extra}, status=exc.status)

        return serve

    base = "/v1/ram-tier"
    step = base + "/jobs/{job}/steps/{step}"
    return [
        ("GET", base, bind(info)),
        ("GET", base + "/job-id", bind(job_id)),
        ("GET", base + "/jobs/{job}", bind(job)),
        ("DELETE", base + "/jobs/{job}", bind(free)),
        ("POST", base + "/jobs/{job}/reserve", bind(reserve)),
        ("POST", step + "/commit", bind(commit)),
        ("DELETE", step, bind(free)),
        ("GET", step + "/files/{name}", bind(fetch)),
    ]


def _not_permitted(exc: PermissionError) -> TierError:
    """The agent's own file work refused (a job's directory belongs to the job's user, 0700): what it lacks."""
    return TierError(
        503,
        f"the agent (uid {os.geteuid()}) may not use {exc.filename or 'a job directory'} ({exc.strerror}): a "
        "job's directory belongs to the job's user, so an agent that is not root needs CAP_DAC_OVERRIDE beside "
        'CAP_CHOWN (docs/ram-tier.md, "Under the packaged systemd unit")',
    )


async def _body(request: web.Request, fields: tuple[str, ...]) -> Mapping[str, Any]:
    try:
        raw = await asyncio.wait_for(request.read(), BODY_TIMEOUT_S)
    except (ConnectionError, web.HTTPException):
        raise TierError(400, "the body was cut short before its Content-Length") from None
    except asyncio.TimeoutError:
        raise TierError(408, f"the body did not arrive within {BODY_TIMEOUT_S:g}s") from None
    try:
        doc = json.loads(raw) if raw.strip() else None
    except (ValueError, RecursionError):
        raise TierError(400, "the body is not valid JSON") from None
    if not isinstance(doc, Mapping):
        raise TierError(400, f"the body must be a JSON object with {', '.join(fields)}")
    unknown = sorted(set(doc) - set(fields))
    if unknown:
        raise TierError(400, f"unknown field(s) {', '.join(unknown)[:200]}; known: {', '.join(fields)}")
    return doc


def _durable_root(body: Mapping[str, Any]) -> str | None:
    """Where a step is drained to after the window: an absolute directory the job's user may write."""
    value = body.get("durable_root")
    if value is None:
        return None
    if not isinstance(value, str) or not value.startswith("/") or "\0" in value or len(value) > 4096:
        raise TierError(
            400,
            "field 'durable_root' must be the absolute path of the job's checkpoint root (ShardedStore's)",
        )
    return value


@dataclass(frozen=True)
class Subject:
    """Who asks (the kernel's word for it) and whose jobs the request is about."""

    uid: int
    gid: int
    privileged: bool
    owner: int  # the uid whose job the request names: the asker's own unless an admin says ?uid=


def _count(tier: TierView, request: str, uid: int, job: str, nbytes: int) -> None:
    """Any socket user may reserve or free in a loop: at info, counts per interval (each is a debug line)."""
    tier.requests.count({"requests": request, "jobs": f"{uid}/{job}"}, {f"{request}_bytes": nbytes})


def _subject(tier: TierView, request: web.Request) -> Subject:
    creds = peer_credentials(request)
    if creds is None:
        raise TierError(403, "the RAM tier serves only clients on the agent's Unix socket (peer credentials)")
    privileged, _ = is_admin(creds, tier.host.config.admin_group)
    _, uid, gid = creds
    raw = request.query.get("uid")
    if raw is None:
        return Subject(uid, gid, privileged, uid)
    if not raw.isdigit() or len(raw) > 10:
        raise TierError(400, f"query 'uid' must be a user id (digits), got {raw[:40]!r}")
    owner = int(raw)
    if owner != uid and not privileged:
        raise TierError(
            403,
            f"uid {uid} may see and act on its own jobs only: another uid's jobs (uid={owner}) are for root, "
            "the agent's user and the admin group",
        )
    return Subject(uid, gid, privileged, owner)


async def info(tier: TierView, request: web.Request) -> web.StreamResponse:
    await tier.ready_root()
    who = _subject(tier, request)
    return web.json_response({**tier.summary(who.owner, every_uid=who.privileged), "domain": _domain(tier)})


def _domain(tier: TierView) -> dict[str, str] | None:
    """This host's failure domain, which every rank reads here before an evacuation: None until a cloud
    source has identified the instance (and on an agent without a cloud)."""
    offered = tier.host.hooks.capability(DOMAIN)
    domain = offered() if callable(offered) else None
    return domain.to_json() if isinstance(domain, Domain) else None


async def job_id(tier: TierView, request: web.Request) -> web.StreamResponse:
    """The job of the asking process, as the agent's parts know it (agent/core/jobs.py: the pod's owner),
    for a client whose environment names none."""
    creds = peer_credentials(request)
    if creds is None:
        raise TierError(
            403, "a job id is found only for clients on the agent's Unix socket (peer credentials)"
        )
    registry = tier.host.hooks.capability(JOB_NAMES)
    if not isinstance(registry, JobNameRegistry) or not registry.sources:
        raise TierError(
            404,
            "no part of this agent knows which job a process belongs to (the Kubernetes bridge does, with "
            "[actions.kubernetes] on)",
        )
    found, why = await registry.name_of(creds[0])
    if found is None:
        raise TierError(404, f"no job found for pid {creds[0]}: " + "; ".join(why))
    return web.json_response({"job": found.job, "source": found.source, "pid": creds[0]})


async def job(tier: TierView, request: web.Request) -> web.StreamResponse:
    root = await tier.ready_root()
    who = _subject(tier, request)
    return web.json_response(job_doc(tier, root, who.owner, check_job(request.match_info["job"])))


async def reserve(tier: TierView, request: web.Request) -> web.StreamResponse:
    await tier.ready_root()
    name = check_job(request.match_info["job"])
    body = await _body(request, ("step", "bytes", "durable_root"))
    number = check_step(body.get("step"))
    nbytes = body.get("bytes")
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or not 0 <= nbytes <= MAX_RESERVE_BYTES:
        raise TierError(400, f"field 'bytes' must be a whole number of bytes from 0 to {MAX_RESERVE_BYTES}")
    durable_root = _durable_root(body)
    who = _subject(tier, request)
    if who.owner != who.uid:
        raise TierError(400, "a reservation is made by the job's own user: ?uid= is for reading and freeing")
    path, reservation = await tier.reserve((who.uid, name, number), nbytes, who.gid, durable_root)
    tier.host.log.debug("ram_tier_reserved", job=name, step=number, bytes=nbytes, uid=who.uid)
    _count(tier, "reserved", who.uid, name, nbytes)
    return web.json_response(
        {"path": str(path), "reservation": reservation, "expires_in_s": tier.config.reservation_ttl_s}
    )


async def commit(tier: TierView, request: web.Request) -> web.StreamResponse:
    root = await tier.ready_root()
    name = check_job(request.match_info["job"])
    number = check_step(request.match_info["step"], in_url=True)
    body = await _body(request, ("reservation", "durable_root"))
    if not isinstance(body.get("reservation"), str):
        raise TierError(400, "field 'reservation' must be the id that reserve answered")
    durable_root = _durable_root(body)
    who = _subject(tier, request)
    key = (who.owner, name, number)
    known = tier.holdings.reservations.get(body["reservation"])
    if known is None or known.key != key:
        # The bytes are there either way; without the reservation they must fit what the tier has free.
        tier.mistakes.warning("ram_tier_commit_unreserved", job=name, step=number, uid=who.owner)
    record = await asyncio.to_thread(read_step, root, who.owner, name, number, False)
    reserved = [r for r in tier.holdings.reservations.values() if r.key == key]
    durable_root = durable_root or next((r.durable_root for r in reserved if r.durable_root), None)
    # The drain runs as the job's user: its gid is the one the kernel gave for the job's own client.
    gid = who.gid if who.owner == who.uid else next((r.gid for r in reserved), None)
    tier.holdings.commit(record)
    if durable_root is not None:
        tier.drain(key, durable_root, gid)
    tier.host.log.debug(
        "ram_tier_committed",
        job=name,
        step=number,
        uid=who.owner,
        bytes=record.bytes,
        files=len(record.files),
    )
    _count(tier, "committed", who.owner, name, record.bytes)
    return web.json_response(record.to_json())


async def free(tier: TierView, request: web.Request) -> web.StreamResponse:
    root = await tier.ready_root()
    name = check_job(request.match_info["job"])
    raw_step = request.match_info.get("step")
    number = None if raw_step is None else check_step(raw_step, in_url=True)
    who = _subject(tier, request)
    owner = who.owner
    target = job_dir(root.path, owner, name) if number is None else step_dir(root.path, owner, name, number)
    exists = await asyncio.to_thread(os.path.lexists, target)
    if not exists and not tier.holdings.has(owner, name, number):
        what = f"job {name}" if number is None else f"job {name} step {number}"
        raise TierError(404, f"the RAM tier holds nothing for {what} of uid {owner}")
    gone = tier.holdings.forget(owner, name, number)
    tier.holdings.release(owner, name, number)
    tier.forget_drains(owner, name, number)
    await asyncio.to_thread(remove_tree, target)
    freed = sum(record.bytes for record in gone)
    tier.host.log.debug("ram_tier_freed", job=name, step=number, uid=owner, bytes=freed)
    _count(tier, "freed", owner, name, freed)
    return web.json_response({"job": name, "steps": sorted(r.step for r in gone), "freed_bytes": freed})


async def fetch(tier: TierView, request: web.Request) -> web.StreamResponse:
    """A file of a committed step, CRC-checked and served through the one descriptor it was checked on."""
    root = await tier.ready_root()
    name = check_job(request.match_info["job"])
    number = check_step(request.match_info["step"], in_url=True)
    file_name = check_file_name(request.match_info["name"])
    who = _subject(tier, request)
    record = tier.holdings.records.get((who.owner, name, number))
    if record is None:
        raise TierError(
            404, f"the RAM tier holds no committed step {number} of job {name} of uid {who.owner}"
        )
    if file_name not in record.files:
        raise TierError(404, f"step {number} of job {name} has no file {file_name} on this host")
    fd, size = await asyncio.to_thread(open_checked, root, record, file_name)
    try:
        answer = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
        answer.content_length = size
        await answer.prepare(request)
        offset = 0
        while offset < size:
            chunk = await asyncio.to_thread(os.pread, fd, min(FETCH_CHUNK, size - offset), offset)
            if not chunk:
                break  # shortened after its check: the client sees fewer bytes than Content-Length
            await answer.write(chunk)
            offset += len(chunk)
        await answer.write_eof()
    finally:
        os.close(fd)
    return answer


def job_doc(tier: TierView, root: Root, uid: int, job: str) -> dict[str, Any]:
    return {
        "job": job,
        "uid": uid,
        "path": str(job_dir(root.path, uid, job)),
        "steps": [record.to_json() for record in tier.holdings.steps_of(uid, job)],
    }
