"""``preemptd exec -- COMMAND…``: run a training command so that its "preempted" exit status (75) reaches the
scheduler even through a launcher that would turn it into another status (torchrun exits 1 when its workers
exit 75), and so that nothing the command started outlives exec.

The command runs in its own process group, with ``PREEMPTD_EXEC_DIR`` naming a private directory. Signals
that exec receives are forwarded to that group (or to the command alone with ``--no-group``), except a first
SIGTERM during a termination notice, held until the command has recorded its emergency checkpoint
(:mod:`agent.cli.exec_hold`, ``--hold-max``, ``--no-hold``). When the
command ends, exec exits with its status (128 + N for a command killed by signal N) — except when the status
is not 0 and a process of the command recorded in the directory that it committed an emergency checkpoint
(:mod:`agent.client.preempted`): then exec exits 75. Standard library only, so it starts fast.

Process tree (Linux)::

    exec ── keeper (child subreaper) ── COMMAND ── its workers, in any process group or session
            │                            └ dies with the keeper (parent-death signal SIGKILL)
            └ parent-death signal: when exec dies, the keeper SIGKILLs everything below it

Every process the command starts stays below the keeper, whatever its session, because an orphan goes to the
nearest subreaper. When the command exits, the keeper sends SIGTERM (and SIGCONT) to what is left, waits up to
``--stop-grace`` seconds and SIGKILLs the rest, and only then exits, so exec's own exit means the command's
whole tree is gone. Caveats: a parent-death signal is sent when the parent *thread* that forked the process
exits (exec and the keeper are single-threaded, so that is the process) and is cleared by the execution of
a set-user-ID program; a keeper that is itself SIGKILLed takes the command with it, but the command's workers
then go to init. The channel directory's name holds exec's boot, PID namespace, pid and start time, so the
next exec removes the directories of execs that are gone (and only those).

At a terminal (stdin is one and exec is in its foreground), the command's group is made the foreground
group so that it can read the terminal and gets Ctrl-C directly; Ctrl-Z stops the command and then exec, so
the shell sees a stopped job that ``fg`` or ``bg`` continues; exec takes the terminal back when the command
ends, if the command still has it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import signal
import sys
import tempfile
from collections.abc import Iterable, Sequence
from typing import Any, TextIO

from agent.cli.exec_child import (
    EXIT_CANNOT_RUN,
    EXIT_NOT_FOUND,
    Keeper,
    give_terminal,
    load_prctl,
    start_time,
)
from agent.cli.exec_hold import HOLD_MAX_S, Forwarder, Hold
from agent.client.preempted import ENV, read_records
from agent.client.reporting import ELASTIC_NODES_ENV

EXIT_PREEMPTED = 75  # the client's EXIT_PREEMPTED (EX_TEMPFAIL); kept here so exec does not import more
STOP_GRACE_S = 10.0
_TORCHRUN_MODULES = ("torch.distributed.run", "torch.distributed.launch")
SHARED_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"

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
# tempfile.mkdtemp's name: this prefix, then exec's channel_owner (where it can be told), then random.
CHANNEL_PREFIX = "preemptd-exec-"
_CHANNEL_NAME = re.compile(re.escape(CHANNEL_PREFIX) + r"([0-9a-f]{12}-\d+)-(\d+)-(\d+)-[a-z0-9_]+")


_HELP = "run a training command; exit 75 when it stopped for a notice after an emergency checkpoint"
_DESCRIPTION = (
    "Run COMMAND (e.g. torchrun …) in its own process group, forward signals to it and exit with its "
    "status; when it fails after one of its processes committed an emergency checkpoint for a notice, exit "
    "75 (EX_TEMPFAIL) so the scheduler requeues the job. Nothing the command started outlives exec."
)


def register(subparsers: Any) -> None:
    _configure(subparsers.add_parser("exec", help=_HELP, description=_DESCRIPTION))


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0 <= value <= 3600:
        raise argparse.ArgumentTypeError(f"{text} is outside 0…3600 seconds")
    return value


def _configure(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--no-group",
        dest="group",
        action="store_false",
        help="forward signals to the command's own process only, not to its process group",
    )
    p.add_argument(
        "--stop-grace",
        type=_seconds,
        default=STOP_GRACE_S,
        metavar="SECONDS",
        help="when the command has exited, how long the processes it left running get after SIGTERM before "
        f"SIGKILL (default {STOP_GRACE_S:g})",
    )
    p.add_argument(
        "--hold-max",
        type=_seconds,
        default=HOLD_MAX_S,
        metavar="SECONDS",
        help="how long a first SIGTERM that comes during a termination notice, before the command has recorded "
        "its emergency checkpoint, is held back from it (never past the notice's deadline; default "
        f"{HOLD_MAX_S:g})",
    )
    p.add_argument(
        "--no-hold",
        dest="hold",
        action="store_false",
        help="pass every SIGTERM on at once, even while the command saves for a notice",
    )
    p.add_argument("--socket", metavar="PATH", help="the agent's socket, asked about notices on SIGTERM")
    p.add_argument("command", nargs=argparse.REMAINDER, metavar="-- COMMAND …")
    p.set_defaults(func=cmd_exec)


def main(argv: Sequence[str]) -> int:
    """``preemptd exec`` without building the whole CLI: the wrapper of a job should start in milliseconds
    and hold no more than it needs while the job runs."""
    from agent.cli import help as cli_help  # standard library only, like this module

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
    return run(
        command,
        group=args.group,
        stop_grace=args.stop_grace,
        hold=args.hold,
        hold_max=args.hold_max,
        socket=args.socket,
    )


def run(
    command: Sequence[str],
    *,
    group: bool = True,
    stop_grace: float = STOP_GRACE_S,
    stderr: TextIO | None = None,
    hold: bool = True,
    hold_max: float = HOLD_MAX_S,
    socket: str | None = None,
) -> int:
    """Run ``command`` as described in the module docstring and return the status exec should exit with.
    It forks: call it from a process that runs no other thread."""
    err = stderr or sys.stderr
    remove_stale_channels()
    channel = _new_channel()
    env = dict(os.environ)
    env[ENV] = channel
    nodes = _elastic(command) if _is_torchrun(command) else None
    if nodes:
        env[ELASTIC_NODES_ENV] = nodes  # the ranks' registration says the job is elastic, and its MIN
        # torchrun's agents share one store with their workers by default, served by the first round's rank 0
        # on a port the other agents keep: once that node has left (a shrink), a later round (a grow) waits on
        # a store no one writes to. Without sharing, each round's rank 0 serves a fresh one.
        env.setdefault(SHARED_STORE_ENV, "1")
    terminal = _Terminal.of_this_process()
    prctl = load_prctl()
    holding = Hold(channel, enabled=hold, hold_max=hold_max, socket=socket)
    forwarder = Forwarder(group, holding, err, FORWARDED)
    forwarder.install()
    reports, report_to = os.pipe()
    try:
        keeper = os.fork()
        if keeper == 0:  # the keeper; it never returns
            os.close(reports)
            tty = terminal.fd if terminal else None
            Keeper(command, env, group, tty, stop_grace, channel, report_to, prctl, FORWARDED).main()
        os.close(report_to)
        code, problem = _follow(reports, forwarder, terminal, keeper)
        died = _reap(keeper)
        if code is None:
            code = -signal.SIGKILL  # the command was killed with its keeper (parent-death signal)
            problem = (
                f"preemptd exec: its keeper process {keeper} {_how(died)}; the command was killed with it"
            )
    finally:
        os.close(reports)
        if terminal:
            terminal.take_back()
        forwarder.restore()
        records = read_records(channel)
        shutil.rmtree(channel, ignore_errors=True)
    if problem:
        print(problem, file=err)
        if code in (EXIT_NOT_FOUND, EXIT_CANNOT_RUN):
            return code
    return decide(code, records, command, err)


def _follow(
    reports: int, forwarder: Forwarder, terminal: _Terminal | None, keeper: int
) -> tuple[int | None, str | None]:
    """Act on the keeper's reports until it closes the pipe: (the command's exit code, a problem to print).
    Between reports, the forwarder decides on a SIGTERM it may hold."""
    code: int | None = None
    problem: str | None = None
    buffer = b""
    while True:
        if not forwarder.wait(reports):
            continue
        chunk = os.read(reports, 65536)
        if not chunk:
            return code, problem
        *lines, buffer = (buffer + chunk).split(b"\n")
        for line in lines:
            kind, _, rest = line.decode(errors="surrogateescape").partition(" ")
            if kind == "pid":
                forwarder.started(int(rest))
                if terminal:  # the command's process group, or the keeper's that it runs in (--no-group)
                    terminal.lent_to = int(rest) if forwarder.group else keeper
            elif kind == "stopped" and terminal:
                terminal.stop_with_the_command()
            elif kind == "exit":
                code = int(rest)
                forwarder.command_ended()
                if terminal:  # now: the keeper may spend the grace on stragglers
                    terminal.take_back()
            elif kind == "error":
                number, _, problem = rest.partition(" ")
                code = int(number)


def _reap(keeper: int) -> int:
    """Wait for the keeper; its exit status. As PID 1 of a container, also reap the orphans the kernel hands
    to this process (the keeper's, should it die), so they do not linger as zombies."""
    while True:
        pid, status = os.waitpid(-1 if os.getpid() == 1 else keeper, 0)
        if pid == keeper:
            return os.waitstatus_to_exitcode(status)


def _how(code: int) -> str:
    return f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"


class _Terminal:
    """The terminal on stdin that a shell started exec in the foreground of, and the process group exec lent
    it to (the command's child sets that group as the foreground before it runs the command)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.lent_to: int | None = None

    @classmethod
    def of_this_process(cls) -> _Terminal | None:
        """None when stdin is no terminal or exec runs in the background: the terminal is left alone."""
        try:
            return cls(0) if os.isatty(0) and os.tcgetpgrp(0) == os.getpgrp() else None
        except OSError:
            return None

    def take_back(self) -> None:
        """Make exec's group the foreground group again — only from the group exec lent it to: after Ctrl-Z
        and ``bg`` the shell holds the terminal, and it stays the shell's."""
        with contextlib.suppress(OSError):
            if self.lent_to is not None and os.tcgetpgrp(self.fd) == self.lent_to:
                give_terminal(self.fd, os.getpgrp())

    def stop_with_the_command(self) -> None:
        """The command was stopped from the terminal (Ctrl-Z): stop exec too, so that its shell sees a stopped
        job and takes the terminal. Once continued, lend the terminal to the command again if exec has it
        (``fg``; not after ``bg``), and continue the command."""
        if self.lent_to is None:
            return
        self.take_back()
        os.kill(os.getpid(), signal.SIGSTOP)  # not SIGTSTP: the kernel drops it for an orphaned process group
        with contextlib.suppress(OSError):
            if os.tcgetpgrp(self.fd) == os.getpgrp():
                give_terminal(self.fd, self.lent_to)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.lent_to, signal.SIGCONT)


