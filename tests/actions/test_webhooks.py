"""Webhooks against a real HTTP receiver on 127.0.0.1 that fails, then succeeds."""

from __future__ import annotations

import json
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from structlog.testing import capture_logs

from agent.actions.common import Recent
from agent.actions.webhooks import WebhookEngine, redact
from agent.config import WebhookConfig, config_to_json, load_config
from agent.core.errors import ConfigError
from agent.core.notice import EventType
from agent.core.tasks import TaskSet
from tests.actions_support import event, make_notice

SECRET = "T000/B000/s3cr3t-t0ken"


class Receiver:
    """A loopback HTTP server answering each POST with the next status of ``script`` (then 200)."""

    def __init__(self, script: list[int]) -> None:
        self.script = list(script)
        self.requests: list[tuple[str, dict[str, str], Any]] = []
        self.runner: web.AppRunner | None = None
        self.port = 0

    async def handle(self, request: web.Request) -> web.Response:
        self.requests.append((request.path, dict(request.headers), await request.json()))
        status = self.script.pop(0) if self.script else 200
        return web.Response(status=status, text="ok" if status < 300 else "no")

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/{tail:.*}", self.handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        server = site._server
        assert server is not None
        self.port = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]

    def url(self, path: str = f"/services/{SECRET}") -> str:
        return f"http://127.0.0.1:{self.port}{path}?token=also-{SECRET}"


class Harness:
    def __init__(self) -> None:
        self.tasks = TaskSet("test")
        self.recent = Recent(100)
        self.engines: list[WebhookEngine] = []

    async def engine(self, *hooks: WebhookConfig) -> WebhookEngine:
        engine = WebhookEngine(hooks, tasks=self.tasks, recent=self.recent, host="gpu-host-7")
        await engine.start()
        self.engines.append(engine)
        return engine

    def fire(self, engine: WebhookEngine, on: EventType = EventType.NOTICE) -> None:
        notice = make_notice()
        ev = event(on, notice)
        engine.handle(ev, notice, ev.to_json())


@pytest.fixture
async def harness() -> AsyncIterator[Harness]:
    h = Harness()
    yield h
    await h.tasks.close(2.0)
    for engine in h.engines:
        await engine.close()


@pytest.fixture
async def receiver() -> AsyncIterator[Receiver]:
    r = Receiver([500, 503])
    await r.start()
    yield r
    assert r.runner is not None
    await r.runner.cleanup()


async def test_a_failing_receiver_gets_the_event_after_retries(harness: Harness, receiver: Receiver) -> None:
    engine = await harness.engine(WebhookConfig(url=receiver.url(), backoff_s=0.01, retries=3))
    harness.fire(engine)
    await harness.tasks.drain()
    [record] = harness.recent.to_json()
    assert ("ok", 3, 200) == (record["outcome"], record["attempts"], record["status"])
    assert 3 == len(receiver.requests)
    assert ("notice", "termination") == (
        receiver.requests[-1][2]["type"],
        receiver.requests[-1][2]["notice"]["kind"],
    )


async def test_retries_give_up_after_the_configured_count(harness: Harness, receiver: Receiver) -> None:
    engine = await harness.engine(WebhookConfig(url=receiver.url(), backoff_s=0.01, retries=1))
    harness.fire(engine)
    await harness.tasks.drain()
    [record] = harness.recent.to_json()
    assert ("failed", 2, "HTTP 503") == (record["outcome"], record["attempts"], record["error"])


async def test_a_client_error_is_not_retried(harness: Harness) -> None:
    receiver = Receiver([404])
    await receiver.start()
    try:
        engine = await harness.engine(WebhookConfig(url=receiver.url(), backoff_s=0.01))
        harness.fire(engine)
        await harness.tasks.drain()
        assert [("rejected", 404)] == [(r["outcome"], r["status"]) for r in harness.recent.to_json()]
        assert 1 == len(receiver.requests)
    finally:
        assert receiver.runner is not None
        await receiver.runner.cleanup()


