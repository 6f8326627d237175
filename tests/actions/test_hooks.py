"""Hooks: real commands as argv, the event on stdin, PREEMPTD_* variables, timeouts and a concurrency bound."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from agent.actions.common import Recent
from agent.actions.hooks import HookEngine
from agent.config import HookConfig, load_config
from agent.core.errors import ConfigError
from agent.core.notice import EventType, Kind
from agent.core.tasks import TaskSet
from tests.actions_support import event, make_notice

# Copies its stdin and the PREEMPTD_* environment into argv[1] as JSON.
RECORDER = """
import json, os, sys
doc = {"stdin": json.loads(sys.stdin.read()), "env": {k: v for k, v in os.environ.items() if k.startswith("PREEMPTD_")}, "argv": sys.argv[2:]}
open(sys.argv[1], "w").write(json.dumps(doc))
print("saved the checkpoint")
"""

# Fails if another copy is running (an atomic mkdir is the lock), else holds it for a moment.
EXCLUSIVE = """
import os, sys, time
lock = sys.argv[1]
os.mkdir(lock)
time.sleep(0.2)
os.rmdir(lock)
"""


class Harness:
    def __init__(self) -> None:
        self.tasks = TaskSet("test")
        self.recent = Recent(100)

    def engine(self, *hooks: HookConfig, concurrency: int = 4) -> HookEngine:
        return HookEngine(
            hooks,
            concurrency=concurrency,
            output_max_bytes=4096,
            tasks=self.tasks,
            recent=self.recent,
            base_env={
                "PATH": "/usr/bin:/bin",
                "PREEMPTD_SOCKET": "/run/preemptd/preemptd.sock",
                "NOTIFY_SOCKET": "/run/systemd/notify",
            },
        )

    def fire(
        self, engine: HookEngine, on: EventType = EventType.NOTICE, kind: Kind = Kind.TERMINATION
    ) -> None:
        notice = make_notice(kind)
        ev = event(on, notice)
        engine.handle(ev, notice, ev.to_json())

    def outcomes(self) -> list[str]:
        return [r["outcome"] for r in self.recent.to_json()]


@pytest.fixture
async def harness() -> AsyncIterator[Harness]:
    h = Harness()
    yield h
    await h.tasks.close(2.0)


def py(*args: str) -> tuple[str, ...]:
    return (sys.executable, "-c", *args)


async def test_a_hook_gets_the_event_on_stdin_and_preemptd_variables(
    harness: Harness, tmp_path: Path
) -> None:
    out = tmp_path / "seen.json"
    harness.fire(harness.engine(HookConfig(argv=(*py(RECORDER), str(out), "--flag"), name="rec")))
    await harness.tasks.drain()
    seen = json.loads(out.read_text())
    notice = seen["stdin"]["notice"]
    assert ("notice", "termination") == (seen["stdin"]["type"], notice["kind"])
    assert {
        "PREEMPTD_EVENT": "notice",
        "PREEMPTD_NOTICE_ID": notice["id"],
        "PREEMPTD_KIND": "termination",
        "PREEMPTD_SEVERITY": "critical",
        "PREEMPTD_DRILL": "1",
        "PREEMPTD_SOCKET": "/run/preemptd/preemptd.sock",
    }.items() <= seen["env"].items()
    assert ["--flag"] == seen["argv"]
    assert ["ok"] == harness.outcomes()


async def test_arguments_are_never_interpreted_by_a_shell(harness: Harness, tmp_path: Path) -> None:
    out = tmp_path / "seen.json"
    harness.fire(harness.engine(HookConfig(argv=(*py(RECORDER), str(out), "$(touch pwned); `x`"))))
    await harness.tasks.drain()
    assert ["$(touch pwned); `x`"] == json.loads(out.read_text())["argv"]


async def test_a_hooks_output_goes_to_the_log(harness: Harness, tmp_path: Path) -> None:
    with capture_logs() as logs:
        harness.fire(harness.engine(HookConfig(argv=(*py(RECORDER), str(tmp_path / "x")), name="rec")))
        await harness.tasks.drain()
    assert [("rec", "saved the checkpoint")] == [
        (e["hook"], e["line"]) for e in logs if e["event"] == "hook_output"
    ]


async def test_a_hanging_hook_is_killed_at_its_timeout(harness: Harness) -> None:
    with capture_logs() as logs:
        harness.fire(harness.engine(HookConfig(argv=("sleep", "600"), timeout_s=0.3)))
        await harness.tasks.drain()
    assert ["timeout"] == harness.outcomes()
    assert any(e["event"] == "hook_timeout" for e in logs)


async def test_a_timeout_kills_the_hooks_children_too(harness: Harness, tmp_path: Path) -> None:
    """The hook's shell is killed with its whole process group, so the grandchild does not live on."""
    pid_file = tmp_path / "grandchild.pid"
    script = f"sleep 600 & echo $! > {pid_file}; wait"
    harness.fire(harness.engine(HookConfig(argv=("/bin/sh", "-c", script), timeout_s=0.5)))
    await harness.tasks.drain()
    import psutil

    pid = int(pid_file.read_text())
    # SIGKILL to the group returns before another process has died: on a busy machine the
    # grandchild can still be scheduled for a moment, so wait (bounded) for it to go.
    state = "running"
    for _ in range(200):
        try:
            state = psutil.Process(pid).status()
        except psutil.NoSuchProcess:
            state = "gone"
        if state in ("gone", psutil.STATUS_ZOMBIE):
            break
        await asyncio.sleep(0.05)
    assert state in ("gone", psutil.STATUS_ZOMBIE), f"grandchild {pid} still {state} 10 s after"


