"""How ``preemptd exec`` passes signals on to the command, and the hold: a first SIGTERM that arrives while
the agent has an active termination notice and the command has not yet recorded its emergency checkpoint for
it is kept back until that record appears, ``--hold-max`` seconds pass or the notice's deadline comes,
whichever is first. A launcher such as torchrun SIGKILLs its workers 30 s after its own SIGTERM, so a
scheduler's early SIGTERM would otherwise start that clock in the middle of the save. Standard library only.

The signal handlers only note what arrived and wake exec's main loop (a pipe); asking the agent, reading the
records and printing happen in :meth:`Forwarder.poll`, called from that loop.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import time
from collections.abc import Callable, Iterable
from typing import Any, TextIO

from agent.client.preempted import SIGNALLED, read_records
from agent.client.transport import AgentHTTPError, AgentUnavailable, request_json

HOLD_MAX_S = 90.0
AGENT_TIMEOUT_S = 2.0  # asking the agent whether a notice is active, on the first SIGTERM
POLL_S = 0.2  # how often the records are read while a SIGTERM is held
HOLDING_KINDS = ("termination", "maintenance")  # notices after which the host or its workload goes away
# What a person sends to insist: passed on at once, and a held SIGTERM with it.
_INSISTING = tuple(getattr(signal, n) for n in ("SIGTERM", "SIGINT", "SIGQUIT") if hasattr(signal, n))


# Signals that stop the command: exec notes their arrival in the channel directory.
_STOPPING = frozenset({signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT})


class Hold:
    """The hold's settings: ``enabled`` (not ``--no-hold``), ``hold_max`` seconds, the agent's socket (None:
    the client's default) and the channel directory whose records end it."""

    def __init__(
        self, channel: str, *, enabled: bool = True, hold_max: float = HOLD_MAX_S, socket: str | None = None
    ) -> None:
        self.channel = channel
        self.enabled = enabled and hold_max > 0
        self.hold_max = hold_max
        self.socket = socket

    def notices(self) -> tuple[list[dict[str, Any]], str | None]:
        """The agent's active notices of a holding kind, and why the agent could not be asked (or None)."""
        try:
            doc = request_json("GET", "/v1/status", socket_path=self.socket, timeout=AGENT_TIMEOUT_S)
        except AgentUnavailable as exc:
            return [], f"the agent is not reachable ({exc})"
        except (AgentHTTPError, OSError, ValueError) as exc:
            return [], f"the agent did not answer ({exc or type(exc).__name__})"
        found = doc.get("notices") if isinstance(doc, dict) else None
        return [
            n
            for n in (found if isinstance(found, list) else [])
            if isinstance(n, dict) and n.get("kind") in HOLDING_KINDS and not n.get("cleared_at")
        ], None

    def recorded(self, notice_ids: Iterable[str]) -> list[dict[str, Any]]:
        """The records of an emergency checkpoint (or its fallback) for one of these notices, or for no
        notice named."""
        ids = set(notice_ids)
        return [r for r in read_records(self.channel) if r.get("notice_id") in ids or not r.get("notice_id")]


class Forwarder:
    """Signal handlers that pass each signal on to the command (its process group, or only its process
    with ``group`` False); signals that arrive before it has started are kept and passed on as soon as it
    has. The first SIGTERM may be held (see the module docstring)."""

    def __init__(
        self, group: bool, hold: Hold | None = None, err: TextIO | None = None, signals: Iterable[int] = ()
    ) -> None:
        self.group = group
        self.hold = hold
        self.err = err
        self.signals = tuple(signals)
        self.pid: int | None = None
        self.pending: list[int] = []
        self.previous: dict[int, Any] = {}
        self.state = "idle"  # then "asking" (a SIGTERM to decide on), "holding", "done" (no more holds)
        self.insisted: int | None = None
        self.since = 0.0
        self.until = 0.0
        self.about = ""
        self.notice_ids: list[str] = []
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        os.set_blocking(self._wake_r, False)
        self.clock: Callable[[], float] = time.monotonic

    def install(self) -> None:
        for signum in self.signals:
            self.previous[signum] = signal.signal(signum, self._handle)

    def restore(self) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    def started(self, pid: int) -> None:
        self.pid = pid
        pending, self.pending = self.pending, []
        for signum in pending:
            self.forward(signum)

    def _handle(self, signum: int, frame: object) -> None:
        if signum in _STOPPING and self.hold is not None:
            # The command is being stopped from outside (a scheduler, a person): its processes can tell this
            # from a signal their own launcher sends them (agent/client/preempted.py: stopped_from_outside).
            with contextlib.suppress(OSError):
                os.close(os.open(os.path.join(self.hold.channel, SIGNALLED), os.O_WRONLY | os.O_CREAT, 0o600))
        if self.pid is None:
            self.pending.append(signum)
            if signum == signal.SIGTERM:
                self.state = "done"  # nothing has been saved before the command started
            return
        if signum == signal.SIGTERM and self.state == "idle" and self.hold is not None and self.hold.enabled:
            self.state = "asking"
        elif self.state in ("asking", "holding") and signum in _INSISTING:
            self.forward(signum)
            self.insisted = signum
        else:
            self.forward(signum)
            if signum == signal.SIGTERM:
                self.state = "done"
            return
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"\0")

    def forward(self, signum: int) -> None:
        if self.pid is None:
            return
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

    def wait(self, fd: int) -> bool:
        """Wait until ``fd`` is readable (True) or the hold needs a look (False), and act on the hold."""
        timeout = None if self.state not in ("asking", "holding") else POLL_S
        readable, _, _ = select.select([fd, self._wake_r], [], [], timeout)
        if self._wake_r in readable:
            with contextlib.suppress(OSError):
                os.read(self._wake_r, 4096)
        self.poll()
        return fd in readable

    def poll(self) -> None:
        """Decide on a SIGTERM just noted, or end a hold whose reason has passed."""
        if self.state == "asking":
            self._decide()
        if self.state != "holding":
            return
        held = f"{self.clock() - self.since:.1f} s"
        if self.insisted is not None:
            name = signal.Signals(self.insisted).name
            self._release(
                f"after {held}: a {'second ' if self.insisted == signal.SIGTERM else ''}{name} came"
            )
            return
        assert self.hold is not None
        records = self.hold.recorded(self.notice_ids)
        if records:
            steps = ", ".join(sorted({str(r.get("step")) for r in records}))
            self._release(f"after {held}: the command recorded its emergency checkpoint (step {steps})")
        elif self.clock() >= self.until:
            self._release(f"after {held}: {self.about}, and no emergency checkpoint was recorded")

    def command_ended(self) -> None:
        if self.state == "holding":
            self._say(f"the command ended while its SIGTERM was held ({self.clock() - self.since:.1f} s)")
        self.state = "done"

    def _decide(self) -> None:
        assert self.hold is not None
        notices, problem = self.hold.notices()
        if self.insisted is not None:  # a second signal came while the agent was asked
            if self.insisted != signal.SIGTERM:
                self.forward(signal.SIGTERM)
            self.state = "done"
            return
        live = [n for n in notices if _seconds_left(n) != 0.0]
        ids = [str(n.get("id")) for n in live]
        if problem or not live or self.hold.recorded(ids):
            self.forward(signal.SIGTERM)
            self.state = "done"
            if problem:
                self._say(f"passed SIGTERM on to the command at once: {problem}")
            return
        left = [s for s in map(_seconds_left, live) if s is not None]
        bound = min([self.hold.hold_max, *left])
        self.about = (
            "the notice's deadline came" if left and min(left) < self.hold.hold_max else "--hold-max passed"
        )
        self.since = self.clock()
        self.until = self.since + bound
        self.notice_ids = ids
        self.state = "holding"
        first = live[0]
        self._say(
            f"holding SIGTERM back from the command while it saves for notice {first.get('id')} "
            f"({first.get('kind')}{', drill' if first.get('drill') else ''}): until it records its emergency "
            f"checkpoint, at most {bound:.0f} s (a second SIGTERM passes at once)"
        )

    def _release(self, why: str) -> None:
        if self.insisted is None or self.insisted != signal.SIGTERM:
            self.forward(signal.SIGTERM)
        self.state = "done"
        self._say(f"passed the held SIGTERM on to the command {why}")

    def _say(self, line: str) -> None:
        if self.err is not None:
            print(f"preemptd exec: {line}", file=self.err, flush=True)


def _seconds_left(notice: dict[str, Any]) -> float | None:
    value = notice.get("seconds_left")
    return max(0.0, float(value)) if isinstance(value, (int, float)) else None
