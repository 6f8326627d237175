"""The keeper of ``preemptd exec``: exec's child that starts the command and makes sure nothing the command
started outlives exec (see :mod:`agent.cli.exec` for the process tree), with the Linux process-tree tools it
uses (prctl's subreaper and parent-death signal, the tree read from /proc). Standard library only.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import NoReturn

EXIT_CANNOT_RUN = 126
EXIT_NOT_FOUND = 127

# What the terminal sends a foreground group that contains the keeper (with --no-group): not for the keeper.
_TERMINAL_STOPS = (signal.SIGTSTP, signal.SIGTTIN, signal.SIGTTOU)

# prctl(2) options, from linux/prctl.h.
_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


class _ParentGone(Exception):
    """exec died (SIGKILLed): the keeper kills everything below it at once."""


class Keeper:
    """exec's child that starts the command and outlives exec just long enough to kill the command's whole
    tree. It reports to exec over a pipe, one line each: ``pid N`` (the command started), ``stopped N``,
    ``exit CODE`` (as subprocess gives it: -N for signal N) or ``error STATUS MESSAGE`` (it could not start),
    and exits once nothing is left below it."""

    def __init__(
        self,
        command: Sequence[str],
        env: dict[str, str],
        group: bool,
        terminal: int | None,
        stop_grace: float,
        channel: str,
        report_to: int,
        prctl: Callable[[int, int], int] | None,
        signals: Iterable[int],
    ) -> None:
        self.command = list(command)
        self.env = env
        self.group = group
        self.terminal = terminal
        self.stop_grace = stop_grace
        self.channel = channel
        self.report_to = report_to
        self.prctl = prctl
        self.signals = tuple(signals)
        self.me = os.getpid()
        self.parent = os.getppid()
        self.gone = False

    def main(self) -> NoReturn:
        status = 0
        try:
            try:
                self._keep()
            except _ParentGone:
                shutil.rmtree(self.channel, ignore_errors=True)  # nobody else will
            finally:
                _kill_descendants(self.me)
        except BaseException:  # never return into the caller's code: this is a forked copy of exec
            traceback.print_exc()
            status = 1
        os._exit(status)

    def _keep(self) -> None:
        # Its own process group: a signal for exec's group (a shell's `kill -9 %1`) leaves it to clean up.
        os.setpgid(0, 0)
        for signum in (*self.signals, *_TERMINAL_STOPS):
            # A Python handler, not SIG_IGN: SIG_IGN would be inherited by the command through execve.
            signal.signal(signum, self._on_signal)
        if self.prctl is not None:
            self.prctl(_PR_SET_CHILD_SUBREAPER, 1)
            self.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != self.parent:  # exec died before the parent-death signal was set
            raise _ParentGone
        try:
            child = subprocess.Popen(self.command, env=self.env, preexec_fn=self._in_child)  # noqa: PLW1509
        except FileNotFoundError:
            self._report(f"error {EXIT_NOT_FOUND} preemptd exec: {self.command[0]}: command not found")
            return
        except (OSError, subprocess.SubprocessError) as exc:
            reason = getattr(exc, "strerror", None) or str(exc)
            if getattr(exc, "errno", None) == errno.ENOEXEC:
                reason += " (not a program this system runs, nor a script with a first line like #!/bin/sh)"
            self._report(f"error {EXIT_CANNOT_RUN} preemptd exec: {self.command[0]}: cannot run it: {reason}")
            return
        self._report(f"pid {child.pid}")
        code = self._wait(child.pid)
        self._report(f"exit {code}")
        self._stop_the_rest()

    def _on_signal(self, signum: int, frame: object) -> None:
        # Signals for the command reach it from exec; the only news for the keeper is that exec is gone (its
        # parent-death signal is SIGTERM). The command's process runs this handler too, between fork and exec.
        if os.getpid() == self.me and os.getppid() != self.parent and not self.gone:
            self.gone = True
            raise _ParentGone

    def _in_child(self) -> None:
        """In the command's process before it runs the command (so that nothing it does comes earlier)."""
        if self.group:
            # Its own group, so that a signal reaches the command *and* its workers, as Ctrl-C would.
            os.setpgrp()
        if self.terminal is not None:
            with contextlib.suppress(OSError):
                give_terminal(self.terminal, os.getpgrp())
        if self.prctl is not None:
            self.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
            if os.getppid() != self.me:  # the keeper died before that
                os.kill(os.getpid(), signal.SIGKILL)

    def _report(self, line: str) -> None:
        try:
            # A command's name may hold any bytes (surrogates in Python's str).
            os.write(self.report_to, f"{line}\n".encode(errors="surrogateescape"))
        except BrokenPipeError:
            raise _ParentGone from None

    def _wait(self, pid: int) -> int:
        """The command's exit code, reaping the orphans that come to this subreaper meanwhile."""
        flags = os.WUNTRACED if self.terminal is not None else 0
        while True:
            got, status = os.waitpid(-1, flags)
            if got != pid:
                continue
            if os.WIFSTOPPED(status):
                self._report(f"stopped {os.WSTOPSIG(status)}")
                continue
            return os.waitstatus_to_exitcode(status)

    def _stop_the_rest(self) -> None:
        """SIGTERM whatever the command left running, then wait up to the grace for all of it to exit
        (SIGKILL for the rest comes after, in main)."""
        # Blocked, SIGCHLD stays pending for sigtimedwait; this process forks nothing any more.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
        if not _signal_descendants(self.me, signal.SIGTERM):
            return
        # A stopped process runs its SIGTERM handler only once continued (as systemd does it too).
        _signal_descendants(self.me, signal.SIGCONT)
        deadline = time.monotonic() + self.stop_grace
        while _reap_exited():
            left = deadline - time.monotonic()
            if left <= 0 or signal.sigtimedwait({signal.SIGCHLD}, left) is None:
                return


