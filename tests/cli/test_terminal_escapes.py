"""What `preemptd status` and `preemptd watch` print cannot drive the terminal: a drill reason with ESC and CR
(any user in the admin group can set one) is shown escaped, through the real CLI against a real agent."""

from __future__ import annotations

import asyncio
from pathlib import Path

from tests.support import cli, eventually, http_json, running_agent

HOSTILE = "flush now\x1b[2J\x1b]0;owned\x07\rOK \u202egnp.exe"


async def test_status_escapes_control_characters_in_a_drill_reason(base: Path) -> None:
    async with running_agent(base) as agent:
        status, _ = await http_json(
            agent.config.socket, "POST", "/v1/drills", {"in_s": 60, "reason": HOSTILE}
        )
        code, out, _ = await cli("status", socket=agent.config.socket)
    assert (201, 1) == (status, code)
    assert [] == [c for c in out if c in "\x1b\r\x07\u202e"]
    assert "flush now\\x1b[2J\\x1b]0;owned\\x07\\x0dOK \\u202egnp.exe" in out


async def test_watch_escapes_control_characters_in_a_drill_reason(base: Path) -> None:
    async with running_agent(base) as agent:
        watch = asyncio.ensure_future(cli("watch", "--count", "2", socket=agent.config.socket))
        await eventually(lambda: len(agent.hub) == 1, timeout=20, what="watch subscribed")
        status, _ = await http_json(
            agent.config.socket, "POST", "/v1/drills", {"in_s": 60, "reason": HOSTILE}
        )
        code, out, _ = await watch
    assert (201, 0) == (status, code)
    assert [] == [c for c in out if c in "\x1b\r\x07\u202e"]
    shown = " ".join(line.strip() for line in out.splitlines()[1:])  # the reason may be wrapped
    assert "flush now\\x1b[2J\\x1b]0;owned\\x07\\x0dOK \\u202egnp.exe" in shown
