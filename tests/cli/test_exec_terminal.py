"""``preemptd exec`` at a terminal (a real pseudo-terminal, exec in the foreground of its session as a shell
starts it): the command can read the terminal, Ctrl-C reaches it, Ctrl-Z stops the job and ``fg`` resumes it,
and the terminal is handed back when the command ends.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import REPO

# Make the terminal on stdin the controlling terminal of this new session (as a login shell has it), then run
# the rest of the arguments: exec starts as the foreground process group.
_ON_TERMINAL = (
    "import fcntl, os, sys, termios; fcntl.ioctl(0, termios.TIOCSCTTY, 0); "
    "os.execvp(sys.argv[1], sys.argv[1:])"
)
_EXEC = (sys.executable, "-m", "agent", "exec")


class _Terminal:
    """A pseudo-terminal with one program running on it; the test types and reads on the other side."""

    def __init__(self, *argv: str) -> None:
        self.master, slave = os.openpty()
        env = {k: v for k, v in os.environ.items() if not k.startswith("PREEMPTD_")}
        env["PYTHONPATH"] = str(REPO)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _ON_TERMINAL, *argv],
            stdin=slave, stdout=slave, stderr=slave, start_new_session=True, env=env, cwd=str(REPO),
        )  # fmt: skip
        os.close(slave)
        self.seen = ""

    def type(self, text: str) -> None:
        os.write(self.master, text.encode())

    def until(self, text: str, timeout: float = 30.0) -> None:
        """Read what the terminal shows until ``text`` appears."""
        deadline = time.monotonic() + timeout
        while text not in self.seen:
            left = deadline - time.monotonic()
            ready = select.select([self.master], [], [], max(left, 0))[0] if left > 0 else []
            if not ready:
                raise AssertionError(
                    f"{text!r} not shown within {timeout}s; the terminal shows {self.seen!r}"
                )
            try:
                chunk = os.read(self.master, 4096)
            except OSError:  # EIO: every program on the terminal has closed it
                chunk = b""
            if not chunk:
                raise AssertionError(f"the terminal closed before {text!r}; it showed {self.seen!r}")
            self.seen += chunk.decode(errors="replace")

    def wait(self) -> int:
        with contextlib.suppress(OSError):
            while os.read(self.master, 4096):  # drain, so no writer blocks on a full terminal
                pass
        return self.proc.wait(timeout=30)

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        os.close(self.master)


@contextlib.contextmanager
def _terminal(*argv: str) -> Iterator[_Terminal]:
    terminal = _Terminal(*argv)
    try:
        yield terminal
    finally:
        terminal.close()


_READ = "print('ready', flush=True); print('got', input(), flush=True)"


@pytest.mark.parametrize("flags", [(), ("--no-group",)])
def test_the_command_can_read_the_terminal(flags: tuple[str, ...]) -> None:
    """The command's group is the terminal's foreground group, so its read is not stopped by SIGTTIN."""
    with _terminal(*_EXEC, *flags, "--", sys.executable, "-c", _READ) as terminal:
        terminal.until("ready")
        terminal.type("hello\n")
        terminal.until("got hello")
        assert 0 == terminal.wait()


def test_ctrl_c_reaches_the_command() -> None:
    """Python dies of the SIGINT it got: exec exits 128 + 2."""
    command = "import time; print('ready', flush=True); time.sleep(600)"
    with _terminal(*_EXEC, "--", sys.executable, "-c", command) as terminal:
        terminal.until("ready")
        terminal.type("\x03")
        assert 128 + signal.SIGINT == terminal.wait()


def test_the_terminal_is_handed_back_when_the_command_ends() -> None:
    """A shell that reads the terminal after exec is not stopped as a background job."""
    script = '"$0" -m agent exec -- "$0" -c "print(1)"; echo asking; read answer; echo "shell got $answer"'
    with _terminal("sh", "-c", script, sys.executable) as terminal:
        terminal.until("asking")
        terminal.type("yes\n")
        terminal.until("shell got yes")
        assert 0 == terminal.wait()


def _state(pid: int) -> str:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rfind(")") + 2]


def test_ctrl_z_stops_exec_and_continuing_it_resumes_the_command() -> None:
    """Ctrl-Z stops the command and then exec itself, which its shell sees as a stopped job; SIGCONT (as
    ``fg`` sends it) gives the command the terminal back and continues it."""
    with _terminal(*_EXEC, "--", sys.executable, "-c", _READ) as terminal:
        terminal.until("ready")
        terminal.type("\x1a")
        deadline = time.monotonic() + 30
        while _state(terminal.proc.pid) != "T":  # no event tells the test that exec stopped itself
            assert time.monotonic() < deadline, "exec did not stop after Ctrl-Z"
            time.sleep(0.05)
        os.kill(terminal.proc.pid, signal.SIGCONT)
        terminal.type("again\n")
        terminal.until("got again")
        assert 0 == terminal.wait()


@pytest.mark.parametrize(
    "shell", [("bash", "--norc", "--noprofile", "-i"), ("dash", "-i")], ids=["bash", "dash"]
)
def test_a_job_continued_in_the_background_leaves_the_terminal_to_the_shell(
    tmp_path: Path, shell: tuple[str, ...]
) -> None:
    """Ctrl-Z, then ``bg`` in an interactive bash: when the command ends, exec does not take the terminal from
    the shell, which reads the next line as usual."""
    go = tmp_path / "go"
    os.mkfifo(go)
    script = tmp_path / "job.py"
    script.write_text(f"print('ready', flush=True)\nopen({str(go)!r}).read()\n")
    with _terminal(*shell) as terminal:
        terminal.type(f"{sys.executable} -m agent exec -- {sys.executable} {script}\n")
        terminal.until("ready")
        terminal.type("\x1a")
        terminal.until("Stopped")
        terminal.type("bg; echo in-the-$((1+1))-background\n")  # the arithmetic shows up only in the output
        terminal.until("in-the-2-background")
        go.write_text("go")  # the job reads it and ends
        terminal.type("wait; echo waited-$((2+1))\n")
        terminal.until("waited-3")
        terminal.type("echo alive-$((3+1))\n")
        terminal.until("alive-4")
        terminal.type("exit\n")
        assert 0 == terminal.wait()
