"""`preemptd watch` against a real agent: every event kind (snapshot, notice, update, ready, cleared) in lines
that fit 80 columns, READY as a sentence, --json with the full objects, and a wrong socket said at once
unless --wait asks to wait for the agent."""

from __future__ import annotations

import asyncio
import json
import os
import pty
import re
import sys
import unicodedata
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from agent.cli.render import countdown, format_event
from agent.core.notice import Kind, Observation
from agent.service.daemon import Agent
from tests.support import REPO, cli, eventually, http_json, running_agent

# Long enough to need wrapping at 80 columns, as cloud and operator reasons often are.
REASON = (
    "Spot instance interruption: the capacity pool for p5.48xlarge in us-east-1b is being reclaimed "
    "and this instance will be stopped; save now"
)
PARTICIPANT = {"job": "llm-pretraining-70b", "rank": 0, "participant": True}
EVENT_KINDS = ["snapshot", "notice", "update", "ready", "cleared"]


async def every_kind(agent: Agent, watch_args: tuple[str, ...]) -> tuple[int, str, str]:
    """Run `preemptd watch --count 5 ARGS` while the agent publishes one event of every kind: a snapshot
    holding a maintenance notice, a drill (notice), the maintenance moved (update), the drill's participant
    saved (ready), the drill cleared (cleared)."""
    sock = agent.config.socket
    status, _ = await http_json(
        sock, "POST", "/v1/reports", {"kind": "checkpoint", "phase": "started", "client": PARTICIPANT}
    )
    assert status < 300
    maintenance = Observation(
        key="maintenance-1",
        kind=Kind.MAINTENANCE,
        reason=REASON,
        deadline=agent.now() + timedelta(days=3),
    )
    agent.inject("gcp", maintenance)
    watch = asyncio.ensure_future(cli("watch", "--count", "5", *watch_args, socket=sock))
    await eventually(lambda: len(agent.hub) == 1, timeout=20, what="watch subscribed")
    _, body = await http_json(
        sock, "POST", "/v1/drills", {"kind": "termination", "in_s": 120, "reason": REASON}
    )
    drill_id = body["notice"]["id"]
    agent.inject("gcp", Observation(**{**vars(maintenance), "deadline": agent.now() + timedelta(days=4)}))
    saved = {
        "kind": "checkpoint",
        "phase": "finished",
        "duration_s": 2.5,
        "emergency": True,
        "notice_id": drill_id,
        "client": PARTICIPANT,
    }
    status, _ = await http_json(sock, "POST", "/v1/reports", saved)
    assert status < 300
    status, _ = await http_json(sock, "DELETE", f"/v1/drills/{drill_id}")
    assert status < 300
    return await watch


async def test_every_watch_line_fits_80_columns_for_every_event_kind(base: Path) -> None:
    async with running_agent(base) as agent:
        code, out, err = await every_kind(agent, ())
    headlines = [line.split()[1] for line in out.splitlines() if not line.startswith(" ")]
    assert (0, [k.upper() for k in EVENT_KINDS]) == (code, headlines), err
    assert [] == [line for line in out.splitlines() if len(line) > 80]


async def test_watch_says_ready_as_a_sentence_of_who_saved_how_fast_and_how_much_was_left(base: Path) -> None:
    async with running_agent(base) as agent:
        _, out, _ = await every_kind(agent, ())
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[1:2] == ["READY"])
    end = next(i for i in range(start + 1, len(lines)) if not lines[i].startswith(" "))
    sentence = " ".join(
        line.split(None, 2)[-1] if i == start else line.strip()
        for i, line in enumerate(lines[start:end], start)
    )
    assert sentence.startswith("termination drill-")
    assert ": the one participant saved (llm-pretraining-70b#0) " in sentence
    assert re.search(r"\) (\d+ ms|[\d.]+s) after the notice, with \dm\d\ds to spare\.$", sentence), sentence


