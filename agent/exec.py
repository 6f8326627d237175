"""``preemptd exec -- COMMAND…``: run a training command so that its "preempted" exit status (75) reaches the
scheduler even through a launcher that would turn it into another status (torchrun exits 1 when its workers
exit 75).

The command runs in its own process group, with ``PREEMPTD_EXEC_DIR`` naming a private directory. Signals
that exec receives are forwarded to that group (or to the command alone with ``--no-group``). When the
command ends, exec exits with its status (128 + N for a command killed by signal N) — except when the status
is not 0 and a process of the command recorded in the directory that it committed an emergency checkpoint
(:mod:`agent.client.preempted`): then exec exits 75. Standard library only, so it starts fast.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from typing import Any, TextIO

from agent.client.preempted import ENV, read_records

EXIT_PREEMPTED = 75  # the client's EXIT_PREEMPTED (EX_TEMPFAIL); kept here so exec does not import more
EXIT_CANNOT_RUN = 126
EXIT_NOT_FOUND = 127

# Everything a scheduler, a container runtime or a user may send to stop, warn or poke the job. SIGCHLD, the
# job-control stops and SIGKILL are not forwarded (the last two cannot be caught).
FORWARDED = tuple(
    getattr(signal, name)
    for name in (
        "SIGTERM",
        "SIGINT",
        "SIGHUP",
        "SIGQUIT",
        "SIGUSR1",
        "SIGUSR2",
        "SIGALRM",
        "SIGWINCH",
        "SIGPWR",
        "SIGXCPU",
    )
    if hasattr(signal, name)
)


_HELP = "run a training command; exit 75 when it stopped for a notice after an emergency checkpoint"
_DESCRIPTION = (
    "Run COMMAND (e.g. torchrun …) in its own process group, forward signals to it and exit with its "
    "status; when it fails after one of its processes committed an emergency checkpoint for a notice, exit "
    "75 (EX_TEMPFAIL) so the scheduler requeues the job."
)


def register(subparsers: Any) -> None:
    _configure(subparsers.add_parser("exec", help=_HELP, description=_DESCRIPTION))


def _configure(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--no-group",
        dest="group",
        action="store_false",
        help="forward signals to the command's own process only, not to its process group",
    )
    p.add_argument("command", nargs=argparse.REMAINDER, metavar="-- COMMAND …")
    p.set_defaults(func=cmd_exec)


def main(argv: Sequence[str]) -> int:
    """``preemptd exec`` without building the whole CLI: the wrapper of a job should start in milliseconds
    and hold no more than it needs while the job runs."""
    from agent import cli_help  # standard library only, like this module

    parser = argparse.ArgumentParser(prog="preemptd exec", description=_DESCRIPTION)
    _configure(parser)
    cli_help.describe("exec", parser)
    return cmd_exec(parser.parse_args(argv))


def cmd_exec(args: argparse.Namespace) -> int:
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        print("preemptd exec: no command given (usage: preemptd exec -- COMMAND …)", file=sys.stderr)
        return 2
    return run(command, group=args.group)


class _Forwarder:
    """Signal handlers that pass each signal on to the command; signals that arrive before it has started
    are kept and passed on as soon as it has."""

    def __init__(self, group: bool) -> None:
        self.group = group
        self.pid: int | None = None
        self.pending: list[int] = []
        self.previous: dict[int, Any] = {}

    def install(self) -> None:
        for signum in FORWARDED:
            self.previous[signum] = signal.signal(signum, self._handle)

    def restore(self) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)

    def started(self, pid: int) -> None:
        self.pid = pid
        pending, self.pending = self.pending, []
        for signum in pending:
            self.forward(signum)

    def _handle(self, signum: int, frame: object) -> None:
        if self.pid is None:
            self.pending.append(signum)
        else:
            self.forward(signum)

    def forward(self, signum: int) -> None:
        assert self.pid is not None
        try:
            if self.group:
                try:
                    os.killpg(self.pid, signum)
                    return
                except ProcessLookupError:
                    pass  # the group leader has not called setpgid yet, or the group is gone
            os.kill(self.pid, signum)
        except ProcessLookupError:
            pass  # it has exited; its status is being collected


def run(
    command: Sequence[str],
    *,
    group: bool = True,
    stderr: TextIO | None = None,
) -> int:
    """Run ``command`` as described in the module docstring and return the status exec should exit with."""
    err = stderr or sys.stderr
    channel = tempfile.mkdtemp(prefix="preemptd-exec-")
    env = dict(os.environ)
    env[ENV] = channel
    forwarder = _Forwarder(group)
    forwarder.install()
    try:
        try:
            # The child makes its own process group so that a signal reaches torchrun *and* its workers, as
            # a terminal's Ctrl-C would. preexec_fn is safe here: this process runs no other threads.
            child = subprocess.Popen(
                list(command),
                env=env,
                preexec_fn=os.setpgrp if group else None,  # noqa: PLW1509
            )
        except FileNotFoundError:
            print(f"preemptd exec: {command[0]}: command not found", file=err)
            return EXIT_NOT_FOUND
        except PermissionError as exc:
            print(f"preemptd exec: {command[0]}: cannot run it: {exc.strerror}", file=err)
            return EXIT_CANNOT_RUN
        forwarder.started(child.pid)
        code = _wait(child)
    finally:
        forwarder.restore()
        records = read_records(channel)
        shutil.rmtree(channel, ignore_errors=True)
    return decide(code, records, command, err)


def _wait(child: subprocess.Popen[bytes]) -> int:
    """The command's exit code (negative: killed by that signal). As PID 1 of a container, also reap the
    orphans that the kernel hands to this process, so they do not linger as zombies."""
    if os.getpid() != 1:
        return child.wait()
    while True:
        pid, status = os.waitpid(-1, 0)
        if pid == child.pid:
            return os.waitstatus_to_exitcode(status)


def decide(code: int, records: list[dict[str, Any]], command: Sequence[str], err: TextIO) -> int:
    """exec's exit status for a command that ended with ``code`` after writing ``records``."""
    if code in (0, EXIT_PREEMPTED):
        return code
    if records:
        steps = sorted({int(r["step"]) for r in records})
        notices = sorted({str(r["notice_id"]) for r in records if r.get("notice_id")})
        how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
        print(
            f"preemptd exec: {os.path.basename(command[0])} {how} after {len(records)} of its processes "
            f"committed an emergency checkpoint (step {', '.join(map(str, steps))}"
            + (f", notice {', '.join(notices)}" if notices else "")
            + f"): exiting {EXIT_PREEMPTED} so the job is requeued",
            file=err,
        )
        return EXIT_PREEMPTED
    return 128 - code if code < 0 else code
