"""Peer snapshots in the ledger (agent/ledger/snapshots.py, docs/ledger.md "Snapshots"): snapshot reports and
durable checkpoints posted to a real agent over its socket, an unannounced interruption (new processes for
the job's ranks without a notice), and `preemptd report` saying what the snapshots cost and saved against
durable checkpoints alone, in its JSON, its text and its HTML."""

from __future__ import annotations

import argparse
import asyncio
import io
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

from agent.cli.report import register, render_html, run
from agent.core.screen import columns
from agent.ledger.facts import Facts, ReportFact
from agent.ledger.report import build_report
from agent.ledger.snapshots import Snapshots, snapshot_figures
from tests.ledger.support import T0, Week, report
from tests.support import short_tmp

H = 3600.0
GB = 10**9
RANKS = ((0, "a"), (1, "b"))  # each job: two ranks on one GPU each; (rank, suffix of the pid)


@pytest.fixture
def base() -> Path:
    return short_tmp("pd-snaps-")


def at_s(week: Week, seconds: float) -> None:
    week.clock[0] = T0 + timedelta(seconds=seconds)


def pid(first: int, rank: int) -> int:
    return first + rank


async def snapshot(
    week: Week,
    job: str,
    first: int,
    step: int,
    phase: str = "finished",
    size: int | None = None,
) -> None:
    """Both ranks' snapshot report of ``step``, as agent/client/peer/snapshot.py posts it: a stall of 0.5 s
    and committed on the peers 2 s after it started when finished; nothing timed when started or failed."""
    for rank, _ in RANKS:
        body: dict[str, Any] = {
            "kind": "checkpoint",
            "phase": phase,
            "emergency": False,
            "step": step,
            "flush": {"sharded": True, "world_size": 2, "tier": "snapshot"},
            "client": {"job": job, "pid": pid(first, rank), "rank": rank},
        }
        if phase == "finished":
            body["duration_s"] = 0.5
            body["flush"]["complete_s"] = 2.0
            if size is not None:
                body["bytes"] = size
        await week.post(body)


async def durable(week: Week, job: str, first: int, step: int) -> None:
    """Both ranks' periodic durable checkpoint of ``step``: 60 s, 1 GB each."""
    for rank, _ in RANKS:
        await week.checkpoint(job, pid(first, rank), step, 60.0, GB, rank)


async def relaunch(week: Week, job: str, first: int) -> None:
    """The job's processes come back with new pids, no notice: an unannounced interruption."""
    for rank, _ in RANKS:
        await week.register(job, pid(first, rank), rank)