async def test_watch_json_keeps_the_full_event_objects(base: Path) -> None:
    async with running_agent(base) as agent:
        code, out, _ = await every_kind(agent, ("--json",))
    events: list[dict[str, Any]] = [json.loads(line) for line in out.splitlines()]
    ready = events[3]
    assert (0, EVENT_KINDS) == (code, [e["type"] for e in events])
    assert (REASON, ["llm-pretraining-70b#0"], "all_participants") == (
        ready["notice"]["reason"],
        ready["data"]["finished"],
        ready["data"]["reason"],
    )
    assert {"margin_s", "notice_to_ready_s", "participants", "missing", "failed"} <= set(ready["data"])


async def test_watch_without_an_agent_says_where_it_looked_and_exits_69(base: Path) -> None:
    sock = base / "nobody.sock"
    code, out, err = await cli("watch", socket=sock)
    assert (69, "") == (code, out)
    said = " ".join(err.split())  # wrapped at 80 columns
    assert f"preemptd: no agent at {sock}: No such file or directory. Is the agent running?" in said


async def test_watch_wait_waits_for_the_agent_to_appear(base: Path) -> None:
    """With --wait, watch says it is waiting, then shows the snapshot of the agent started after it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREEMPTD_")}
    env.update(PYTHONPATH=str(REPO), PREEMPTD_SOCKET=str(base / "a.sock"))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "agent", "watch", "--wait", "--count", "1",
        env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdout is not None
    try:
        waiting = (await asyncio.wait_for(proc.stdout.readline(), 30)).decode()
        async with running_agent(base):
            rest, _ = await asyncio.wait_for(proc.communicate(), 30)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert waiting.startswith(f"(waiting for the agent: no agent at {base / 'a.sock'}")
    assert (0, "SNAPSHOT no active notices") == (
        proc.returncode,
        rest.decode().splitlines()[-1].split(None, 1)[1],
    )


# The pure formatting, for what a real agent does not easily produce on demand.
NOW = datetime(2026, 12, 2, 12, 0, tzinfo=timezone.utc)


def notice(number: int, **fields: Any) -> dict[str, Any]:
    deadline = (NOW + timedelta(minutes=number + 1)).isoformat()
    return {
        "id": f"gcp-{number:016x}",
        "kind": "host_degraded",
        "severity": "critical",
        "source": "alibaba",
        "deadline": deadline,
        "reason": REASON,
        "drill": True,
        **fields,
    }


def test_ready_after_the_grace_names_who_saved_failed_and_is_missing() -> None:
    data = {
        "reason": "grace",
        "participants": [f"llm#{rank}" for rank in range(6)],
        "finished": ["llm#0", "llm#1", "llm#2", "llm#4"],
        "failed": ["llm#3"],
        "missing": ["llm#5"],
        "notice_to_ready_s": 115.0,
        "margin_s": 3.2,
    }
    text = format_event({"type": "ready", "notice": notice(1), "data": data}, NOW)
    sentence = " ".join(line.strip() for line in text.splitlines()).split(None, 2)[2]
    assert (
        "host_degraded gcp-0000000000000001: the grace ran out 1m55s after the notice, with 3.2s to spare: "
        "4 of 6 participants saved (llm#0, llm#1, llm#2 and 1 more); failed: llm#3; missing: llm#5."
    ) == sentence


def test_a_snapshot_of_many_notices_lists_ten_and_fits_80_columns() -> None:
    text = format_event({"type": "snapshot", "notices": [notice(n) for n in range(25)]}, NOW)
    lines = text.splitlines()
    assert ("25 active notices", "... and 15 more (preemptd status lists them)") == (
        lines[0].split(None, 2)[2],
        lines[-1].strip(),
    )
    assert [] == [line for line in lines if len(line) > 80]


def test_the_live_countdown_never_wraps() -> None:
    """The countdown line is rewritten in place with a carriage return, so it must stay on one line."""
    line = countdown({str(n): notice(n) for n in range(12)}, width=80)
    assert (True, True) == (len(line) < 80, line.startswith("  >> host_degraded: "))


def columns(line: str) -> int:
    """What a terminal gives the line: two columns for each wide (East Asian) character."""
    return sum(2 if unicodedata.east_asian_width(c) in "WF" else 1 for c in line)


def test_a_reason_in_wide_characters_fits_80_columns() -> None:
    """Alibaba and Tencent may describe an event in Chinese: each character takes two columns."""
    reason = "实例将因系统维护而重启\uff0c请在截止时间之前保存检查点并停止训练任务\u3002" * 3
    text = format_event({"type": "notice", "notice": notice(1, reason=reason)}, NOW)
    assert [] == [line for line in text.splitlines() if columns(line) > 80]


async def test_on_a_terminal_the_countdown_and_every_line_fit_80_columns(base: Path) -> None:
    """On a terminal watch redraws a countdown line under the events; no line, drawn or redrawn, passes 80."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREEMPTD_")}
    env.update(PYTHONPATH=str(REPO), PREEMPTD_SOCKET=str(base / "a.sock"), COLUMNS="80")
    controller, terminal = pty.openpty()
    try:
        async with running_agent(base) as agent:
            for kind in (Kind.TERMINATION, Kind.MAINTENANCE, Kind.GPU_DEGRADED, Kind.REBALANCE):
                agent.drills.drill(kind, 6000, None, REASON, {})
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "agent", "watch", "--count", "1",
                env=env, stdin=terminal, stdout=terminal, stderr=terminal,
            )  # fmt: skip
            os.close(terminal)
            terminal = -1
            shown = await asyncio.to_thread(read_all, controller)
            code = await asyncio.wait_for(proc.wait(), 30)
    finally:
        os.close(controller)
        if terminal >= 0:
            os.close(terminal)
    drawn = [line.replace("\x1b[K", "") for line in re.split(r"[\r\n]+", shown.decode())]
    assert (0, True) == (code, any(line.startswith("  >> termination: ") for line in drawn))
    assert [] == [line for line in drawn if len(line) > 80]


