"""Native journal output: the fields of a log entry (pure), the fallback to JSON lines, and the agent under
a real systemd-journald (in a private mount namespace, so the host's /run is untouched) found again with
``journalctl NOTICE_ID=…``."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import structlog

from agent.service.journal import field_name, journal_fields, load_send
from agent.service.logs import configure_logging
from tests.support import REPO, AgentProcess, SSEClient, http_json

JOURNALD = next((p for p in ("/usr/lib/systemd/systemd-journald", "/lib/systemd/systemd-journald") if os.access(p, os.X_OK)), None)  # fmt: skip
UNSHARE = shutil.which("unshare")
JOURNALCTL = shutil.which("journalctl")

RAISED = {
    "event": "notice_raised",
    "level": "warning",
    "timestamp": "2026-12-03T08:00:00Z",
    "notice_id": "aws-1f2e",
    "kind": "termination",
    "severity": "critical",
    "source": "aws",
    "reason": "EC2 spot interruption: the instance will terminate",
    "deadline": "2026-12-03T08:02:00.000Z",
    "seconds_left": 119.6,
    "drill": False,
    "seq": 7,
}


def test_notice_entry_fields() -> None:
    fields = journal_fields("warning", RAISED)
    assert {
        "MESSAGE": "Critical termination notice from aws raised: EC2 spot interruption: the instance will "
        "terminate; deadline 2026-12-03T08:02:00.000Z (120 s left)",
        "PRIORITY": "4",
        "SYSLOG_IDENTIFIER": "preemptd",
        "EVENT": "notice_raised",
        "NOTICE_ID": "aws-1f2e",
        "NOTICE_KIND": "termination",
        "SOURCE": "aws",
        "DEADLINE": "2026-12-03T08:02:00.000Z",
        "SEQ": "7",
        "DRILL": "false",
    }.items() <= fields.items()


def test_entry_without_a_template_reads_as_words_with_its_error() -> None:
    fields = journal_fields(
        "error", {"event": "state_write_failed", "error": "disk full", "peer": {"pid": 3}}
    )
    assert ("State write failed: disk full", "3", '{"pid":3}') == (
        fields["MESSAGE"],
        fields["PRIORITY"],
        fields["PEER"],
    )


@pytest.mark.parametrize(
    ("key", "name"), [("notice_id", "NOTICE_ID"), ("_secret", "SECRET"), ("3d", "F_3D"), ("a-b.c", "A_B_C")]
)
def test_field_names_are_valid_journal_fields(key: str, name: str) -> None:
    assert name == field_name(key)


def test_without_the_binding_the_journal_gets_prefixed_json_lines(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "stdout"
    with out.open("w") as stream:
        st = os.fstat(stream.fileno())
        monkeypatch.setenv("JOURNAL_STREAM", f"{st.st_dev}:{st.st_ino}")
        try:
            chosen = configure_logging("auto", "info", stream=stream, journal_send=None)
            structlog.get_logger("preemptd").warning("notice_raised", notice_id="x")
        finally:
            structlog.reset_defaults()
    line = out.read_text().splitlines()[0]
    assert ("journal", "<4>", "x") == (chosen, line[:3], json.loads(line[3:])["notice_id"])


def test_entries_journald_refuses_fall_back_to_lines(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(message: str, **fields: str) -> None:
        raise OSError("no journal socket")

    out = tmp_path / "stdout"
    with out.open("w") as stream:
        st = os.fstat(stream.fileno())
        monkeypatch.setenv("JOURNAL_STREAM", f"{st.st_dev}:{st.st_ino}")
        try:
            chosen = configure_logging("auto", "info", stream=stream, journal_send=refuse)
            structlog.get_logger("preemptd").info("agent_stopped")
        finally:
            structlog.reset_defaults()
    line = out.read_text().splitlines()[0]
    assert ("journal-native", "<6>", "preemptd stopped") == (
        chosen,
        line[:3],
        json.loads(line[3:])["MESSAGE"],
    )


# The agent under a real journald, in a mount namespace of its own: tmpfs over /run/systemd, /run/log and
# /var/log/journal, so the journald started here owns /run/systemd/journal/socket only for this script.
SCRIPT = r"""
set -euo pipefail
for dir in /run/systemd /run/log /var/log/journal; do mkdir -p "$dir"; mount -t tmpfs tmpfs "$dir"; done
"$JOURNALD" >"$WORK/journald.out" 2>&1 &
journald=$!
trap 'kill $journald 2>/dev/null || true' EXIT
for _ in $(seq 100); do [ -S /run/systemd/journal/socket ] && break; sleep 0.05; done
: >"$WORK/stdout"
export JOURNAL_STREAM="$(stat -c %d:%i "$WORK/stdout")"
"$PY" -m agent run --socket "$WORK/a.sock" --state-dir "$WORK/state" --cloud none \
    --set gpu.enabled=false --set host.enabled=false --log-format auto >>"$WORK/stdout" 2>&1 &
