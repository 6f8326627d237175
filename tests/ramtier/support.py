"""The RAM-tier tests' shared parts: an agent with its tier on in a temporary directory, a step written and
committed as a client does, and requests made as another uid (SO_PEERCRED)."""

from __future__ import annotations

import asyncio
import json
import os
import zlib
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

from agent.ramtier import RamTierComponent
from agent.service.daemon import Agent
from tests.support import agent_config, http_json

JOB = "job-1"
ME = str(os.getuid())  # the tier keeps a job under its uid: <root>/<uid>/<job>


@asynccontextmanager
async def tier_agent(
    base: Path,
    clock: Callable[[], datetime] | None = None,
    agent_settings: Mapping[str, Any] | None = None,
    **settings: Any,
) -> AsyncIterator[tuple[Agent, RamTierComponent]]:
    """A real agent whose RAM tier lives in ``base/ram`` (not /dev/shm), read back before it is used."""
    table = {"enabled": True, "path": str(base / "ram"), "cap_bytes": 1 << 20, **settings}
    config = agent_config(base, {**{f"ram_tier.{k}": v for k, v in table.items()}, **(agent_settings or {})})
    agent = Agent(config, **({"clock": clock} if clock else {}))
    await agent.start()
    try:
        tier = next(c for c in agent.components if isinstance(c, RamTierComponent))
        await asyncio.wait_for(tier.loaded.wait(), 30)
        yield agent, tier
    finally:
        await agent.stop()


def write_step(
    path: Path,
    step: int,
    files: Mapping[str, bytes],
    job: str = JOB,
    sizes: Mapping[str, int] | None = None,
    world_size: int = 1,
) -> None:
    """What a client writes: the files, then ``tier.json`` last (``sizes`` overrides what it says). A file's
    rank is the one DCP names it after (``__<rank>_0.distcp``; 0 for ``.metadata``)."""
    listed = {}
    for name, data in files.items():
        (path / name).write_bytes(data)
        size = (sizes or {}).get(name, len(data))
        rank = int(name[2:].split("_")[0]) if name.startswith("__") else 0
        listed[name] = {"size": size, "crc32": zlib.crc32(data), "rank": rank}
    doc = {
        "job": job,
        "step": step,
        "run": 1,
        "world_size": world_size,
        "files": listed,
        "complete": True,
        "time": "2026-12-03T21:00:00Z",
    }
    (path / "tier.tmp").write_text(json.dumps(doc))
    (path / "tier.tmp").rename(path / "tier.json")


async def put_step(agent: Agent, step: int, files: Mapping[str, bytes], job: str = JOB) -> tuple[int, Any]:
    """Reserve, write and commit one step as a client does; the commit's answer."""
    sock = agent.config.socket
    status, body = await http_json(
        sock,
        "POST",
        f"/v1/ram-tier/jobs/{job}/reserve",
        {"step": step, "bytes": sum(map(len, files.values()))},
    )
    assert 200 == status, body
    write_step(Path(body["path"]), step, files, job)
    return await http_json(
        sock, "POST", f"/v1/ram-tier/jobs/{job}/steps/{step}/commit", {"reservation": body["reservation"]}
    )


@contextmanager
def as_user(uid: int) -> Iterator[None]:
    """This process writes files as ``uid`` (a job's rank would), then is root again."""
    os.setegid(uid)
    os.seteuid(uid)
    try:
        yield
    finally:
        os.seteuid(0)
        os.setegid(0)


def connect_as(path: Path, uid: int) -> Any:
    """SO_PEERCRED records the credentials in effect at connect()."""
    import socket

    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    os.seteuid(uid)
    try:
        sock.connect(str(path))
    finally:
        os.seteuid(0)
    return sock


async def request_as(path: Path, uid: int, method: str, target: str, body: Any = None) -> tuple[int, Any]:
    reader, writer = await asyncio.open_unix_connection(sock=connect_as(path, uid))
    raw = json.dumps(body).encode()
    writer.write(
        f"{method} {target} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: {len(raw)}\r\n\r\n".encode()
        + raw
    )
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    length = int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0])
    answer = json.loads(await reader.readexactly(length))
    writer.close()
    await writer.wait_closed()
    return int(head.split()[1]), answer