async def test_secrets_in_the_url_and_headers_never_reach_the_log(harness: Harness) -> None:
    with socket.socket() as sock:  # a port with nobody listening: every attempt fails and is logged
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}/services/{SECRET}?token={SECRET}"
    with capture_logs() as logs:
        engine = await harness.engine(
            WebhookConfig(url=url, headers={"Authorization": f"Bearer {SECRET}"}, backoff_s=0.01, retries=2)
        )
        harness.fire(engine)
        await harness.tasks.drain()
    text = json.dumps(logs, default=str) + json.dumps(harness.recent.to_json())
    assert ["webhook_retry", "webhook_retry", "webhook_failed"] == [e["event"] for e in logs]
    assert "s3cr3t" not in text
    assert f"http://127.0.0.1:{port}" == harness.recent.to_json()[0]["endpoint"]


async def test_headers_are_sent(harness: Harness, receiver: Receiver) -> None:
    receiver.script = []
    engine = await harness.engine(WebhookConfig(url=receiver.url(), headers={"Authorization": "Bearer x"}))
    harness.fire(engine)
    await harness.tasks.drain()
    assert "Bearer x" == receiver.requests[0][1]["Authorization"]


async def test_the_slack_format_posts_a_text_from_the_template(harness: Harness, receiver: Receiver) -> None:
    receiver.script = []
    hook = WebhookConfig(url=receiver.url(), format="slack", template="$host: $event $kind ($severity)$drill")
    harness.fire(await harness.engine(hook))
    await harness.tasks.drain()
    assert {"text": "gpu-host-7: notice termination (critical) (drill)"} == receiver.requests[0][2]


def test_redact_keeps_only_scheme_host_and_port() -> None:
    assert "https://hooks.example.com:8443" == redact(f"https://hooks.example.com:8443/services/{SECRET}?t=1")


def test_a_url_that_is_not_http_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"actions.webhooks \(ftp://x\): url must be an http"):
        WebhookConfig(url="ftp://x/secret")


def _secret_files(tmp_path: Path, url: str) -> tuple[Path, Path]:
    (tmp_path / "url").write_text(url + "\n")  # as a Secret's key or a systemd credential holds it
    (tmp_path / "token").write_text(f"Bearer {SECRET}\n")
    return tmp_path / "url", tmp_path / "token"


async def test_the_url_and_headers_read_from_secret_files_are_used_and_never_printed(
    harness: Harness, receiver: Receiver, tmp_path: Path
) -> None:
    """``url_file`` and ``header_files`` (a Kubernetes Secret mounted as files): the hook posts to that url with
    that header; ``preemptd run --print-config`` shows where they came from, not what they are."""
    url, token = _secret_files(tmp_path, receiver.url())
    text = f'[[actions.webhooks]]\nname = "ops"\nurl_file = "{url}"\nheader_files = {{Authorization = "{token}"}}\n'
    (tmp_path / "config.toml").write_text(text)
    config = load_config(tmp_path / "config.toml", env={})
    [hook] = config.actions.webhooks
    receiver.script = []
    harness.fire(await harness.engine(hook))
    await harness.tasks.drain()
    [(path, headers, _)] = receiver.requests
    assert (f"/services/{SECRET}", f"Bearer {SECRET}") == (path, headers["Authorization"])
    [shown] = config_to_json(config)["actions"]["webhooks"]
    assert "s3cr3t" not in json.dumps(shown)
    assert (f"(read from {url})", f"(read from {token})") == (shown["url"], shown["headers"]["Authorization"])


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ('url = "http://x"\nurl_file = "{url}"', "give url or url_file, not both"),
        ('url_file = "{missing}"', r"url_file: cannot read .*missing.*No such file"),
        ('url_file = "{empty}"', r"empty must hold one non-empty line"),
        (
            'url = "http://x"\nheaders = {{Authorization = "a"}}\nheader_files = {{Authorization = "{token}"}}',
            "header 'Authorization' is in both headers and header_files",
        ),
    ],
)
def test_secret_files_that_cannot_be_used_are_configuration_errors_naming_the_file(
    tmp_path: Path, fields: str, message: str
) -> None:
    url, token = _secret_files(tmp_path, "http://127.0.0.1:9/hook")
    (tmp_path / "empty").write_text("\n")
    names = {"url": url, "token": token, "missing": tmp_path / "missing", "empty": tmp_path / "empty"}
    (tmp_path / "config.toml").write_text("[[actions.webhooks]]\n" + fields.format(**names) + "\n")
    with pytest.raises(ConfigError, match=message) as info:
        load_config(tmp_path / "config.toml", env={})
    assert "s3cr3t" not in str(info.value)
