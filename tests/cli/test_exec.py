"""``preemptd exec``: exit status passed through, signals forwarded to the command's process group, and 75 when
the command failed after one of its processes recorded a committed emergency checkpoint — including under a
real ``torchrun`` with two gloo ranks of examples/fault_tolerant_training.py, where torchrun alone exits 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import shlex
import signal
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from agent.cli.exec import decide
from agent.cli.exec_child import descendants
from agent.client import EXIT_PREEMPTED, CheckpointStore
from agent.client.preempted import ENV, read_records, record_emergency
from tests.cli.support import alive
from tests.lazy import needs_torch
from tests.support import REPO, eventually, http_json, running_agent

EXAMPLE = REPO / "examples" / "fault_tolerant_training.py"


def _env(**extra: str) -> dict[str, str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("PREEMPTD_")}
    environ.update({"PYTHONPATH": str(REPO), **extra})
    return environ


async def _exec(*command: str, env: dict[str, str] | None = None) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "agent", "exec", "--", *command,
        env=env or _env(), cwd=str(REPO), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip


async def _finish(proc: asyncio.subprocess.Process, timeout: float = 30.0) -> tuple[int, str, str]:
    out, err = await asyncio.wait_for(proc.communicate(), timeout)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


@pytest.mark.parametrize("status", [0, 1, 3, EXIT_PREEMPTED])
async def test_exit_status_is_passed_through(status: int) -> None:
    proc = await _exec(sys.executable, "-c", f"import sys; sys.exit({status})")
    code, _, _ = await _finish(proc)
    assert status == code


async def test_a_command_killed_by_a_signal_gives_128_plus_the_signal() -> None:
    proc = await _exec(sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    code, _, _ = await _finish(proc)
    assert 128 + signal.SIGKILL == code


async def test_a_missing_command_gives_127_and_says_so() -> None:
    proc = await _exec("/nonexistent/train-it")
    code, _, err = await _finish(proc)
    assert (127, True) == (code, "/nonexistent/train-it: command not found" in err)


async def test_a_file_the_kernel_cannot_run_gives_126_and_says_why(tmp_path: Path) -> None:
    """An executable file with no ``#!`` line and no binary format (ENOEXEC): a clear message, no traceback."""
    garbage = tmp_path / "train.sh"
    garbage.write_bytes(b"\x00\x01 not a program\n")
    garbage.chmod(0o755)
    proc = await _exec(str(garbage))
    code, _, err = await _finish(proc)
    assert (126, True, False) == (
        code,
        f"{garbage}: cannot run it: Exec format error" in err,
        "Traceback" in err,
    )


async def test_a_command_name_that_is_not_utf8_is_reported_like_any_other() -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "agent", "exec", "--", b"/nonexistent/train-\xff",
        env=_env(), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    code, _, err = await _finish(proc)
    assert (127, True, False) == (code, "command not found" in err, "Traceback" in err), err


@pytest.mark.parametrize("value", ["soon", "-1", "86400"])
async def test_a_bad_stop_grace_is_a_usage_error_that_says_why(value: str) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "agent", "exec", "--stop-grace", value, "--", "true",
        env=_env(), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    code, _, err = await _finish(proc)
    assert (2, True) == (code, "argument --stop-grace:" in err and value in err), err


async def test_no_command_is_a_usage_error() -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "agent",
        "exec",
        env=_env(),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    code, _, err = await _finish(proc)
    assert (2, True) == (code, "no command given" in err)


async def test_failure_after_a_recorded_emergency_checkpoint_exits_75() -> None:
    script = (
        "import sys; from agent.client.preempted import record_emergency; "
        "record_emergency(12, path='/ckpt/step-12', notice_id='drill-1'); sys.exit(1)"
    )
    proc = await _exec(sys.executable, "-c", script)
    code, _, err = await _finish(proc)
    assert (EXIT_PREEMPTED, True) == (code, "step 12, notice drill-1" in err)