agent=$!
for _ in $(seq 200); do [ -S "$WORK/a.sock" ] && break; sleep 0.05; done
unset JOURNAL_STREAM
"$PY" -m agent drill --socket "$WORK/a.sock" --in 30s --json >"$WORK/drill.json"
kill -TERM $agent; wait $agent
journalctl --sync
id="$("$PY" -c 'import json,sys; print(json.load(open(sys.argv[1]))["id"])' "$WORK/drill.json")"
journalctl -D /run/log/journal -o json --no-pager "NOTICE_ID=$id" >"$WORK/by-notice.json"
journalctl -D /run/log/journal -o json --no-pager SYSLOG_IDENTIFIER=preemptd >"$WORK/all.json"
"""


@pytest.mark.slow
@pytest.mark.service
@pytest.mark.skipif(
    None in (JOURNALD, UNSHARE, JOURNALCTL) or load_send() is None or os.geteuid() != 0,
    reason="needs root, unshare, systemd-journald, journalctl and the systemd-python binding (journal extra)",
)
@pytest.mark.timeout(60)
def test_agent_entries_in_a_real_journal_are_found_by_notice_id(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREEMPTD_", "NOTIFY_SOCKET", "JOURNAL"))}
    env.update(WORK=str(tmp_path), PY=sys.executable, JOURNALD=str(JOURNALD), PYTHONPATH=str(REPO))
    done = subprocess.run(
        [str(UNSHARE), "--mount", "--propagation", "private", "bash", "-c", SCRIPT],
        check=False,
        capture_output=True,
        text=True,
        timeout=50,
        env=env,
    )
    if done.returncode != 0 and "unshare failed" in done.stderr:
        pytest.skip(f"no mount namespace here: {done.stderr.strip()}")
    assert 0 == done.returncode, done.stderr + (tmp_path / "stdout").read_text()
    notice_id = json.loads((tmp_path / "drill.json").read_text())["id"]
    by_notice = [json.loads(line) for line in (tmp_path / "by-notice.json").read_text().splitlines()]
    everything = [json.loads(line) for line in (tmp_path / "all.json").read_text().splitlines()]
    raised = [e for e in by_notice if e.get("EVENT") == "notice_raised"]
    assert 1 == len(raised), by_notice
    entry = raised[0]
    assert (notice_id, "termination", "drill", "4", "journal") == (
        entry["NOTICE_ID"],
        entry["NOTICE_KIND"],
        entry["SOURCE"],
        entry["PRIORITY"],
        entry["_TRANSPORT"],
    )
    assert entry["MESSAGE"].startswith("Critical drill termination notice from drill raised")
    assert {"agent_started", "drill_injected", "agent_stopped"} <= {e.get("EVENT") for e in everything}
    assert "" == (tmp_path / "stdout").read_text()  # nothing fell back to lines


@pytest.mark.slow
async def test_each_fact_is_logged_once(base: Path) -> None:
    """One ready record per notice, and no "recovered" for a source whose first read simply succeeded."""
    proc = AgentProcess(base, extra_args=["--set", "actions.ready.without_participants=immediately"])
    await proc.start()
    try:
        client = await SSEClient.connect(proc.socket_path)
        try:
            await client.next()
            await http_json(proc.socket_path, "POST", "/v1/drills", {"in_s": 60})
            await client.until(lambda e: e["type"] == "ready")
        finally:
            await client.close()
    finally:
        await proc.stop()
    events = [r["event"] for r in proc.logs()]
    assert (1, 0, 0) == (
        events.count("notice_ready"),
        events.count("ready"),
        events.count("source_recovered"),
    )


def test_a_client_librarys_request_lines_stay_out_of_the_log_and_its_warnings_do_not(tmp_path: Path) -> None:
    """httpx2 (lightkube's HTTP client, the Kubernetes bridge's) logs every API request at info; aiohttp every
    request it serves: neither reaches the agent's log at info level, their warnings do."""
    out = tmp_path / "stdout"
    with out.open("w") as stream:
        try:
            configure_logging("json", "info", stream=stream, journal_send=None)
            logging.getLogger("httpx2").info('HTTP Request: GET https://k8s/api/v1/nodes/n "HTTP/1.1 200 OK"')
            logging.getLogger("aiohttp.access").info("GET /v1/status 200")
            logging.getLogger("httpx2").warning("connection pool is full")
        finally:
            structlog.reset_defaults()
    lines = out.read_text()
    assert ("HTTP Request" not in lines, "/v1/status" not in lines, "pool is full" in lines) == (True,) * 3, (
        lines
    )
