"""``preemptd exec`` holds a first SIGTERM that comes during a termination notice until the command has
recorded its emergency checkpoint (or ``--hold-max`` passes), and passes it on at once otherwise: a real agent
on a temporary socket with a drill, a real exec, and a command that logs what it gets and when it records."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import textwrap
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from agent.client import EXIT_PREEMPTED
from tests.lazy import needs_torch
from tests.support import REPO, eventually, http_json, running_agent

# Logs "TERM" when it gets SIGTERM (then exits 1, as torchrun does when its workers fail); records its
# emergency checkpoint of step 7 and logs "recorded" once the file named "save" appears.
_CHILD = textwrap.dedent(
    """
    import os, signal, sys, time
    from agent.client.preempted import record_emergency
    log, save = sys.argv[1], sys.argv[2]
    def write(word):
        with open(log, "a") as handle:
            handle.write(word + "\\n")
    def on_term(signum, frame):
        write("TERM")
        sys.exit(1)
    signal.signal(signal.SIGTERM, on_term)
    print("ready", flush=True)
    while not os.path.exists(save):
        time.sleep(0.02)
    record_emergency(7, path="/ckpt/step-7", notice_id=sys.argv[3] if len(sys.argv) > 3 else None)
    write("recorded")
    while True:
        time.sleep(0.02)
    """
)


class Exec:
    """A running ``preemptd exec -- python child.py``: its stderr read line by line, the child's log."""

    def __init__(self, proc: asyncio.subprocess.Process, base: Path) -> None:
        self.proc = proc
        self.log = base / "child.log"
        self.save = base / "save"
        self.errors: list[str] = []

    def logged(self) -> list[str]:
        return self.log.read_text().split() if self.log.exists() else []

    async def stderr_until(self, needle: str, timeout: float = 20.0) -> str:
        async def read() -> str:
            assert self.proc.stderr is not None
            while True:
                for line in self.errors:
                    if needle in line:
                        return line
                got = await self.proc.stderr.readline()
                if not got:
                    raise AssertionError(f"exec's stderr ended before {needle!r}: {self.errors}")
                self.errors.append(got.decode().rstrip("\n"))

        return await asyncio.wait_for(read(), timeout)

    async def finish(self, timeout: float = 30.0) -> tuple[int, str]:
        assert self.proc.stderr is not None
        rest = await asyncio.wait_for(self.proc.stderr.read(), timeout)
        code = await asyncio.wait_for(self.proc.wait(), timeout)
        self.errors.extend(rest.decode().splitlines())
        return code, "\n".join(self.errors)


