"""The ledger's tests' shared parts: a scripted week of jobs, notices and checkpoints, and its report from a
real agent."""

from __future__ import annotations

import argparse
import asyncio
import io
import json
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from agent.cli.report import register, run
from agent.service.daemon import Agent
from tests.support import agent_config, http_json

T0 = datetime(2026, 11, 2, tzinfo=timezone.utc)


class Week:
    """One agent at a time on one state directory, its clock set by the script."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.clock = [T0]
        self.agent: Agent | None = None

    def at(self, hours: float) -> None:
        self.clock[0] = T0 + timedelta(hours=hours)

    async def start(self) -> None:
        self.agent = Agent(agent_config(self.base), clock=lambda: self.clock[0])
        await self.agent.start()

    async def stop(self) -> None:
        assert self.agent is not None
        await self.agent.stop()
        self.agent = None

    @property
    def socket(self) -> Path:
        return self.base / "a.sock"

    async def post(self, body: dict[str, Any]) -> None:
        status, answer = await http_json(self.socket, "POST", "/v1/reports", body)
        assert status == 202, answer

    async def register(self, job: str, pid: int, rank: int | None = None, gpus: int | None = None) -> None:
        client: dict[str, Any] = {"job": job, "pid": pid, "participant": True}
        if rank is not None:
            client["rank"] = rank
        if gpus is not None:
            client["gpus"] = gpus
        await self.post({"kind": "participant", "phase": "registered", "client": client})

    async def checkpoint(
        self,
        job: str,
        pid: int,
        step: int,
        duration_s: float,
        size: int,
        rank: int | None = None,
        **extra: Any,
    ) -> None:
        client: dict[str, Any] = {"job": job, "pid": pid}
        if rank is not None:
            client["rank"] = rank
        body = {
            "kind": "checkpoint",
            "phase": "finished",
            "step": step,
            "duration_s": duration_s,
            "bytes": size,
        }
        await self.post({**body, **extra, "client": client})

    async def drill(self, in_s: float) -> str:
        status, answer = await http_json(
            self.socket, "POST", "/v1/drills", {"kind": "termination", "in_s": in_s}
        )
        assert status == 201, answer
        return str(answer["notice"]["id"])


async def report(socket: Path, *flags: str) -> dict[str, Any]:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["report", "--json", "--socket", str(socket), *flags])
    out, err = io.StringIO(), io.StringIO()
    code = await asyncio.to_thread(run, args, out, err)
    assert code == 0, err.getvalue()
    doc: dict[str, Any] = json.loads(out.getvalue())
    return doc
