"""Webhooks: POST the event JSON (or a Slack-style ``{"text": ...}`` built from a template) to configured
URLs, with a timeout, retries with exponential backoff on network errors, 429 and 5xx, and no secrets in the
log: a webhook is logged by its name and its scheme, host and port only, never its path, query or headers.
"""

from __future__ import annotations

import asyncio
import socket
import string
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import aiohttp

from agent.actions.common import (
    Outcomes,
    Recent,
    RuleActions,
    checked_each,
    log,
    record_outcome,
)
from agent.config import WebhookConfig
from agent.config.validate import check_webhook, redact
from agent.core.notice import Notice, format_time, utcnow
from agent.core.tasks import TaskSet


def validate_webhooks(hooks: Iterable[WebhookConfig]) -> tuple[WebhookConfig, ...]:
    return checked_each(hooks, check_webhook, "actions.webhooks")


def webhook_name(hook: WebhookConfig) -> str:
    return hook.name or redact(hook.url)


def render_payload(hook: WebhookConfig, doc: Mapping[str, Any], notice: Notice | None, host: str) -> Any:
    """The body to POST: the event document, or ``{"text": template}`` for ``format = "slack"``.

    Template variables (``$name``): event, kind, severity, source, reason, notice_id, deadline,
    seconds_left, drill (`` (drill)`` or empty), host. Unknown variables are left as written.
    """
    if hook.format == "event":
        return dict(doc)
    fields: dict[str, str] = {"event": str(doc.get("type", "")), "host": host}
    if notice is not None:
        left = notice.seconds_left(utcnow())
        fields.update(
            kind=notice.kind.value,
            severity=notice.severity.value,
            source=notice.source,
            reason=notice.reason,
            notice_id=notice.id,
            deadline=format_time(notice.deadline) if notice.deadline else "none",
            seconds_left="?" if left is None else f"{left:.0f}",
            drill=" (drill)" if notice.drill else "",
        )
    return {"text": string.Template(hook.template).safe_substitute(fields)}


class _Retry(Exception):
    pass


class WebhookEngine(RuleActions[WebhookConfig]):
    """Delivers events to the configured webhooks; each delivery is an owned task with its own retries. A
    :class:`agent.core.ports.Reactor` named ``webhooks``."""

    name = "webhooks"

    def __init__(
        self,
        hooks: Iterable[WebhookConfig],
        *,
        tasks: TaskSet,
        recent: Recent,
        host: str | None = None,
        count: Callable[[str], None] = lambda outcome: None,
    ) -> None:
        self.rules = self.hooks = validate_webhooks(hooks)
        self._tasks = tasks
        self.recent = self._recent = recent
        self._host = host or socket.gethostname()
        self._count = self.outcomes = Outcomes(count)
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        if self.hooks and self._session is None:
            self._session = aiohttp.ClientSession(headers={"User-Agent": "preemptd"})

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def stop(self, timeout: float) -> None:
        await super().stop(timeout)
        await self.close()

    def act(self, rule: WebhookConfig, trigger: str, notice: Notice | None, doc: Mapping[str, Any]) -> None:
        payload = render_payload(rule, doc, notice, self._host)
        name = webhook_name(rule)
        self._tasks.spawn(self._deliver(rule, name, payload, doc, notice), f"webhook:{name}:{trigger}")

    async def _deliver(
        self, hook: WebhookConfig, name: str, payload: Any, doc: Mapping[str, Any], notice: Notice | None
    ) -> None:
        context = {
            "webhook": name,
            "endpoint": redact(hook.url),
            "trigger": str(doc.get("type")),
            "notice_id": notice.id if notice else None,
        }
        started = time.monotonic()
        if self._session is None:
            self._finish(context, "failed", started, attempts=0, error="webhooks are not started")
            return
        attempts = hook.retries + 1
        error = ""
        for attempt in range(1, attempts + 1):
            try:
                status = await self._post(hook, payload)
            except _Retry as exc:
                error = str(exc)
            else:
                if status < 300:
                    self._finish(context, "ok", started, attempts=attempt, status=status)
                    return
                self._finish(context, "rejected", started, attempts=attempt, status=status)
                return
            if attempt < attempts:
                delay = min(hook.backoff_max_s, hook.backoff_s * (2 ** (attempt - 1)))
                log.info("webhook_retry", attempt=attempt, error=error, retry_in_s=delay, **context)
                await asyncio.sleep(delay)
        self._finish(context, "failed", started, attempts=attempts, error=error)

    async def _post(self, hook: WebhookConfig, payload: Any) -> int:
        """POST once; the status for a final answer, :class:`_Retry` (with a redacted reason) otherwise."""
        assert self._session is not None
        timeout = aiohttp.ClientTimeout(total=hook.timeout_s)
        try:
            async with self._session.post(
                hook.url, json=payload, headers=hook.headers, timeout=timeout
            ) as resp:
                await resp.read()
                if resp.status == 429 or resp.status >= 500:
                    raise _Retry(f"HTTP {resp.status}")
                return resp.status
        except asyncio.TimeoutError:
            raise _Retry(f"no answer within {hook.timeout_s:g} s") from None
        except aiohttp.ClientError as exc:
            # aiohttp's messages can carry the URL (and with it a token): keep only the error class and
            # what the OS said.
            reason = getattr(exc, "os_error", None) or getattr(exc, "strerror", None)
            raise _Retry(f"{type(exc).__name__}{': ' + str(reason) if reason else ''}") from None

    def _finish(self, context: Mapping[str, Any], outcome: str, started: float, **fields: Any) -> None:
        record_outcome(
            self._recent, self._count, context, outcome, started, "webhook_delivered", "webhook_", **fields
        )