@asynccontextmanager
async def exec_child(
    base: Path, *flags: str, socket: Path | None = None, notice: str = "", launcher: tuple[str, ...] = ()
) -> AsyncIterator[Exec]:
    script = base / "child.py"
    script.write_text(_CHILD)
    environ = {k: v for k, v in os.environ.items() if not k.startswith("PREEMPTD_")}
    environ.update(PYTHONPATH=str(REPO), GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "agent", "exec", "--socket", str(socket or base / "a.sock"), *flags, "--",
        *(launcher or (sys.executable,)), str(script), str(base / "child.log"), str(base / "save"), *([notice] if notice else []),
        env=environ, cwd=str(REPO), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    running = Exec(proc, base)
    try:
        assert proc.stdout is not None
        assert b"ready\n" == await asyncio.wait_for(proc.stdout.readline(), 20)
        yield running
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def _drill(base: Path, in_s: float = 120) -> str:
    status, body = await http_json(
        base / "a.sock", "POST", "/v1/drills", {"kind": "termination", "in_s": in_s}
    )
    assert status == 201, body
    return str(body["notice"]["id"])


async def test_sigterm_during_a_notice_waits_for_the_emergency_record(base: Path) -> None:
    """The child gets SIGTERM only after it recorded its checkpoint; exec exits 75 and says how long it held."""
    async with running_agent(base):
        notice = await _drill(base)
        async with exec_child(base, notice=notice) as run:
            run.proc.send_signal(signal.SIGTERM)
            held = await run.stderr_until("holding SIGTERM back")
            during = run.logged()
            run.save.touch()
            code, err = await run.finish()
    released = [line for line in err.splitlines() if "passed the held SIGTERM" in line]
    assert (
        [],
        True,
        ["recorded", "TERM"],
        EXIT_PREEMPTED,
        1,
        True,
    ) == (
        during,
        notice in held,
        run.logged(),
        code,
        len(released),
        "recorded its emergency checkpoint (step 7)" in released[0],
    ), err


async def test_without_a_notice_sigterm_passes_at_once_and_silently(base: Path) -> None:
    async with running_agent(base), exec_child(base) as run:
        run.proc.send_signal(signal.SIGTERM)
        code, err = await run.finish()
    assert (["TERM"], 1, "") == (run.logged(), code, err)


async def test_no_hold_passes_sigterm_at_once_during_a_notice(base: Path) -> None:
    async with running_agent(base):
        await _drill(base)
        async with exec_child(base, "--no-hold") as run:
            run.proc.send_signal(signal.SIGTERM)
            code, err = await run.finish()
    assert (["TERM"], 1, "") == (run.logged(), code, err)


@pytest.mark.slow
async def test_hold_max_passes_sigterm_on_when_no_record_comes(base: Path) -> None:
    async with running_agent(base):
        await _drill(base)
        async with exec_child(base, "--hold-max", "1") as run:
            run.proc.send_signal(signal.SIGTERM)
            held = await run.stderr_until("holding SIGTERM back")
            during = run.logged()
            released = await run.stderr_until("passed the held SIGTERM")
            code, _ = await run.finish()
    assert ([], "at most 1 s" in held, "--hold-max passed" in released, ["TERM"], 1) == (
        during,
        True,
        True,
        run.logged(),
        code,
    )


async def test_an_unreachable_agent_passes_sigterm_at_once_and_says_so(base: Path) -> None:
    async with exec_child(base, socket=base / "nobody.sock") as run:
        run.proc.send_signal(signal.SIGTERM)
        code, err = await run.finish()
    assert (["TERM"], 1, True) == (
        run.logged(),
        code,
        "passed SIGTERM on to the command at once: the agent is not reachable" in err,
    ), err


async def test_a_second_sigterm_during_the_hold_passes_at_once(base: Path) -> None:
    async with running_agent(base):
        await _drill(base)
        async with exec_child(base) as run:
            run.proc.send_signal(signal.SIGTERM)
            await run.stderr_until("holding SIGTERM back")
            during = run.logged()
            run.proc.send_signal(signal.SIGTERM)
            released = await run.stderr_until("passed the held SIGTERM")
            code, _ = await run.finish()
    assert ([], ["TERM"], 1, True) == (during, run.logged(), code, "a second SIGTERM came" in released)


async def test_a_checkpoint_already_recorded_for_the_notice_lets_sigterm_pass_at_once(base: Path) -> None:
    async with running_agent(base):
        notice = await _drill(base)
        async with exec_child(base, notice=notice) as run:
            run.save.touch()
            await eventually(lambda: run.logged() == ["recorded"], what="the child's record")
            run.proc.send_signal(signal.SIGTERM)
            code, err = await run.finish()
    assert (["recorded", "TERM"], EXIT_PREEMPTED, False) == (run.logged(), code, "holding" in err), err


@needs_torch
@pytest.mark.torch_mp
@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_under_torchrun_the_worker_gets_sigterm_only_after_its_record(base: Path) -> None:
    """The real torchrun between exec and the worker: it hears of the SIGTERM only once the worker has recorded
    its checkpoint, passes it on, exits 1 for the failed worker, and exec exits 75."""
    torchrun = (sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1")
    async with running_agent(base):
        notice = await _drill(base)
        async with exec_child(base, notice=notice, launcher=torchrun) as run:
            run.proc.send_signal(signal.SIGTERM)
            await run.stderr_until("holding SIGTERM back")
            during = run.logged()
            run.save.touch()
            code, err = await run.finish(timeout=60)
    assert ([], ["recorded", "TERM"], EXIT_PREEMPTED, True) == (
        during,
        run.logged(),
        code,
        "recorded its emergency checkpoint (step 7)" in err,
    ), err[-3000:]
