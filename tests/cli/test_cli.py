"""The preemptd command against a real agent: status, watch, drill, version (the demo: test_demo.py)."""

from __future__ import annotations

import argparse
import asyncio
import json
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from agent.cli import build_parser, main
from agent.cli.render import format_event, format_status
from agent.core.notice import Kind
from tests.support import cli, eventually, running_agent


async def test_version_prints_the_version() -> None:
    from agent import __version__

    code, out, _ = await cli("version")
    assert (0, f"preemptd {__version__}") == (code, out.split(" (")[0])


async def test_status_json_is_the_raw_document_and_exit_status_follows_overall(base: Path) -> None:
    async with running_agent(base) as agent:
        code_ok, out_ok, _ = await cli("status", "--json", socket=agent.config.socket)
        agent.drills.drill(Kind.TERMINATION, 60, None, "drill", {})
        code_bad, out_bad, _ = await cli("status", socket=agent.config.socket)
    assert (0, "ok") == (code_ok, json.loads(out_ok)["overall"])
    assert 1 == code_bad
    assert "overall: CRITICAL" in out_bad
    assert "termination" in out_bad


async def test_status_without_an_agent_says_so(base: Path) -> None:
    code, _, err = await cli("status", socket=base / "nobody.sock")
    assert 69 == code
    assert "Is the agent running?" in err


async def test_drill_then_watch_json_streams_snapshot_and_notice(base: Path) -> None:
    async with running_agent(base) as agent:
        watch = asyncio.ensure_future(cli("watch", "--json", "--count", "2", socket=agent.config.socket))
        await eventually(lambda: len(agent.hub) == 1, timeout=20, what="watch subscribed")
        code, out, _ = await cli("drill", "--in", "90s", "--kind", "maintenance", socket=agent.config.socket)
        watch_code, watch_out, _ = await watch
    events = [json.loads(line) for line in watch_out.splitlines()]
    assert (0, 0) == (code, watch_code)
    assert ["snapshot", "notice"] == [e["type"] for e in events]
    assert ("maintenance", True) == (events[1]["notice"]["kind"], events[1]["notice"]["drill"])
    assert out.startswith("drill drill-")


async def test_drill_with_a_bad_duration_is_a_usage_error() -> None:
    code, _, err = await cli("drill", "--in", "soon")
    assert 2 == code
    assert "expected a duration" in err


async def test_run_with_a_broken_config_file_names_the_file_and_key(base: Path) -> None:
    bad = base / "config.toml"
    bad.write_text("[api]\nqueue_size = 'big'\n")
    code, _, err = await cli("run", "--config", str(bad), "--socket", str(base / "a.sock"))
    assert 2 == code
    assert f"{bad}: key 'api.queue_size': expected an integer" in err


async def test_print_config_shows_the_effective_configuration(base: Path) -> None:
    code, out, _ = await cli("run", "--print-config", "--cloud", "none", "--set", "api.heartbeat_s=3")
    doc = json.loads(out)
    assert (0, "none", 3.0) == (code, doc["cloud"], doc["api"]["heartbeat_s"])


def test_format_event_shows_kind_time_left_id_and_reason() -> None:
    now = datetime(2026, 12, 2, 12, 0, tzinfo=timezone.utc)
    deadline = (now + timedelta(seconds=90)).isoformat().replace("+00:00", "Z")
    doc = {
        "type": "notice",
        "notice": {
            "id": "aws-1",
            "kind": "termination",
            "severity": "critical",
            "source": "aws",
            "reason": "spot",
            "deadline": deadline,
        },
    }
    headline, body = format_event(doc, now).splitlines()
    assert ("NOTICE   termination critical from aws: 1m30s left", "aws-1: spot") == (
        headline[len("HH:MM:SS ") :].split(" (")[0],
        body.strip(),
    )


def test_format_status_lists_notices_and_sources() -> None:
    doc = {
        "agent": {
            "version": "1",
            "socket": "/s",
            "cloud": "aws",
            "instance": {"instance_id": "i-1"},
            "uptime_s": 5,
        },
        "overall": "warning",
        "notices": [],
        "sources": {"aws": {"state": "degraded", "last_error": "timeout", "detail": {}}},
        "subscribers": {"connected": 2},
        "state": {"ok": True},
    }
    text = format_status(doc)
    assert "overall: WARNING" in text and "instance i-1" in text and "last error: timeout" in text


def duration_flags() -> list[tuple[str, str]]:
    """(verb, flag) for every flag of every verb that takes a DURATION (the shared parser's metavar)."""
    (verbs,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return [
        (verb, action.option_strings[-1])
        for verb, parser in verbs.choices.items()
        for action in parser._actions
        if action.metavar == "DURATION"
    ]


def test_the_duration_flags_are_found() -> None:
    """The list the next test runs over holds the flags of report, advise, drill and demo."""
    assert {
        ("report", "--since"),
        ("advise", "--save-time"),
        ("advise", "--mtbp"),
        ("advise", "--current"),
        ("drill", "--in"),
        ("demo", "--lead"),
    } <= set(duration_flags())


@pytest.mark.parametrize(("verb", "flag"), duration_flags())
def test_a_duration_past_100_years_is_a_usage_error_naming_the_flag_and_range(
    verb: str, flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A duration that would overflow date arithmetic (99999999999d) is refused before the verb runs."""
    with pytest.raises(SystemExit) as exited:
        main([verb, flag, "99999999999d"])
    assert (
        2,
        f"argument {flag}: expected a duration from 0s to 36500d (100 years), got '99999999999d'",
    ) == (exited.value.code, capsys.readouterr().err.strip().splitlines()[-1].split("error: ", 1)[1])


async def test_report_since_past_100_years_exits_2_without_a_traceback(base: Path) -> None:
    """`preemptd report --since 99999999999d` (once an OverflowError traceback, exit 1)."""
    code, out, err = await cli("report", "--since", "99999999999d", socket=base / "nobody.sock")
    assert (2, "", "argument --since: expected a duration from 0s to 36500d (100 years)") == (
        code,
        out,
        err.strip().splitlines()[-1].split("error: ", 1)[1].split(", got")[0],
    )


async def test_report_since_100_years_reads_the_ledger_file(base: Path) -> None:
    """The longest --since there is (36500d) reaches back to 100 years ago from the ledger file."""
    from agent.ledger import store

    (base / "state").mkdir()
    store.connect(base / "state" / "ledger.sqlite").close()
    config = base / "config.toml"
    config.write_text(f'state_dir = "{base / "state"}"\n')
    code, out, err = await cli(
        "report", "--since", "36500d", "--json", "--config", str(config), socket=base / "nobody.sock"
    )
    since = datetime.fromisoformat(json.loads(out)["since"].replace("Z", "+00:00")) if code == 0 else None
    assert (0, 100) == (code, since and round((datetime.now(timezone.utc) - since).days / 365)), err