async def test_hooks_beyond_the_concurrency_bound_wait_their_turn(harness: Harness, tmp_path: Path) -> None:
    engine = harness.engine(HookConfig(argv=(*py(EXCLUSIVE), str(tmp_path / "lock"))), concurrency=1)
    for _ in range(3):
        harness.fire(engine)
    await harness.tasks.drain()
    assert ["ok", "ok", "ok"] == harness.outcomes()


async def test_a_failing_hook_is_recorded_with_its_exit_code(harness: Harness) -> None:
    harness.fire(harness.engine(HookConfig(argv=("/bin/sh", "-c", "exit 3"))))
    await harness.tasks.drain()
    [record] = harness.recent.to_json()
    assert ("failed", 3) == (record["outcome"], record["exit_code"])


async def test_a_missing_command_is_recorded_not_raised(harness: Harness, tmp_path: Path) -> None:
    harness.fire(harness.engine(HookConfig(argv=(str(tmp_path / "no-such-hook"),))))
    await harness.tasks.drain()
    assert ["failed_to_start"] == harness.outcomes()


async def test_hooks_run_only_on_their_events_and_kinds(harness: Harness, tmp_path: Path) -> None:
    engine = harness.engine(HookConfig(argv=("true",), on=("ready",), kinds=("termination",)))
    harness.fire(engine, EventType.NOTICE)
    harness.fire(engine, EventType.READY, kind=Kind.MAINTENANCE)
    harness.fire(engine, EventType.READY)
    await harness.tasks.drain()
    assert ["ok"] == harness.outcomes()


async def test_a_hook_does_not_inherit_the_services_notify_socket(harness: Harness, tmp_path: Path) -> None:
    out = tmp_path / "seen.json"
    script = "import json, os, sys; open(sys.argv[1], 'w').write(json.dumps(sorted(os.environ)))"
    harness.fire(harness.engine(HookConfig(argv=(*py(script), str(out)))))
    await harness.tasks.drain()
    assert "NOTIFY_SOCKET" not in json.loads(out.read_text())


def test_an_empty_argv_fails_when_the_configuration_is_loaded(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_text('[[actions.hooks]]\nname = "drain"\nargv = []\n')
    with pytest.raises(ConfigError, match=r"actions.hooks \(drain\): argv is empty"):
        load_config(path, env={})
