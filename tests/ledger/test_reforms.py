"""An elastic job's re-forms in the ledger (agent/ledger/reforms.py, docs/ledger.md "Re-forms (elastic
jobs)"): membership reports posted to a real agent over its socket are kept in the SQLite file (across a
restart, and in a file an older agent wrote), and `preemptd report` says what shrinking saved against the
job's own measured relaunch on this host, or that none was measured."""

from __future__ import annotations

import argparse
import asyncio
import io
import sqlite3
from dataclasses import replace
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

from agent.cli.report import register, render_html, render_text, run
from agent.core.screen import columns
from agent.ledger import store
from agent.ledger.facts import Facts, NoticeFact, ReportFact
from agent.ledger.reforms import reforms
from agent.ledger.report import build_report
from agent.ledger.tally import Rules, timeline
from tests.ledger.support import T0, Week, report
from tests.support import http_json, short_tmp

H = 3600.0
# The schema of the ledger before membership reports were kept (agent/ledger/store.py as of eb436da).
OLD_SCHEMA = """
CREATE TABLE IF NOT EXISTS notices (
    id TEXT PRIMARY KEY, kind TEXT NOT NULL, source TEXT NOT NULL, severity TEXT NOT NULL,
    drill INTEGER NOT NULL, detected_at REAL NOT NULL, deadline REAL, cleared_at REAL, time REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS reports (
    seq INTEGER PRIMARY KEY, time REAL NOT NULL, job TEXT NOT NULL, pid INTEGER, rank INTEGER,
    gpus INTEGER, kind TEXT NOT NULL, phase TEXT NOT NULL, step INTEGER, duration_s REAL, bytes INTEGER,
    emergency INTEGER NOT NULL, notice_id TEXT, tier TEXT, fallback_step INTEGER
);
CREATE INDEX IF NOT EXISTS reports_time ON reports (time);
CREATE INDEX IF NOT EXISTS notices_time ON notices (time);
"""


@pytest.fixture
def base() -> Path:
    return short_tmp("pd-reforms-")


def at_s(week: Week, seconds: float) -> None:
    week.clock[0] = T0 + timedelta(seconds=seconds)


async def membership(
    week: Week,
    phase: str,
    pid: int,
    rank: int,
    step: int | None,
    sizes: tuple[int, int],
    seconds: float,
    reason: str = "1 node(s) left with the notice",
    job: str = "E",
) -> None:
    """One node's membership report, as agent/client/elastic.py posts it: ``sizes`` = (before, after)."""
    before, after = sizes
    body: dict[str, Any] = {
        "kind": "membership",
        "phase": phase,
        "step": step,
        "client": {"job": job, "pid": pid, "rank": rank, "world_size": after},
        "membership": {
            "world_size": after,
            "previous_world_size": before,
            "nodes": after // 2,
            "previous_nodes": before // 2,
            "seconds": seconds,
            "reason": reason,
        },
    }
    await week.post(body)


async def text(socket: Path, *flags: str) -> str:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["report", "--socket", str(socket), "--since", "30d", *flags])
    out, err = io.StringIO(), io.StringIO()
    code = await asyncio.to_thread(run, args, out, err)
    assert code == 0, err.getvalue()
    return out.getvalue()


def said(shown: str) -> str:
    """The report's text with its wrapping undone (words joined by single spaces)."""
    return " ".join(shown.split())


async def relaunch_then_shrink(week: Week) -> str:
    """Job E, two ranks on one GPU each on this host (ranks 2 and 3 of a 4-rank job on two hosts). A drill
    at 1 h (deadline 2 min later): both ranks flush step 100, finished at 1 h 00:30; the job is relaunched
    here, its new processes registering at 1 h 00:35.6 (a relaunch of 5.6 s). It then shrinks twice when
    the other host leaves: at 2 h (0.47 s, step 500) and at 3 h (0.63 s, step 900), re-numbered ranks 0
    and 1 in the same processes. The report is made at 4 h."""
    at_s(week, 0)
    await week.register("E", 100, 2)
    await week.register("E", 101, 3)
    at_s(week, H)
    n1 = await week.drill(120)
    at_s(week, H + 30)
    for pid, rank in ((100, 2), (101, 3)):
        await week.checkpoint("E", pid, 100, 20.0, 10**9, rank, emergency=True, notice_id=n1)
    at_s(week, H + 35.6)
    await week.register("E", 200, 2)
    await week.register("E", 201, 3)
    at_s(week, 2 * H)
    await membership(week, "reformed", 200, 0, 500, (4, 2), 0.47)
    at_s(week, 3 * H)
    await membership(week, "reformed", 200, 0, 900, (4, 2), 0.63)
    for pid, rank in ((200, 0), (201, 1)):
        await week.checkpoint("E", pid, 900, 30.0, 10**9, rank)
    at_s(week, 4 * H)
    return n1


