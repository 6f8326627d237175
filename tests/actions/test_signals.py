"""Signals to unmodified programs: real child processes that handle or ignore the signal."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import uuid
from collections.abc import AsyncIterator, Iterable, Mapping
from pathlib import Path
from typing import Any

import pytest

from agent.actions.common import Recent
from agent.actions.signals import SignalEngine, SignalRule
from agent.config import SignalRuleConfig
from agent.core.errors import ConfigError
from agent.core.notice import EventType, Kind, Severity
from agent.core.tasks import TaskSet
from tests.actions_support import HANDLER, IGNORER, Child, event, make_notice, write_pid_file

REPO = Path(__file__).resolve().parents[2]


class Harness:
    def __init__(self) -> None:
        self.tasks = TaskSet("test")
        self.recent = Recent(100)

    def engine(
        self,
        *rules: SignalRuleConfig,
        dry_run: bool = False,
        gpu: Mapping[str, Iterable[int]] | None = None,
        roots: Iterable[Path] | None = None,
    ) -> SignalEngine:
        async def gpu_pids() -> Mapping[str, Iterable[int]]:
            assert gpu is not None
            return gpu

        extra: dict[str, Any] = {"cgroup_roots": tuple(roots)} if roots is not None else {}
        return SignalEngine(
            (SignalRule.from_config(r, i) for i, r in enumerate(rules)),
            dry_run=dry_run,
            tasks=self.tasks,
            recent=self.recent,
            gpu_pids=gpu_pids if gpu is not None else None,
            **extra,
        )

    def outcomes(self) -> list[tuple[str, int | None, str, str]]:
        return [(r["outcome"], r["pid"], r["signal"], r["target"]) for r in self.recent.to_json()]


@pytest.fixture
async def harness() -> AsyncIterator[Harness]:
    h = Harness()
    yield h
    await h.tasks.close(2.0)


async def test_a_child_that_handles_sigusr1_gets_it_through_its_pid_file(
    harness: Harness, tmp_path: Path
) -> None:
    child = await Child.start(HANDLER, str(tmp_path / "got"))
    try:
        rule = SignalRuleConfig(
            name="lightning", signal="SIGUSR1", pid_files=(write_pid_file(tmp_path, child.pid),)
        )
        harness.engine(rule).handle(event(EventType.NOTICE, make_notice()))
        assert 0 == await child.wait()
        assert "SIGUSR1" == (tmp_path / "got").read_text()
    finally:
        await child.stop()


async def test_a_notice_is_signalled_once_even_when_it_updates(harness: Harness, tmp_path: Path) -> None:
    child = await Child.start(IGNORER)
    try:
        engine = harness.engine(SignalRuleConfig(pid_files=(write_pid_file(tmp_path, child.pid),)))
        notice = make_notice()
        engine.handle(event(EventType.NOTICE, notice))
        engine.handle(event(EventType.UPDATE, notice))
        await harness.tasks.drain()
        assert [("sent", child.pid, "SIGTERM", f"pidfile:{tmp_path / 'train.pid'}")] == harness.outcomes()
    finally:
        await child.stop()


async def test_a_child_that_ignores_the_signal_is_killed_by_the_escalation(
    harness: Harness, tmp_path: Path
) -> None:
    child = await Child.start(IGNORER)
    try:
        rule = SignalRuleConfig(pid_files=(write_pid_file(tmp_path, child.pid),), escalate_after_s=0.3)
        harness.engine(rule).handle(event(EventType.NOTICE, make_notice()))
        assert -signal.SIGKILL == await child.wait()
        await harness.tasks.drain()
        assert [("sent", "SIGTERM", False), ("sent", "SIGKILL", True)] == [
            (r["outcome"], r["signal"], r["escalation"]) for r in harness.recent.to_json()
        ]
    finally:
        await child.stop()


async def test_a_cleared_notice_cancels_the_pending_escalation(harness: Harness, tmp_path: Path) -> None:
    child = await Child.start(IGNORER)
    try:
        rule = SignalRuleConfig(pid_files=(write_pid_file(tmp_path, child.pid),), escalate_after_s=30)
        engine = harness.engine(rule)
        notice = make_notice()
        engine.handle(event(EventType.NOTICE, notice))
        await _recorded(harness)  # the first signal is recorded before the escalation wait
        engine.handle(event(EventType.CLEARED, notice))
        await harness.tasks.drain()
        assert child.proc.returncode is None
        assert ["sent"] == [r["outcome"] for r in harness.recent.to_json()]
    finally:
        await child.stop()


async def _recorded(harness: Harness) -> None:
    """Yield to the loop until the engine has recorded something (its task runs on this loop)."""
    for _ in range(10_000):
        if harness.recent.to_json():
            return
        await asyncio.sleep(0.001)
    raise AssertionError("nothing recorded")


async def test_dry_run_records_the_signal_without_sending_it(harness: Harness, tmp_path: Path) -> None:
    child = await Child.start(HANDLER, str(tmp_path / "got"))
    try:
        rule = SignalRuleConfig(pid_files=(write_pid_file(tmp_path, child.pid),), escalate_after_s=0.1)
        harness.engine(rule, dry_run=True).handle(event(EventType.NOTICE, make_notice()))
        await harness.tasks.drain()
        assert [("dry_run", child.pid)] == [(r["outcome"], r["pid"]) for r in harness.recent.to_json()]
        assert child.proc.returncode is None
        assert not (tmp_path / "got").exists()
    finally:
        await child.stop()


async def test_a_process_that_is_gone_is_reported_as_gone(harness: Harness, tmp_path: Path) -> None:
    child = await Child.start(IGNORER)
    await child.stop()
    harness.engine(SignalRuleConfig(pid_files=(write_pid_file(tmp_path, child.pid),))).handle(
        event(EventType.NOTICE, make_notice())
    )
    await harness.tasks.drain()
    assert ["gone"] == [r["outcome"] for r in harness.recent.to_json()]


async def test_a_missing_pid_file_is_a_target_error(harness: Harness, tmp_path: Path) -> None:
    harness.engine(SignalRuleConfig(pid_files=(tmp_path / "absent.pid",))).handle(
        event(EventType.NOTICE, make_notice())
    )
    await harness.tasks.drain()
    [record] = harness.recent.to_json()
    assert ("target_error", True) == (record["outcome"], "absent.pid" in record["error"])


async def test_an_unprivileged_agent_reports_permission_denied() -> None:
    """Run as nobody, the engine may not signal the test's (root) child: it says so instead of failing."""
    if os.geteuid() != 0:
        pytest.skip("needs root to run a child as another user")
    marker = f"unprivileged-{uuid.uuid4().hex}"
    child = await Child.start(IGNORER, marker)
    script = f"""
import asyncio, concurrent.futures.thread, json, os
from agent.actions.common import Recent
from agent.core.tasks import TaskSet
from agent.actions.signals import SignalEngine, SignalRule
from agent.config import SignalRuleConfig
from agent.core.notice import EventType
from tests.actions_support import event, make_notice
os.setgid(65534); os.setuid(65534)  # after the imports: the interpreter may live under /root
async def main():
    tasks, recent = TaskSet("t"), Recent(10)
    rule = SignalRule.from_config(SignalRuleConfig(cmdline=({marker!r},)), 0)
    SignalEngine([rule], dry_run=False, tasks=tasks, recent=recent).handle(event(EventType.NOTICE, make_notice()))
    await tasks.drain()
    print(json.dumps([r["outcome"] for r in recent.to_json()]))
asyncio.run(main())
"""
    try:
        repo = str(REPO)
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            script,
            stdout=asyncio.subprocess.PIPE,
            cwd=repo,
            env={**os.environ, "PYTHONPATH": repo},
        )
        out, _ = await asyncio.wait_for(proc.communicate(), 30)
        assert b'["permission_denied"]' == out.strip().splitlines()[-1]
        assert child.proc.returncode is None
    finally:
        await child.stop()