async def scenario(week: Week) -> None:
    """Seconds from T0. Job S: durable steps 50 (1800) and 100 (3600); snapshots 120 (4200) and 140 (4800),
    0.5 GB per rank; the snapshot of 160 fails (5400); its processes die and come back at 6000 without a
    notice (resuming from 140); a snapshot of 180 at 7200 in the new processes. Job D: durable step 10
    (3600), no snapshot, back unannounced at 5000. Job L: durable step 100 (3600), the snapshot of 140
    started at 5990, back unannounced at 6000, the snapshot's commit reported at 6010 by the old processes:
    after the stop. Job F: durable step 100 (3600), the snapshot of 140 fails at 4800, back at 6000."""
    for job, first in (("S", 100), ("D", 300), ("L", 500), ("F", 700)):
        at_s(week, 0)
        await relaunch(week, job, first)
    at_s(week, 1800)
    await durable(week, "S", 100, 50)
    at_s(week, H)
    for job, first, step in (("S", 100, 100), ("D", 300, 10), ("L", 500, 100), ("F", 700, 100)):
        await durable(week, job, first, step)
    at_s(week, 4200)
    await snapshot(week, "S", 100, 120, size=GB // 2)
    at_s(week, 4800)
    await snapshot(week, "S", 100, 140, size=GB // 2)
    await snapshot(week, "F", 700, 140, "failed")
    at_s(week, 5000)
    await relaunch(week, "D", 400)
    at_s(week, 5400)
    await snapshot(week, "S", 100, 160, "failed")
    at_s(week, 5990)
    await snapshot(week, "L", 500, 140, "started")
    at_s(week, 6000)
    for job, first in (("S", 200), ("L", 600), ("F", 800)):
        await relaunch(week, job, first)
    at_s(week, 6010)
    await snapshot(week, "L", 500, 140)
    at_s(week, 7200)
    await snapshot(week, "S", 200, 180, size=GB // 2)
    at_s(week, 8000)


async def text(socket: Path, *flags: str) -> str:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["report", "--socket", str(socket), "--since", "30d", *flags])
    out, err = io.StringIO(), io.StringIO()
    code = await asyncio.to_thread(run, args, out, err)
    assert code == 0, err.getvalue()
    return out.getvalue()


async def reported(base: Path) -> tuple[dict[str, Any], str]:
    week = Week(base)
    await week.start()
    try:
        await scenario(week)
        return await report(week.socket, "--since", "30d"), await text(week.socket)
    finally:
        await week.stop()


def said(shown: str) -> str:
    return " ".join(shown.split())


def job_text(shown: str, job: str) -> str:
    """The lines of one job in the text report."""
    part = shown.split(f"\nJob {job}\n")[1]
    return part.split("\nJob ")[0]


async def test_what_snapshots_saved_against_durable_checkpoints_alone(base: Path) -> None:
    """Job S resumed from the snapshot of 140 (state at 4798.5 s: committed at 4800, 2 s after it started,
    after a 0.5 s stall) at 6000: 20 steps (160 reported) and 1201.5 s x 2 GPUs redone; from the durable
    step 100 (3600) it would have redone 60 steps and 2400 s: 40 steps and (2400 - 1201.5) x 2 / 3600 GPU-h
    saved. Three snapshots taken (0.5 s x 2 GPUs each), the failed one counted as failed; the interval is
    of the two snapshots of the first processes only (20 steps, 600 s); the durable one 50 steps, 1800 s."""
    doc, shown = await reported(base)
    job = doc["jobs"]["S"]
    assert job["snapshots"] == {
        "taken": 3,
        "failed": 1,
        "stall_gpu_hours": round(3 * 0.5 * 2 / H, 6),
        "complete_s_median": 2.0,
        "bytes": 3 * 2 * GB // 2,
        "bytes_reported": 3,
        "interval": {"steps": 20.0, "seconds": 600.0, "pairs": 1},
        "durable_interval": {"steps": 50.0, "seconds": 1800.0, "pairs": 1},
        "interruptions": 1,
        "resumed_from_snapshot": 1,
        "saved_steps": 40,
        "saved_gpu_hours": round((2400 - 1201.5) * 2 / H, 6),
    }
    # The ledger's own redone work already counts from the snapshot (of its state, not its commit).
    assert (job["interruptions"]["unannounced"], job["steps_redone"], job["redone_gpu_hours"]) == (
        1,
        20,
        round(1201.5 * 2 / H, 4),
    )
    lines = said(job_text(shown, "S"))
    assert "snapshots 3 taken, 1 failed; stall 0.000833 GPU-h; committed in 2.0s (median); 3.0 GB" in lines
    assert "checkpoint intervals snapshots every 20 steps (10m00s), durable every 50 steps (30m00s)" in lines
    assert (
        "snapshots saved 40 steps (0.666 GPU-h) over 1 unannounced interruption against durable checkpoints"
        " alone" in lines
    )
    assert [x for x in shown.splitlines() if columns(x) > 80] == []
    page = render_html(doc)
    assert "<th>snapshots saved</th><td>40 steps (0.666 GPU-h) over 1 unannounced interruption" in page


async def test_the_total_adds_the_jobs_snapshots(base: Path) -> None:
    """The total: S's three snapshots and L's late one taken, S's and F's failures; S's saving only (L's
    snapshot came after its stop, F's failed): over the three unannounced interruptions of the jobs that
    took snapshots (D took none)."""
    doc, shown = await reported(base)
    total = doc["total"]["snapshots"]
    assert (
        total["taken"],
        total["failed"],
        total["interruptions"],
        total["resumed_from_snapshot"],
        total["saved_steps"],
        total["bytes"],
        total["bytes_reported"],
        total["interval"],
    ) == (4, 2, 3, 1, 40, 3 * GB, 3, {"steps": 20.0, "seconds": 600.0, "pairs": 1})
    assert "snapshots saved 40 steps (0.666 GPU-h) over 3 unannounced interruptions" in said(
        shown.split("\nJob ")[0]
    )


async def test_a_job_without_snapshots_is_unchanged(base: Path) -> None:
    """Job D: redone from its durable step 10 (3600) to its resume at 5000, as before; its snapshot figures
    are empty and its text says nothing of snapshots."""
    doc, shown = await reported(base)
    job = doc["jobs"]["D"]
    assert job["snapshots"] == snapshot_figures(Snapshots())
    assert job["snapshots"]["taken"] == 0 and job["snapshots"]["saved_gpu_hours"] == 0.0
    assert (job["checkpoints"], job["steps_redone"], job["redone_gpu_hours"]) == (
        1,
        0,
        round(1400 * 2 / H, 4),
    )
    assert "snapshot" not in job_text(shown, "D")


async def test_a_snapshot_committed_after_the_stop_saves_nothing(base: Path) -> None:
    """Job L: its snapshot of 140 was committed at 6010, after the stop (the resume at 6000): the job came
    back from the durable step 100, 40 steps redone (140 started by the stop), nothing saved; the snapshot
    is counted as taken."""
    doc, shown = await reported(base)
    job = doc["jobs"]["L"]
    figures = job["snapshots"]
    assert (figures["taken"], figures["interruptions"], figures["resumed_from_snapshot"]) == (1, 1, 0)
    assert (figures["saved_steps"], figures["saved_gpu_hours"], job["steps_redone"]) == (0, 0.0, 40)
    assert (figures["bytes"], job["redone_gpu_hours"]) == (None, round(2400 * 2 / H, 4))
    lines = said(job_text(shown, "L"))
    assert "snapshots 1 taken, 0 failed; stall 0.000278 GPU-h; committed in 2.0s (median); bytes not" in lines
    assert "snapshots saved 0 steps (0 GPU-h) over 1 unannounced interruption" in lines


async def test_a_failed_snapshot_is_counted_as_failed_only(base: Path) -> None:
    """Job F: the snapshot of 140 failed: one failure, nothing taken, no stall, nothing to resume from: the
    job redid from its durable step 100, 40 steps (140 reported by the failure) and 2400 s."""
    doc, shown = await reported(base)
    job = doc["jobs"]["F"]
    figures = job["snapshots"]
    assert (figures["taken"], figures["failed"], figures["stall_gpu_hours"]) == (0, 1, 0.0)
    assert (figures["resumed_from_snapshot"], figures["saved_steps"], figures["complete_s_median"]) == (
        0,
        0,
        None,
    )
    assert (job["checkpoints"], job["steps_redone"], job["redone_gpu_hours"]) == (
        1,
        40,
        round(2400 * 2 / H, 4),
    )
    lines = said(job_text(shown, "F"))
    assert "snapshots 0 taken, 1 failed; stall 0 GPU-h; bytes not reported" in lines
    assert "checkpoint intervals snapshots not measured, durable not measured" in lines


def fact(time: float, pid: int, phase: str, step: int | None, **fields: Any) -> ReportFact:
    kind = "participant" if phase == "registered" else "checkpoint"
    row = ReportFact(time, "J", pid, 0, None, kind, phase, step, None, None, False, None, None, None)
    return ReportFact(**{**row.__dict__, **fields})


def test_the_checkpoint_with_the_newest_state_is_the_one_resumed_from() -> None:
    """A durable save of step 150 finished at 4795 while the snapshot of 140 (started 4790, a 0.5 s stall:
    its state is of 4790.5) was still being copied, committed at 4800: the job came back from step 150, the
    newer state, not from the snapshot finished later; 10 steps redone (160 reported), nothing saved."""
    snap = {"tier": "snapshot", "duration_s": 0.5, "complete_s": 10.0}
    rows = (
        fact(0.0, 1, "registered", None),
        fact(1000.0, 1, "finished", 100, duration_s=1.0),
        fact(4795.0, 1, "finished", 150, duration_s=1.0),
        fact(4800.0, 1, "finished", 140, **snap),
        fact(5000.0, 1, "started", 160),
        fact(6000.0, 2, "registered", None),
    )
    doc = build_report(Facts(reports=rows), datetime.fromtimestamp(7000.0, timezone.utc))
    job = doc["jobs"]["J"]
    assert (job["steps_redone"], job["redone_gpu_hours"]) == (10, round(1205 / H, 4))
    assert (job["snapshots"]["taken"], job["snapshots"]["resumed_from_snapshot"]) == (1, 0)
    assert (job["snapshots"]["saved_steps"], job["snapshots"]["saved_gpu_hours"]) == (0, 0.0)