async def test_a_worker_started_after_the_recorded_stop_makes_a_later_failure_a_failure(
    tmp_path: Path,
) -> None:
    """torchrun restarted its workers after one recorded a stop for a notice (a host joined an elastic job): the
    new worker's Watcher withdraws the gone process's record, so the job failing later exits 1, not 75."""
    stopped = "from agent.client.preempted import record_emergency; record_emergency(7, notice_id='drill-2')"
    restarted = (
        "import sys; from agent.client.watcher import Watcher; "
        f"w = Watcher({str(tmp_path / 'no-agent.sock')!r}).start(); w.stop(); sys.exit(1)"
    )
    script = f"{sys.executable} -c {shlex.quote(stopped)} && {sys.executable} -c {shlex.quote(restarted)}"
    proc = await _exec("/bin/sh", "-c", script)
    code, _, err = await _finish(proc)
    assert (1, False) == (code, "drill-2" in err), err


async def test_success_after_a_recorded_emergency_checkpoint_stays_0() -> None:
    script = "from agent.client.preempted import record_emergency; record_emergency(3)"
    proc = await _exec(sys.executable, "-c", script)
    code, _, _ = await _finish(proc)
    assert 0 == code


async def test_store_records_an_emergency_save_but_not_a_periodic_one(tmp_path: Path) -> None:
    """The record is written by the client once the emergency checkpoint is durable, not guessed by exec."""
    script = textwrap.dedent(
        f"""
        import sys
        from agent.client import CheckpointStore
        store = CheckpointStore({str(tmp_path / "ckpt")!r}, report=False)
        write = lambda d: (d / "w").write_bytes(b"x")
        store.save(1, write)
        sys.exit(1 if sys.argv[1] == "periodic" else 0)
        """
    )
    periodic = await _exec(sys.executable, "-c", script, "periodic")
    code, _, _ = await _finish(periodic)
    emergency_script = script.replace("store.save(1, write)", "store.save(2, write, emergency=True)")
    emergency = await _exec(sys.executable, "-c", emergency_script.replace("else 0", "else 1"), "x")
    emergency_code, _, _ = await _finish(emergency)
    assert (1, EXIT_PREEMPTED) == (code, emergency_code)


def test_record_is_written_only_under_exec(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    outside = record_emergency(5)
    monkeypatch.setenv(ENV, str(tmp_path))
    inside = record_emergency(5, notice_id="n1", sharded=True)
    [record] = read_records(tmp_path)
    assert (None, True, (5, "n1", True)) == (
        outside,
        inside is not None and inside.parent == tmp_path,
        (record["step"], record["notice_id"], record["sharded"]),
    )


def test_unwritable_channel_is_a_warning_not_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ENV, str(tmp_path / "gone"))
    with pytest.warns(RuntimeWarning, match="cannot tell preemptd exec"):
        assert record_emergency(5) is None


@pytest.mark.parametrize(
    ("code", "records", "expected"),
    [
        (0, [{"step": 1}], 0),
        (1, [], 1),
        (-15, [], 128 + 15),
        (-9, [{"step": 4}], EXIT_PREEMPTED),
        (2, [{"step": 4, "notice_id": "x"}], EXIT_PREEMPTED),
    ],
)
def test_decision_table(code: int, records: list[dict[str, Any]], expected: int) -> None:
    assert expected == decide(code, records, ["torchrun"], io.StringIO())


def test_a_failed_emergency_save_that_fell_back_to_an_earlier_step_exits_75_and_says_so() -> None:
    """The store's record for a notice handled with an earlier committed step (the emergency save failed)."""
    error = "no space left on device: 5.0 MB needed, 1.0 MB free\nmore detail"
    records = [
        {"step": 40, "fallback": True, "failed_step": 41, "error": error, "notice_id": "n1", "pid": pid}
        for pid in (11, 12)
    ]
    err = io.StringIO()
    code = decide(1, records, ["/usr/bin/python3", "train.py"], err)
    expected = (
        "preemptd exec: python3 exited with status 1 after 2 of its processes could not save step 41 (no space "
        "left on device: 5.0 MB needed, 1.0 MB free) and fell back to the committed step 40 (notice n1): "
        "exiting 75 so the job is requeued\n"
    )
    assert (EXIT_PREEMPTED, expected) == (code, err.getvalue())