async def test_a_command_line_match_finds_a_program_that_never_heard_of_preemptd(
    harness: Harness, tmp_path: Path
) -> None:
    marker = f"train-{uuid.uuid4().hex}"
    child = await Child.start(HANDLER, str(tmp_path / "got"), marker)
    try:
        harness.engine(SignalRuleConfig(cmdline=(marker,))).handle(event(EventType.NOTICE, make_notice()))
        assert 0 == await child.wait()
        assert "SIGTERM" == (tmp_path / "got").read_text()
    finally:
        await child.stop()


async def test_gpu_compute_processes_are_signalled(harness: Harness, tmp_path: Path) -> None:
    child = await Child.start(HANDLER, str(tmp_path / "got"))
    try:
        engine = harness.engine(SignalRuleConfig(gpu_processes=True), gpu={"GPU-aaaa": [child.pid]})
        engine.handle(event(EventType.NOTICE, make_notice()))
        assert 0 == await child.wait()
        await harness.tasks.drain()
        assert [("sent", child.pid, "SIGTERM", "gpu:GPU-aaaa")] == harness.outcomes()
    finally:
        await child.stop()


async def test_gpu_scope_notice_signals_only_the_faulty_gpus_processes(harness: Harness) -> None:
    on_faulty = await Child.start(IGNORER)
    on_healthy = await Child.start(IGNORER)
    try:
        rule = SignalRuleConfig(kinds=("gpu_fault",), gpu_processes=True, gpu_scope="notice")
        engine = harness.engine(rule, gpu={"GPU-bad": [on_faulty.pid], "GPU-good": [on_healthy.pid]})
        engine.handle(event(EventType.NOTICE, make_notice(Kind.GPU_FAULT, detail={"uuid": "GPU-bad"})))
        await harness.tasks.drain()
        assert [on_faulty.pid] == [r["pid"] for r in harness.recent.to_json()]
    finally:
        await on_faulty.stop()
        await on_healthy.stop()