async def test_a_measured_relaunch_gives_what_shrinking_saved(base: Path) -> None:
    """Two re-forms of 0.47 s and 0.63 s on 2 GPUs against the job's 5.6 s relaunch here (a counted drill):
    2.2 GPU-s halted, (5.6 - 0.47 + 5.6 - 0.63) x 2 / 3600 = 0.005611 GPU-h saved; the renumbered ranks
    add no GPU."""
    week = Week(base)
    await week.start()
    try:
        await relaunch_then_shrink(week)
        doc = await report(week.socket, "--drills", "--since", "30d")
        shown = await text(week.socket, "--drills")
    finally:
        await week.stop()
    job = doc["jobs"]["E"]
    assert (2, 1, job["reforms"]) == (
        job["gpus"],
        job["interruptions"]["announced"],
        {
            "reformed": 2,
            "left": 0,
            "stopped": 0,
            "stopped_reasons": [],
            "reform_s": 1.1,
            "halted_gpu_seconds": 2.2,
            "relaunch_s": 5.6,
            "relaunches_measured": 1,
            "saved_reforms": 2,
            "saved_gpu_hours": round((5.6 - 0.47 + 5.6 - 0.63) * 2 / H, 6),
        },
    )
    line = "re-formed 2x instead of stopping: 2.2 GPU-s halted, a relaunch here takes 5.6s: saved 0.006 GPU-h"
    page = render_html(doc)
    assert (True, [], True) == (
        line in said(shown),
        [x for x in shown.splitlines() if columns(x) > 80],
        "<th>re-formed</th><td>2x instead of stopping: 2.2 GPU-s halted, a relaunch here takes 5.6s" in page,
    )


async def test_without_a_measured_relaunch_nothing_is_saved_and_the_report_says_so(base: Path) -> None:
    """The same job without --drills: its only relaunch was a drill's, not counted, so no relaunch is
    measured here; the re-forms and their halted GPU-seconds are still counted, the saving is null."""
    week = Week(base)
    await week.start()
    try:
        await relaunch_then_shrink(week)
        doc = await report(week.socket, "--since", "30d")
        shown = await text(week.socket)
    finally:
        await week.stop()
    figures = doc["jobs"]["E"]["reforms"]
    assert ((2, 2.2, None, 0, None), True) == (
        (
            figures["reformed"],
            figures["halted_gpu_seconds"],
            figures["relaunch_s"],
            figures["saved_reforms"],
            figures["saved_gpu_hours"],
        ),
        "re-formed 2x instead of stopping: 2.2 GPU-s halted; no relaunch measured on this host"
        in said(shown),
    )


async def test_membership_reports_are_kept_across_a_restart(base: Path) -> None:
    """A re-form posted before the agent restarts is in the file after it, with its sizes, seconds and
    reason, and counted by the report of the new agent."""
    week = Week(base)
    await week.start()
    try:
        at_s(week, 0)
        await week.register("E", 100, 2)
        at_s(week, 60)
        await membership(week, "reformed", 100, 0, 1234, (3, 2), 0.47, reason="1 node(s) left")
        await week.stop()
        await week.start()
        at_s(week, 120)
        doc = await report(week.socket, "--since", "30d")
    finally:
        await week.stop()
    facts = await asyncio.to_thread(store.read, base / "state" / "ledger.sqlite")
    kept = [
        (r.phase, r.step, r.world_size, r.previous_world_size, r.seconds, r.reason) for r in facts.reports
    ]
    assert (
        [("registered", None, None, None, None, None), ("reformed", 1234, 2, 3, 0.47, "1 node(s) left")],
        1,
    ) == (
        kept,
        doc["jobs"]["E"]["reforms"]["reformed"],
    )


async def test_a_malformed_membership_report_is_refused_and_not_recorded(base: Path) -> None:
    """A membership report without world_size, or with seconds that are not a number, is answered 400 and
    the ledger holds no membership fact."""
    week = Week(base)
    await week.start()
    try:
        at_s(week, 0)
        await week.register("E", 100, 0)
        client = {"job": "E", "pid": 100, "rank": 0}
        statuses = []
        for bad in ({"previous_world_size": 3, "seconds": 0.5}, {"world_size": 2, "seconds": "fast"}):
            body = {"kind": "membership", "phase": "reformed", "client": client, "membership": bad}
            status, _ = await http_json(week.socket, "POST", "/v1/reports", body)
            statuses.append(status)
        doc = await report(week.socket, "--since", "30d")
    finally:
        await week.stop()
    facts = await asyncio.to_thread(store.read, base / "state" / "ledger.sqlite")
    assert ([400, 400], ["participant"], 0) == (
        statuses,
        [r.kind for r in facts.reports],
        doc["jobs"]["E"]["reforms"]["reformed"],
    )