@pytest.mark.parametrize(
    ("command", "explained"),
    [
        (["torchrun", "--nproc-per-node", "2", "train.py"], True),
        (["/usr/bin/python3", "-m", "torch.distributed.run", "train.py"], True),
        (["python", "train.py"], False),
    ],
)
def test_torchruns_traceback_is_explained_before_exiting_75(command: list[str], explained: bool) -> None:
    """The ChildFailedError traceback torchrun prints after a preemption gets one line saying it is expected."""
    err = io.StringIO()
    code = decide(1, [{"step": 7}], command, err)
    lines = err.getvalue().splitlines()
    assert (EXIT_PREEMPTED, explained, True) == (
        code,
        "ChildFailedError traceback above" in lines[0],
        lines[-1].endswith("exiting 75 so the job is requeued"),
    )


_FAMILY = textwrap.dedent(
    """
    import os, signal, subprocess, sys, time
    role = "child" if len(sys.argv) > 1 else "parent"
    def say(*words):  # one write per line: parent and child share the pipe
        os.write(1, (" ".join(map(str, words)) + "\\n").encode())
    def note(signum, frame):
        say(signum, role)
        if signum == signal.SIGTERM:
            sys.exit(0)
    signal.signal(signal.SIGUSR1, note)
    signal.signal(signal.SIGTERM, note)
    if role == "parent":  # one child, as torchrun starts its workers
        child = subprocess.Popen([sys.executable, __file__, "child"])
    say("pid", role, os.getpid())
    while True:
        time.sleep(0.05)
    """
)