def load_prctl() -> Callable[[int, int], int] | None:
    """libc's prctl(2), or None where there is none. Loaded before forking: a forked child only calls it."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes  # here, not at the top: nothing else needs it

    try:
        function = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    function.restype = ctypes.c_int

    def prctl(option: int, value: int) -> int:
        return int(function(option, value, 0, 0, 0))

    return prctl


def _processes() -> Iterator[tuple[int, list[bytes]]]:
    """(pid, the fields of /proc/PID/stat from the state on) for every process; none without /proc."""
    try:
        names = os.listdir("/proc")
    except OSError:
        return
    for name in names:
        if name.isdigit():
            fields = _stat(int(name))
            if fields is not None:
                yield int(name), fields


def _stat(pid: int) -> list[bytes] | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            raw = handle.read()
    except OSError:
        return None
    return raw[raw.rfind(b")") + 2 :].split()  # the name in parentheses may hold spaces and parentheses


def descendants(root: int) -> list[int]:
    """The pids of every process below ``root`` now (read from /proc; empty without it)."""
    children: dict[int, list[int]] = {}
    for pid, fields in _processes():
        children.setdefault(int(fields[1]), []).append(pid)
    found: list[int] = []
    todo = [root]
    while todo:
        for pid in children.get(todo.pop(), ()):
            found.append(pid)
            todo.append(pid)
    return found


def _signal_descendants(root: int, signum: int) -> bool:
    """Send ``signum`` to every process below ``root``; whether there was any."""
    found = descendants(root)
    for pid in found:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)
    return bool(found)


def _reap_exited() -> bool:
    """Reap the children that have exited; whether any child is left."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return False
        if pid == 0:
            return True


def _kill_descendants(root: int) -> None:
    """SIGKILL everything below ``root`` (this process) until nothing is left: the orphans of the killed come
    back to this subreaper and are killed in the next round."""
    while True:
        _signal_descendants(root, signal.SIGKILL)
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return


def start_time(pid: int) -> int | None:
    """When the process started (clock ticks after boot), which tells it from a later one with the same pid;
    None when there is no such process (or no /proc)."""
    fields = _stat(pid)
    return int(fields[19]) if fields is not None else None


@contextlib.contextmanager
def _no_ttou() -> Iterator[None]:
    """A process outside the foreground group that sets the foreground group gets SIGTTOU, which stops it,
    unless it blocks it."""
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTTOU})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def give_terminal(terminal: int, group: int) -> None:
    with _no_ttou():
        os.tcsetpgrp(terminal, group)
