"""``preemptd demo`` end to end with a short lead time: the agent, the simulated EC2 metadata service and the
example training job on the CPU; the job flushes, exits 75, is restarted and resumes at the next step."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from agent.demo import WIDTH, describe_job
from tests.test_cli import cli

pytest.importorskip("torch")


@pytest.mark.timeout(240)
async def test_demo_flushes_the_job_and_resumes_it(base: Path) -> None:
    code, out, err = await cli(
        "demo", "--after", "1s", "--lead", "12s", "--socket", str(base / "demo.sock"), timeout=230
    )
    assert 0 == code, err
    lines = out.splitlines()
    text = " ".join(out.split())  # sentences wrapped at 80 columns, read as one
    flushed = re.search(r"job flushed step (\d+): [\d.]+ k?B in \d+ ms, [\d.]+s to spare", text)
    resumed = re.search(r"job resumed from the emergency checkpoint: step (\d+) is next", text)
    assert flushed is not None and resumed is not None, out
    assert (flushed.group(1), True, True, True) == (
        resumed.group(1),
        "job exited 75 (preempted): restarting it" in text,
        "READY every job saved its checkpoint (1 of 1)" in text,
        "CLEARED termination from aws" in text,
    ), out
    assert [] == [line for line in lines if len(line) > WIDTH]
    assert "{" not in out  # sentences, not JSON


@pytest.mark.parametrize(
    ("doc", "text"),
    [
        (
            {
                "event": "checkpoint",
                "emergency": True,
                "step": 39,
                "bytes": 12345,
                "seconds": 0.031,
                "time_left": 7.8,
            },
            "flushed step 39: 12.3 kB in 31 ms, 7.8s to spare",
        ),
        (
            {"event": "resumed", "step": 39, "next_step": 39},
            "resumed from the emergency checkpoint: step 39 is next",
        ),
        ({"event": "done"}, None),
    ],
)
def test_job_lines_read_as_sentences(doc: dict[str, object], text: str | None) -> None:
    assert text == describe_job(doc)