# -- the channel directory ----------------------------------------------------------------------------------


def channel_owner(pid: int) -> str | None:
    """``BOOT-PIDNS-PID-START`` of a process of this host and PID namespace: which exec a channel directory
    belongs to, told apart from a later process with the same pid, and from execs of other hosts or
    containers that share the temporary directory (NFS, a shared volume). None when it cannot be told."""
    started = start_time(pid)
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as handle:
            boot = handle.read().strip().replace("-", "")[:12]
        namespace = os.readlink("/proc/self/ns/pid")  # "pid:[4026531836]"
    except OSError:
        return None
    inode = namespace[namespace.find("[") + 1 : -1]
    if started is None or not inode.isdigit():
        return None
    return f"{boot}-{inode}-{pid}-{started}"


def _new_channel() -> str:
    owner = channel_owner(os.getpid())
    return tempfile.mkdtemp(prefix=f"{CHANNEL_PREFIX}{owner}-" if owner else CHANNEL_PREFIX)


def remove_stale_channels(directory: str | None = None) -> list[str]:
    """Remove this user's channel directories whose exec is gone (SIGKILLed before it could remove its own);
    the names of those removed. A directory of a live exec, of another host or PID namespace, or whose owner
    cannot be told is left alone."""
    here = channel_owner(os.getpid())
    if here is None:
        return []
    scope = here.rsplit("-", 2)[0]
    removed: list[str] = []
    try:
        entries = list(os.scandir(directory or tempfile.gettempdir()))
    except OSError:
        return removed
    for entry in entries:
        match = _CHANNEL_NAME.fullmatch(entry.name)
        if match is None or match.group(1) != scope:
            continue
        try:
            if not entry.is_dir(follow_symlinks=False) or entry.stat().st_uid != os.getuid():
                continue
        except OSError:
            continue
        owner = f"{scope}-{match.group(2)}-{match.group(3)}"
        if channel_owner(int(match.group(2))) == owner:
            continue  # its exec is running
        shutil.rmtree(entry.path, ignore_errors=True)
        removed.append(entry.name)
    return removed


