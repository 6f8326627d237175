"""The window's tests' shared parts: the clock and notice lead they use, torchrun's path, and a wait for the
agent's window."""

from __future__ import annotations

import asyncio
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from agent.window.effective import (
    Lead,
)
from agent.window.limits import Limit
from tests.support import http_json

NOW = datetime(2026, 12, 4, 12, 0, tzinfo=timezone.utc)


LEAD = Lead("termination", 120.0, "aws: spot", lengthen="cloud fixed")


TORCHRUN = Limit("torchrun", 30.0, "torchrun", lengthen="hold SIGTERM")


async def window_until(sock: Path, predicate: Any, timeout: float = 20.0) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    doc: dict[str, Any] = {}
    while loop.time() < end:
        status, body = await http_json(sock, "GET", "/v1/status")
        assert 200 == status, body
        doc = body["window"]
        if predicate(doc):
            return body
        await asyncio.sleep(0.05)
    raise AssertionError(f"the window never got there: {doc}")
