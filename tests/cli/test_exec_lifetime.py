"""``preemptd exec`` leaves nothing behind: a SIGKILLed exec takes the command and its workers (in sessions of
their own, as torchrun starts them) with it, what the command leaves running when it exits is stopped, and the
channel directory of an exec that could not remove it is removed by the next one.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import textwrap
from pathlib import Path

from agent.cli.exec import channel_owner, remove_stale_channels
from tests.cli.support import alive
from tests.support import REPO, eventually

# The command starts one worker in a session of its own (torchrun's start_new_session=True: no signal to the
# command's process group reaches it), reports who is who, then stays or leaves its worker behind.
_FAMILY = textwrap.dedent(
    """
    import os, signal, subprocess, sys, time
    worker_code = "import time\\nwhile True: time.sleep(60)"
    if sys.argv[2] == "stubborn":
        worker_code = "import signal\\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\\n" + worker_code
    worker = subprocess.Popen([sys.executable, "-c", worker_code], start_new_session=True)
    print("family", os.getpid(), worker.pid, os.getppid(), os.environ["PREEMPTD_EXEC_DIR"], flush=True)
    if sys.argv[1] == "stay":
        while True:
            time.sleep(60)
    """
)


class _Family:
    """One ``preemptd exec -- python family.py`` with its own temporary directory (where exec's channel is)."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.tmpdir = tmp_path / "tmp"
        self.tmpdir.mkdir(exist_ok=True)
        self.script = tmp_path / "family.py"
        self.script.write_text(_FAMILY)
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("PREEMPTD_")}
        self.env.update(PYTHONPATH=str(REPO), TMPDIR=str(self.tmpdir))

    async def start(self, *args: str, flags: tuple[str, ...] = ()) -> asyncio.subprocess.Process:
        return await self.exec(*flags, "--", sys.executable, str(self.script), *args)

    async def exec(self, *args: str) -> asyncio.subprocess.Process:
        return await asyncio.create_subprocess_exec(
            sys.executable, "-m", "agent", "exec", *args,
            env=self.env, cwd=str(REPO), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip


class _Members:
    """What the command reported: its pid, its worker's, its parent's (exec's keeper) and the channel."""

    def __init__(self, line: bytes) -> None:
        word, command, worker, parent, channel = line.decode().split()
        assert "family" == word, line
        self.command, self.worker, self.parent = int(command), int(worker), int(parent)
        self.channel = Path(channel)


async def _members(proc: asyncio.subprocess.Process) -> _Members:
    assert proc.stdout is not None
    line = await asyncio.wait_for(proc.stdout.readline(), 30)
    if not line:
        _, err = await proc.communicate()
        raise AssertionError(f"exec ended before the command reported: {err.decode()[-2000:]}")
    return _Members(line)


def _kill(*pids: int) -> None:
    """Leave no process behind whatever a test saw."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


async def test_sigkill_of_exec_kills_the_command_and_its_worker(tmp_path: Path) -> None:
    """The command (holding GPUs in real life) and a worker in its own session do not outlive exec."""
    family = _Family(tmp_path)
    proc = await family.start("stay", "plain")
    members = await _members(proc)
    try:
        proc.kill()
        await asyncio.wait_for(proc.communicate(), 30)
        await eventually(
            lambda: not (alive(members.command) or alive(members.worker)), 30, "command and worker gone"
        )
    finally:
        _kill(members.command, members.worker)


async def test_a_killed_keeper_takes_the_command_with_it_and_exec_says_so(tmp_path: Path) -> None:
    """The command dies of its parent-death signal; exec exits 128 + 9 and names the keeper. (The worker,
    in a session of its own, goes to init: the documented limit of this case.)"""
    family = _Family(tmp_path)
    proc = await family.start("stay", "plain")
    members = await _members(proc)
    try:
        os.kill(members.parent, signal.SIGKILL)
        await eventually(lambda: not alive(members.command), 30, "command gone")
        _kill(members.worker)  # it holds exec's output pipe
        _, err = await asyncio.wait_for(proc.communicate(), 30)
        expected = (
            f"its keeper process {members.parent} was killed by signal 9; the command was killed with it"
        )
        assert (128 + signal.SIGKILL, True) == (proc.returncode, expected in err.decode())
    finally:
        _kill(members.command, members.worker)


async def test_a_worker_left_behind_is_stopped_when_the_command_exits(tmp_path: Path) -> None:
    """A background process the command leaves running is gone by the time exec has exited."""
    family = _Family(tmp_path)
    proc = await family.start("leave", "plain")
    members = await _members(proc)
    try:
        _, err = await asyncio.wait_for(proc.communicate(), 30)
        assert (0, False) == (proc.returncode, alive(members.worker)), err.decode()[-2000:]
    finally:
        _kill(members.worker)


async def test_a_worker_that_ignores_sigterm_is_killed_after_the_grace(tmp_path: Path) -> None:
    """``--stop-grace``: SIGTERM first, SIGKILL for what is still there when the grace is over."""
    family = _Family(tmp_path)
    proc = await family.start("leave", "stubborn", flags=("--stop-grace", "0.2"))
    members = await _members(proc)
    try:
        _, err = await asyncio.wait_for(proc.communicate(), 30)
        assert (0, False) == (proc.returncode, alive(members.worker)), err.decode()[-2000:]
    finally:
        _kill(members.worker)


_STOPPED_WORKER = textwrap.dedent(
    '''
    import os, signal, subprocess, sys
    worker = """
    import os, signal, sys
    def leave(signum, frame):
        open(sys.argv[1], "w").write("got SIGTERM")
        os._exit(0)
    signal.signal(signal.SIGTERM, leave)
    os.kill(os.getpid(), signal.SIGSTOP)
    """
    child = subprocess.Popen([sys.executable, "-c", worker, sys.argv[1]])
    os.waitpid(child.pid, os.WUNTRACED)  # the command leaves only once its worker is stopped
    '''
)


async def test_a_stopped_worker_left_behind_is_continued_to_act_on_its_sigterm(tmp_path: Path) -> None:
    """SIGCONT follows SIGTERM: a stopped process would otherwise wait for the SIGKILL after the grace."""
    family = _Family(tmp_path)
    script, marker = tmp_path / "stopped.py", tmp_path / "marker"
    script.write_text(_STOPPED_WORKER)
    proc = await family.exec("--stop-grace", "45", "--", sys.executable, str(script), str(marker))
    _, err = await asyncio.wait_for(proc.communicate(), 50)
    assert (0, "got SIGTERM") == (proc.returncode, marker.read_text() if marker.exists() else None), err


async def test_the_channel_of_a_killed_exec_is_removed_at_the_next_start(tmp_path: Path) -> None:
    """exec and its keeper both SIGKILLed: nobody could remove the directory; the next exec does."""
    family = _Family(tmp_path)
    proc = await family.start("stay", "plain")
    members = await _members(proc)
    try:
        proc.send_signal(signal.SIGSTOP)  # so that it cannot clean up when its keeper dies first
        os.kill(members.parent, signal.SIGKILL)
        proc.kill()
        _kill(members.worker)  # it went to init with its pipe to the test open
        await asyncio.wait_for(proc.communicate(), 30)
        left = members.channel.is_dir()
        again = await family.exec("--", "true")
        await asyncio.wait_for(again.communicate(), 30)
        assert (True, 0, False) == (left, again.returncode, members.channel.exists())
    finally:
        _kill(members.command, members.worker)


async def test_the_channel_of_a_running_exec_is_left_alone(tmp_path: Path) -> None:
    family = _Family(tmp_path)
    proc = await family.start("stay", "plain")
    members = await _members(proc)
    try:
        again = await family.exec("--", "true")
        await asyncio.wait_for(again.communicate(), 30)
        assert (0, True) == (again.returncode, members.channel.is_dir())
        proc.terminate()
        await asyncio.wait_for(proc.communicate(), 30)
    finally:
        _kill(members.command, members.worker)


def test_a_channel_is_removed_only_when_its_exec_on_this_host_and_pid_namespace_is_gone(
    tmp_path: Path,
) -> None:
    """A temporary directory may be shared with other hosts or containers: their pids mean nothing here."""
    me = channel_owner(os.getpid())
    assert me is not None
    boot, namespace, pid, started = me.split("-")
    later = int(started) + 1  # this pid, but a process started after the one the directory belongs to
    names = {
        "gone": f"preemptd-exec-{boot}-{namespace}-{pid}-{later}-abc",
        "alive": f"preemptd-exec-{me}-abc",
        "other host": f"preemptd-exec-{'f' if boot[0] != 'f' else 'e'}{boot[1:]}-{namespace}-{pid}-{later}-abc",
        "other namespace": f"preemptd-exec-{boot}-1-{pid}-{later}-abc",
        "unidentified": "preemptd-exec-abc123",
    }
    for name in names.values():
        (tmp_path / name).mkdir()
    removed = remove_stale_channels(str(tmp_path))
    assert ([names["gone"]], sorted(set(names.values()) - {names["gone"]})) == (
        removed,
        sorted(p.name for p in tmp_path.iterdir()),
    )