# -- the decision -------------------------------------------------------------------------------------------


def decide(code: int, records: list[dict[str, Any]], command: Sequence[str], err: TextIO) -> int:
    """exec's exit status for a command that ended with ``code`` after writing ``records``."""
    if code in (0, EXIT_PREEMPTED):
        return code
    if not records:
        return 128 - code if code < 0 else code
    if _is_torchrun(command):
        print(
            "preemptd exec: torchrun's ChildFailedError traceback above reports workers that exited "
            f"{EXIT_PREEMPTED} for a notice: expected after a preemption",
            file=err,
        )
    print(
        f"preemptd exec: {os.path.basename(command[0])} {_how(code)} after {_what_was_saved(records)}: "
        f"exiting {EXIT_PREEMPTED} so the job is requeued",
        file=err,
    )
    return EXIT_PREEMPTED


def _what_was_saved(records: list[dict[str, Any]]) -> str:
    """What the records say: emergency checkpoints committed, and emergency saves that failed and handed the
    notice to an earlier committed step (the store's ``fallback`` records, e.g. on a full disk)."""
    saved = [r for r in records if not r.get("fallback")]
    fell = [r for r in records if r.get("fallback")]
    notices = _listed(r.get("notice_id") for r in records)
    parts = []
    if saved:
        steps = _listed(r["step"] for r in saved)
        notice = f", notice {notices}" if notices and not fell else ""
        parts.append(
            f"{len(saved)} of its processes committed an emergency checkpoint (step {steps}{notice})"
        )
    if fell:
        error = next((str(r["error"]) for r in fell if r.get("error")), "")
        parts.append(
            f"{len(fell)} of its processes could not save step {_listed(r.get('failed_step') for r in fell)}"
            + (f" ({error.splitlines()[0][:200]})" if error else "")
            + f" and fell back to the committed step {_listed(r['step'] for r in fell)}"
            + (f" (notice {notices})" if notices else "")
        )
    return " and ".join(parts)


def _listed(values: Iterable[Any]) -> str:
    """The distinct values (None left out), numbers in numeric order, comma-separated."""
    distinct = {v for v in values if v is not None}
    return ", ".join(
        str(v) for v in sorted(distinct, key=lambda v: (0, v, "") if isinstance(v, int) else (1, 0, str(v)))
    )


def _elastic(command: Sequence[str]) -> str | None:
    """``MIN:MAX`` when torchrun was told ``--nnodes MIN:MAX``: its membership may change while it runs."""
    for index, word in enumerate(command):
        value = command[index + 1] if word == "--nnodes" and index + 1 < len(command) else ""
        if word.startswith("--nnodes="):
            value = word.partition("=")[2]
        low, colon, high = value.partition(":")
        if colon and low != high:
            return value
    return None


def _is_torchrun(command: Sequence[str]) -> bool:
    """``torchrun …`` or ``python -m torch.distributed.run …`` (or the older ``…launch``)."""
    return os.path.basename(command[0]) == "torchrun" or any(
        word in _TORCHRUN_MODULES for word in command[1:3]
    )
