"""Operator hooks: commands run as argv (never through a shell) on notice, update, cleared and ready events,
with the event JSON on stdin, ``PREEMPTD_*`` variables in the environment, a timeout that kills the hook's
whole process group, a bound on how many run at once, and their output in the log.

Hooks run on tasks of their own: a hook that hangs never delays anything else the agent does.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import shutil
import signal
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from agent.actions.common import (
    Outcomes,
    Recent,
    RuleActions,
    checked_each,
    log,
    record_outcome,
)
from agent.config import HookConfig
from agent.config.validate import check_hook
from agent.core.caps import shed_argv
from agent.core.errors import ConfigError
from agent.core.notice import Notice, format_time, utcnow
from agent.core.tasks import TaskSet

MAX_LOGGED_LINES = 200
# Meant for the agent's own process only: a hook must not talk to systemd's notify socket or believe it was
# handed the agent's sockets.
SERVICE_ONLY = frozenset(
    {"NOTIFY_SOCKET", "LISTEN_FDS", "LISTEN_PID", "LISTEN_FDNAMES", "WATCHDOG_USEC", "WATCHDOG_PID"}
)
KILL_WAIT_S = 5.0


def validate_hooks(hooks: Iterable[HookConfig]) -> tuple[HookConfig, ...]:
    return checked_each(hooks, check_hook, "actions.hooks")


def hook_name(hook: HookConfig) -> str:
    return hook.name or os.path.basename(hook.argv[0])


def hook_environment(
    base: Mapping[str, str], doc: Mapping[str, Any], notice: Notice | None, extra: Mapping[str, str]
) -> dict[str, str]:
    """The hook's environment: the agent's own (less systemd's hand-over variables), the hook's ``env`` table,
    then the ``PREEMPTD_*`` facts."""
    env = {k: v for k, v in base.items() if k not in SERVICE_ONLY}
    env.update(extra)
    env["PREEMPTD_EVENT"] = str(doc.get("type", ""))
    env["PREEMPTD_EVENT_SEQ"] = str(doc.get("seq", ""))
    if notice is not None:
        env["PREEMPTD_NOTICE_ID"] = notice.id
        env["PREEMPTD_KIND"] = notice.kind.value
        env["PREEMPTD_SEVERITY"] = notice.severity.value
        env["PREEMPTD_SOURCE"] = notice.source
        env["PREEMPTD_REASON"] = notice.reason
        env["PREEMPTD_DRILL"] = "1" if notice.drill else "0"
        env["PREEMPTD_DEADLINE"] = format_time(notice.deadline) if notice.deadline else ""
        left = notice.seconds_left(utcnow())
        env["PREEMPTD_SECONDS_LEFT"] = "" if left is None else f"{left:.3f}"
    return env


class HookEngine(RuleActions[HookConfig]):
    """Starts the configured hooks for each event, at most ``concurrency`` at a time. A
    :class:`agent.core.ports.Reactor` named ``hooks``."""

    name = "hooks"

    def __init__(
        self,
        hooks: Iterable[HookConfig],
        *,
        concurrency: int,
        output_max_bytes: int,
        tasks: TaskSet,
        recent: Recent,
        base_env: Mapping[str, str] | None = None,
        count: Callable[[str], None] = lambda outcome: None,
    ) -> None:
        self.rules = self.hooks = validate_hooks(hooks)
        if concurrency < 1:
            raise ConfigError(f"actions.hook_concurrency must be at least 1, got {concurrency}")
        self._limit = asyncio.Semaphore(concurrency)
        self._max_bytes = output_max_bytes
        self._tasks = tasks
        self.recent = self._recent = recent
        self._base_env = dict(os.environ if base_env is None else base_env)
        self._count = self.outcomes = Outcomes(count)

    def act(self, rule: HookConfig, trigger: str, notice: Notice | None, doc: Mapping[str, Any]) -> None:
        """Start the hook; ``doc`` goes to its stdin."""
        name = hook_name(rule)
        self._tasks.spawn(self._run(rule, name, notice, doc), f"hook:{name}:{trigger}")

    async def _run(self, hook: HookConfig, name: str, notice: Notice | None, doc: Mapping[str, Any]) -> None:
        async with self._limit:
            await self._run_one(hook, name, notice, doc)

    async def _run_one(
        self, hook: HookConfig, name: str, notice: Notice | None, doc: Mapping[str, Any]
    ) -> None:
        event_type = str(doc.get("type"))
        context = {"hook": name, "trigger": event_type, "notice_id": notice.id if notice else None}
        started = time.monotonic()
        env = hook_environment(self._base_env, doc, notice, hook.env)
        try:
            # Without the RAM tier's capabilities (agent/core/caps.py): through setpriv, which then reports a
            # missing program as its own exit 127, so that one is looked for first.
            shed = shed_argv()
            if shed and shutil.which(hook.argv[0], path=env.get("PATH", os.defpath)) is None:
                raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), hook.argv[0])
            proc = await asyncio.create_subprocess_exec(
                *shed,
                *hook.argv,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
                env=env,
                cwd="/",
                start_new_session=True,  # its own process group, so a timeout kills its children too
            )
        except OSError as exc:
            self._finish(context, "failed_to_start", started, error=f"{hook.argv[0]}: {exc.strerror or exc}")
            return
        payload = (json.dumps(doc, separators=(",", ":")) + "\n").encode()
        log.info("hook_started", pid=proc.pid, argv=list(hook.argv), **context)
        try:
            output, truncated = await asyncio.wait_for(self._interact(proc, payload), timeout=hook.timeout_s)
        except asyncio.TimeoutError:
            await _kill_group(proc)
            self._finish(context, "timeout", started, error=f"no exit after {hook.timeout_s:g} s; killed")
            return
        except asyncio.CancelledError:
            await _kill_group(proc)
            raise
        _log_output(output, truncated, context)
        code = proc.returncode
        self._finish(context, "ok" if code == 0 else "failed", started, exit_code=code, truncated=truncated)

    async def _interact(self, proc: asyncio.subprocess.Process, payload: bytes) -> tuple[bytes, bool]:
        assert proc.stdin is not None and proc.stdout is not None
        try:
            proc.stdin.write(payload)
            await proc.stdin.drain()
        except (BrokenPipeError, ConnectionResetError):
            pass  # a hook that does not read its stdin is fine
        finally:
            proc.stdin.close()
        kept = bytearray()
        truncated = False
        while chunk := await proc.stdout.read(65536):
            room = self._max_bytes - len(kept)
            if len(chunk) > room:
                truncated = True
            kept += chunk[: max(0, room)]
        await proc.wait()
        return bytes(kept), truncated

    def _finish(self, context: Mapping[str, Any], outcome: str, started: float, **fields: Any) -> None:
        record_outcome(
            self._recent, self._count, context, outcome, started, "hook_finished", "hook_", **fields
        )


def _log_output(output: bytes, truncated: bool, context: Mapping[str, Any]) -> None:
    lines = output.decode("utf-8", "replace").splitlines()
    for line in lines[:MAX_LOGGED_LINES]:
        log.info("hook_output", line=line, **context)
    if truncated or len(lines) > MAX_LOGGED_LINES:
        log.info("hook_output_truncated", lines=len(lines), **context)


async def _kill_group(proc: asyncio.subprocess.Process) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
        await asyncio.wait_for(proc.wait(), timeout=KILL_WAIT_S)