def old_ledger(path: Path) -> None:
    """A ledger as the agent wrote it before membership reports were kept: one checkpoint of job E."""
    path.parent.mkdir(parents=True, exist_ok=True)
    conn = sqlite3.connect(path)
    try:
        conn.execute("PRAGMA journal_mode=WAL")
        conn.executescript(OLD_SCHEMA)
        conn.execute("PRAGMA user_version = 1")
        with conn:
            conn.execute(
                "INSERT INTO reports (time, job, pid, rank, gpus, kind, phase, step, duration_s, bytes, "
                "emergency, notice_id, tier, fallback_step) VALUES (?, 'E', 100, 0, 2, 'checkpoint', "
                "'finished', 10, 30.0, 1000, 0, NULL, NULL, NULL)",
                (T0.timestamp(),),
            )
    finally:
        conn.close()


def test_a_file_an_older_agent_wrote_reads_without_the_new_columns(tmp_path: Path) -> None:
    """`preemptd report` reading an old file no agent has opened since: its rows, the new fields None."""
    path = tmp_path / "ledger.sqlite"
    old_ledger(path)
    facts = store.read(path)
    row = facts.reports[0]
    assert (1, "checkpoint", 10, None, None, None, None) == (
        len(facts.reports),
        row.kind,
        row.step,
        row.world_size,
        row.previous_world_size,
        row.seconds,
        row.reason,
    )


async def test_an_old_ledger_gains_the_columns_and_keeps_its_rows(base: Path) -> None:
    """The agent opens a ledger of the old schema: the five columns are added (its old row NULL in them),
    the old checkpoint is still counted and a re-form is recorded beside it."""
    path = base / "state" / "ledger.sqlite"
    old_ledger(path)
    week = Week(base)
    await week.start()
    try:
        at_s(week, 600)
        await membership(week, "reformed", 100, 0, 20, (4, 2), 0.5)
        doc = await report(week.socket, "--since", "30d")
    finally:
        await week.stop()
    conn = sqlite3.connect(path)
    try:
        names = [row[1] for row in conn.execute("PRAGMA table_info(reports)")]
        rows = conn.execute("SELECT kind, world_size, seconds FROM reports ORDER BY seq").fetchall()
        version = conn.execute("PRAGMA user_version").fetchone()[0]
    finally:
        conn.close()
    job = doc["jobs"]["E"]
    assert (
        ["world_size", "previous_world_size", "seconds", "reason", "complete_s"],
        [("checkpoint", None, None), ("membership", 2, 0.5)],
        1,
        (1, 1, 1.0),
    ) == (
        names[-5:],
        rows,
        version,
        (job["checkpoints"], job["reforms"]["reformed"], job["reforms"]["halted_gpu_seconds"]),
    )


async def test_left_and_stopped_are_counted_and_the_interruption_stays(base: Path) -> None:
    """Job L: a drill here, the ranks flush and leave (the job goes on elsewhere): one left, the drill's
    interruption still counted. Job S: could not shrink, stopped with its reason kept."""
    week = Week(base)
    await week.start()
    try:
        at_s(week, 0)
        await week.register("L", 100, 0)
        await week.register("S", 300, 0)
        at_s(week, H)
        n1 = await week.drill(120)
        at_s(week, H + 20)
        await week.checkpoint("L", 100, 50, 10.0, 1000, 0, emergency=True, notice_id=n1)
        await week.checkpoint("S", 300, 70, 10.0, 1000, 0, emergency=True, notice_id=n1)
        at_s(week, H + 21)
        await membership(week, "left", 100, 0, 50, (4, 2), 0.3, reason="this node has the notice", job="L")
        why = "at the minimum of 2 node(s)"
        await membership(week, "stopped", 300, 0, 70, (4, 4), 0.2, reason=why, job="S")
        at_s(week, 2 * H)
        doc = await report(week.socket, "--drills", "--since", "30d")
        shown = await text(week.socket, "--drills")
    finally:
        await week.stop()
    left, stopped = doc["jobs"]["L"], doc["jobs"]["S"]
    assert (
        (1, 0, 0.0, 1),
        (0, 0, 1, [why], 1),
        True,
        True,
    ) == (
        (
            left["reforms"]["left"],
            left["reforms"]["reformed"],
            left["reforms"]["halted_gpu_seconds"],
            left["interruptions"]["announced"],
        ),
        (
            stopped["reforms"]["reformed"],
            stopped["reforms"]["left"],
            stopped["reforms"]["stopped"],
            stopped["reforms"]["stopped_reasons"],
            stopped["interruptions"]["announced"],
        ),
        "left 1x (this host's ranks left; the job went on elsewhere)" in said(shown),
        f"stopped 1x instead of shrinking: {why}" in said(shown),
    )


# ----- the counting on facts (pure) -----------------------------------------------------------------------

