"""Membership reports (a job that shrank, a host that left it) against a real agent: the ``jobs`` status section,
``preemptd status``'s line, the journal line, and what a malformed one gets."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from structlog.testing import capture_logs

from agent.cli.render import format_status
from agent.service.journal import sentence
from tests.support import http_json, running_agent


def _report(phase: str = "reformed", **membership: Any) -> dict[str, Any]:
    return {
        "kind": "membership",
        "phase": phase,
        "step": 1234,
        "client": {"job": "llm", "rank": 0, "world_size": 2},
        "membership": {
            "world_size": 2,
            "previous_world_size": 3,
            "nodes": 2,
            "previous_nodes": 3,
            "seconds": 0.47,
            "reason": "1 node(s) left with the notice",
            **membership,
        },
    }


async def test_a_shrink_report_shows_in_status_and_the_journal(base: Path) -> None:
    with capture_logs() as logs:
        async with running_agent(base) as agent:
            status, _ = await http_json(agent.config.socket, "POST", "/v1/reports", _report())
            _, doc = await http_json(agent.config.socket, "GET", "/v1/status")
    assert 202 == status
    job = doc["jobs"]["llm"]
    assert (2, "reformed", "shrank 3→2 in 0.47 s at step 1234") == (
        job["world_size"],
        job["last"],
        job["history"][-1]["what"],
    )
    assert "Job llm: world size 2; shrank 3→2 in 0.47 s at step 1234" in format_status(doc).splitlines()
    lines = [e for e in logs if e["event"] == "job_membership"]
    assert [("llm", "reformed")] == [(e["job"], e["phase"]) for e in lines]
    assert "Job llm: shrank 3→2 in 0.47 s at step 1234" == sentence("job_membership", lines[0])


async def test_membership_reports_are_kept_per_job_bounded_and_logged_at_a_bounded_rate(base: Path) -> None:
    with capture_logs() as logs:
        async with running_agent(base) as agent:
            for _ in range(50):
                await http_json(agent.config.socket, "POST", "/v1/reports", _report("left"))
            _, doc = await http_json(agent.config.socket, "GET", "/v1/status")
    history = doc["jobs"]["llm"]["history"]
    assert 5 == len(history)
    assert "this host left (3→2) at step 1234" == history[-1]["what"]
    assert len([e for e in logs if e["event"] == "job_membership"]) <= 10


async def test_a_membership_report_without_its_world_size_or_with_a_bad_value_is_a_400(base: Path) -> None:
    bad = _report()
    del bad["membership"]["world_size"]
    async with running_agent(base) as agent:
        missing = await http_json(agent.config.socket, "POST", "/v1/reports", bad)
        wrong = await http_json(agent.config.socket, "POST", "/v1/reports", _report(seconds="soon"))
        phase = await http_json(agent.config.socket, "POST", "/v1/reports", _report("exploded"))
    assert 400 == missing[0] and "membership.world_size" in str(missing[1])
    assert 400 == wrong[0] and "membership.seconds" in str(wrong[1])
    assert 400 == phase[0] and "'reformed', 'left', 'stopped'" in str(phase[1])