async def test_a_unit_target_reads_the_units_cgroup(harness: Harness, tmp_path: Path) -> None:
    """Without systemd to ask, the unit's cgroup is looked up under system.slice (here a fake cgroup root
    whose cgroup.procs, including a sub-cgroup's, hold the children)."""
    main = await Child.start(IGNORER)
    worker = await Child.start(IGNORER)
    try:
        unit = tmp_path / "system.slice" / "train.service"
        (unit / "worker").mkdir(parents=True)
        (unit / "cgroup.procs").write_text(f"{main.pid}\n")
        (unit / "worker" / "cgroup.procs").write_text(f"{worker.pid}\n")
        harness.engine(SignalRuleConfig(units=("train.service",)), roots=[tmp_path]).handle(
            event(EventType.NOTICE, make_notice())
        )
        await harness.tasks.drain()
        assert {main.pid, worker.pid} == {
            r["pid"] for r in harness.recent.to_json() if r["outcome"] == "sent"
        }
    finally:
        await main.stop()
        await worker.stop()


async def test_a_real_cgroup_v2_target(harness: Harness, tmp_path: Path) -> None:
    roots = [Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified")]
    root = next(
        (r for r in roots if (r / "cgroup.procs").exists() and (r / "cgroup.controllers").exists()), None
    )
    if root is None or not os.access(root, os.W_OK):
        pytest.skip("no writable cgroup v2 hierarchy here")
    group = root / f"preemptd-test-{uuid.uuid4().hex[:8]}"
    try:
        group.mkdir()
    except OSError as exc:
        pytest.skip(f"cannot create a cgroup: {exc}")
    child = await Child.start(HANDLER, str(tmp_path / "got"))
    try:
        try:
            (group / "cgroup.procs").write_text(str(child.pid))
        except OSError as exc:
            pytest.skip(f"cannot move a process into a cgroup: {exc}")
        harness.engine(SignalRuleConfig(cgroups=("/" + group.name,)), roots=[root]).handle(
            event(EventType.NOTICE, make_notice())
        )
        assert 0 == await child.wait()
        assert "SIGTERM" == (tmp_path / "got").read_text()
    finally:
        await child.stop()
        await harness.tasks.drain()
        group.rmdir()


async def test_a_rule_ignores_notices_below_its_severity(harness: Harness, tmp_path: Path) -> None:
    child = await Child.start(IGNORER)
    try:
        rule = SignalRuleConfig(min_severity="critical", pid_files=(write_pid_file(tmp_path, child.pid),))
        harness.engine(rule).handle(
            event(EventType.NOTICE, make_notice(Kind.MAINTENANCE, severity=Severity.WARNING))
        )
        await harness.tasks.drain()
        assert [] == harness.recent.to_json()
    finally:
        await child.stop()


def test_a_rule_without_targets_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="no target"):
        SignalRule.from_config(SignalRuleConfig(), 0)


def test_an_unknown_signal_name_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="unknown signal 'SIGNOPE'"):
        SignalRule.from_config(SignalRuleConfig(signal="SIGNOPE", cmdline=("x",)), 0)