BASE = ReportFact(0.0, "E", 1, 0, None, "checkpoint", "finished", None, 10.0, 100, False, None, None, None)


def rep(at: float, **fields: Any) -> ReportFact:
    return replace(BASE, time=at, **fields)


def reformed(at: float, pid: int, step: int | None, took: float) -> ReportFact:
    return rep(
        at,
        pid=pid,
        kind="membership",
        phase="reformed",
        step=step,
        duration_s=None,
        bytes=None,
        world_size=2,
        previous_world_size=3,
        seconds=took,
        reason="1 node(s) left with the notice",
    )


def drill_relaunch(start: float, pid: int, restart_s: float, nid: str) -> tuple[list[ReportFact], NoticeFact]:
    """A notice at ``start``, the flush 10 s later, the new process ``restart_s`` after the flush."""
    notice = NoticeFact(nid, "termination", "aws", "critical", False, start, start + 120, None, start)
    flush = rep(start + 10, pid=pid, step=int(start), emergency=True, notice_id=nid)
    back = rep(start + 10 + restart_s, pid=pid + 1, kind="participant", phase="registered")
    return [flush, back], notice


def test_the_relaunch_is_the_median_of_the_jobs_restarts_here() -> None:
    """Restarts of 4, 6 and 20 s: a relaunch takes 6 s; one re-form of 1 s on one GPU saves 5 GPU-s."""
    reports, notices = [rep(0, pid=1, step=0)], []
    for index, (start, restart) in enumerate(((H, 4.0), (2 * H, 6.0), (3 * H, 20.0))):
        rows, notice = drill_relaunch(start, index + 1, restart, f"n{index}")
        reports += rows
        notices.append(notice)
    reports.append(reformed(4 * H, 4, 900, 1.0))
    got = reforms(timeline("E", reports, notices, 5 * H, Rules()), Rules())
    assert (6.0, 3, 1, 5.0 / H) == (got.relaunch_s, got.relaunches, got.reformed, got.saved_gpu_hours)


def test_two_nodes_on_one_host_report_one_re_form_once() -> None:
    """Two torchrun nodes of the job on this host each report the same re-form (same step and sizes): one
    re-form; a later one at another step is a second."""
    reports = [rep(0, pid=1, rank=0), rep(0, pid=2, rank=1)]
    reports += [reformed(60, 1, 500, 0.4), reformed(60.1, 2, 500, 0.5), reformed(120, 1, 700, 0.6)]
    got = reforms(timeline("E", reports, [], 200, Rules()), Rules())
    assert (2, pytest.approx(1.0), pytest.approx(2.0), None) == (
        got.reformed,
        got.reform_s,
        got.halted_gpu_s,
        got.relaunch_s,
    )


def test_facts_round_trip_and_an_older_document_still_loads() -> None:
    """to_json/from_json keep the membership fields; a document from before them loads with None."""
    facts = Facts(reports=(reformed(60, 1, 500, 0.47),))
    old = facts.to_json()
    for key in ("world_size", "previous_world_size", "seconds", "reason"):
        del old["reports"][0][key]
    back, older = Facts.from_json(facts.to_json()), Facts.from_json(old).reports[0]
    assert (facts, (None, None, None, None), "reformed") == (
        back,
        (older.world_size, older.previous_world_size, older.seconds, older.reason),
        older.phase,
    )


def test_the_total_adds_each_jobs_saving_against_its_own_relaunch() -> None:
    """Job E re-forms in 1 s with a 6 s relaunch measured (5 GPU-s saved on its one GPU); job F re-forms in
    2 s with none measured: the total counts both re-forms and saves E's 5 GPU-s only, and says so."""
    rows, notice = drill_relaunch(H, 1, 6.0, "n1")
    e = [rep(0, pid=1, step=0), *rows, reformed(2 * H, 2, 900, 1.0)]
    f = [replace(r, job="F", pid=r.pid + 10) for r in (rep(0, pid=1, step=0), reformed(2 * H, 1, 50, 2.0))]
    now = datetime.fromtimestamp(3 * H, timezone.utc)
    doc = build_report(Facts(notices=(notice,), reports=tuple(e + f)), now)
    total, shown = doc["total"]["reforms"], said(render_text(doc))
    assert ((2, 3.0, None, 1, round(5.0 / H, 6)), True, True) == (
        (
            total["reformed"],
            total["halted_gpu_seconds"],
            total["relaunch_s"],
            total["saved_reforms"],
            total["saved_gpu_hours"],
        ),
        "re-formed 2x instead of stopping: 3.0 GPU-s halted; saved 0.001 GPU-h over 1 re-form with a "
        "relaunch measured" in shown,
        "re-formed 1x instead of stopping: 2.0 GPU-s halted; no relaunch measured on this host" in shown,
    )