class _Lines:
    """The command's stdout, line by line, as it comes."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.seen: list[str] = []

    async def until(self, prefix: str, timeout: float = 20.0) -> None:
        """Read until a line that starts with ``prefix``."""

        async def read() -> None:
            assert self.proc.stdout is not None
            while not any(s.startswith(prefix) for s in self.seen):
                got = await self.proc.stdout.readline()
                if not got:
                    raise AssertionError(f"output ended before {prefix!r}: {self.seen}")
                self.seen.append(got.decode().strip())

        await asyncio.wait_for(read(), timeout)

    def pid(self, role: str) -> int:
        return int(next(s.split()[2] for s in self.seen if s.startswith(f"pid {role} ")))


@pytest.mark.parametrize("group", [True, False])
async def test_signals_reach_the_whole_process_group_or_only_the_command(tmp_path: Path, group: bool) -> None:
    script = tmp_path / "family.py"
    script.write_text(_FAMILY)
    usr1, term = int(signal.SIGUSR1), int(signal.SIGTERM)
    flags = [] if group else ["--no-group"]
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "agent", "exec", *flags, "--", sys.executable, str(script),
        env=_env(), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    lines = _Lines(proc)
    try:
        await lines.until("pid parent ")
        await lines.until("pid child ")
        proc.send_signal(signal.SIGUSR1)
        await lines.until(f"{usr1} parent")
        proc.send_signal(signal.SIGTERM)
        await lines.until(f"{term} parent")
        if not group:  # the child was left alone (and holds exec's output pipe open): stop it by hand
            os.kill(lines.pid("child"), signal.SIGTERM)
        # A child that got SIGUSR1 handles it before the later SIGTERM (Python runs handlers in signal order).
        await lines.until(f"{term} child")
        code, _, _ = await _finish(proc)
    finally:
        for role in ("parent", "child"):  # whatever failed above, leave no process behind
            with contextlib.suppress(StopIteration, ProcessLookupError):
                os.kill(lines.pid(role), signal.SIGKILL)
    got = sorted(s for s in lines.seen if s.startswith(f"{usr1} "))
    expected = [f"{usr1} child", f"{usr1} parent"] if group else [f"{usr1} parent"]
    assert (0, expected) == (code, got)


# -- under a real torchrun ----------------------------------------------------------------------------


async def _torchrun(ckpt: Path, sock: Path, *, under_exec: bool) -> asyncio.subprocess.Process:
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    example = [str(EXAMPLE), "--checkpoint-dir", str(ckpt), "--steps", "100000", "--step-time", "0.01",
               "--socket", str(sock)]  # fmt: skip
    wrapper = [sys.executable, "-m", "agent", "exec", "--"] if under_exec else []
    return await asyncio.create_subprocess_exec(
        *wrapper, *torchrun, *example,
        env=_env(GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1"), cwd=str(REPO),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip


async def _lines_until(
    proc: asyncio.subprocess.Process, needle: str, count: int, timeout: float = 90.0
) -> None:
    assert proc.stdout is not None
    seen = 0

    async def read() -> None:
        nonlocal seen
        while seen < count:
            line = await proc.stdout.readline()  # type: ignore[union-attr]
            if not line:
                raise AssertionError(f"torchrun ended before {count} {needle!r} lines")
            seen += line.decode().count(needle)  # ranks share the pipe: lines may merge

    await asyncio.wait_for(read(), timeout)


@needs_torch
@pytest.mark.torch_mp
@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("under_exec", [False, True])
async def test_torchrun_turns_75_into_1_and_exec_restores_75(base: Path, under_exec: bool) -> None:
    """Both ranks save their emergency checkpoint and exit 75 on a drill; torchrun exits 1, exec exits 75."""
    ckpt = base / "ckpt"
    async with running_agent(base):
        sock = base / "a.sock"
        proc = await _torchrun(ckpt, sock, under_exec=under_exec)
        await _lines_until(proc, '"agent_connected"', 2)
        status, body = await http_json(sock, "POST", "/v1/drills", {"kind": "termination", "in_s": 30})
        assert status == 201, body
        code, _, err = await _finish(proc, timeout=120)
    latest = [CheckpointStore(ckpt / f"rank-{r}", report=False).latest() for r in (0, 1)]
    assert all(c is not None and c.emergency for c in latest), err[-3000:]
    assert (EXIT_PREEMPTED if under_exec else 1) == code, err[-3000:]


@needs_torch
@pytest.mark.torch_mp
@pytest.mark.slow
@pytest.mark.timeout(180)
async def test_sigterm_to_exec_reaches_the_workers_and_gives_75(base: Path) -> None:
    """As Kubernetes stops a pod: SIGTERM to exec (PID 1 there) reaches torchrun and its workers, which flush
    and exit 75; exec exits 75."""
    ckpt = base / "ckpt"
    proc = await _torchrun(ckpt, base / "none.sock", under_exec=True)
    await _lines_until(proc, '"fresh"', 2)
    proc.send_signal(signal.SIGTERM)
    code, _, err = await _finish(proc, timeout=120)
    latest = [CheckpointStore(ckpt / f"rank-{r}", report=False).latest() for r in (0, 1)]
    assert all(c is not None and c.emergency for c in latest), err[-3000:]
    assert EXIT_PREEMPTED == code, err[-3000:]


@needs_torch
@pytest.mark.torch_mp
@pytest.mark.slow
@pytest.mark.timeout(180)
async def test_sigkill_of_exec_leaves_no_torchrun_worker_behind(base: Path) -> None:
    """torchrun starts each worker in a session of its own; a SIGKILLed exec still takes them all along."""
    proc = await _torchrun(base / "ckpt", base / "none.sock", under_exec=True)
    await _lines_until(proc, '"fresh"', 2)
    tree = descendants(proc.pid)  # the keeper, torchrun and its two workers
    proc.kill()
    try:
        await asyncio.wait_for(proc.communicate(), 60)
        await eventually(lambda: not any(map(alive, tree)), 60, "torchrun and its workers gone")
    finally:
        for pid in tree:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert 4 <= len(tree), tree