def read_all(fd: int) -> bytes:
    """Everything a terminal's controller side receives until the last program on it closes it."""
    chunks = []
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # EIO: the other side is closed
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)


async def test_watch_shows_an_elastic_jobs_reform_as_it_happens_but_not_the_ones_before(base: Path) -> None:
    """A membership report (the ranks re-formed at another world size) reaches `preemptd watch` as a line of
    its own ("job llm: shrank 3→2 in 0.47 s at step 1234"; --json: type membership); a re-form the agent had
    before watch started is not repeated."""
    reform = {
        "kind": "membership",
        "phase": "reformed",
        "step": 1234,
        "client": {"job": "llm", "rank": 0},
        "membership": {"world_size": 2, "previous_world_size": 3, "seconds": 0.47},
    }
    async with running_agent(base) as agent:
        sock = agent.config.socket
        status, _ = await http_json(sock, "POST", "/v1/reports", {**reform, "step": 1000})
        assert status < 300
        env = {k: v for k, v in os.environ.items() if not k.startswith("PREEMPTD_")}
        argv = [sys.executable, "-m", "agent", "watch", "--json", "--socket", str(sock)]
        env["PYTHONPATH"] = str(REPO)
        proc = await asyncio.create_subprocess_exec(*argv, env=env, stdout=asyncio.subprocess.PIPE)
        try:
            assert proc.stdout is not None
            first = json.loads(await asyncio.wait_for(proc.stdout.readline(), 30))
            assert first["type"] == "snapshot"
            status, _ = await http_json(sock, "POST", "/v1/reports", reform)
            assert status < 300
            shown = json.loads(await asyncio.wait_for(proc.stdout.readline(), 30))
        finally:
            proc.terminate()
            await proc.wait()
    assert ("membership", "llm", 1234) == (shown["type"], shown["job"], shown["step"])
    assert "shrank 3→2 in 0.47 s at step 1234" == shown["what"]
    line = format_event(shown, now=datetime(2026, 12, 6, 18, 0, tzinfo=timezone.utc))
    assert line.endswith("MEMBERSHIP job llm: shrank 3→2 in 0.47 s at step 1234"), line
    assert all(len(part) <= 80 for part in line.splitlines())
