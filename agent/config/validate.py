"""Checks of the ``[[actions.*]]`` tables, run when the configuration is loaded (from the section classes'
``__post_init__``): a wrong signal name, regular expression, empty command or non-HTTP URL stops
``preemptd run`` (and a reload) with the rule and what to do. Standard library only."""

from __future__ import annotations

import re
import signal
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol
from urllib.parse import urlsplit

from agent.core.errors import ConfigError

# What the checks read of the section classes in agent/config/__init__.py, which call them from __post_init__ (the
# config module imports this one, never the other way round).


class SignalRuleConfig(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def signal(self) -> str: ...
    @property
    def escalate_signal(self) -> str: ...
    @property
    def escalate_after_s(self) -> float: ...
    @property
    def cmdline(self) -> Sequence[str]: ...
    @property
    def gpu_processes(self) -> bool: ...
    @property
    def units(self) -> Sequence[str]: ...
    @property
    def cgroups(self) -> Sequence[str]: ...
    @property
    def pid_files(self) -> Sequence[object]: ...


class HookConfig(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def argv(self) -> Sequence[str]: ...
    @property
    def timeout_s(self) -> float: ...


class WebhookConfig(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def url(self) -> str: ...
    @property
    def timeout_s(self) -> float: ...
    @property
    def retries(self) -> int: ...
    @property
    def backoff_s(self) -> float: ...


def parse_signal(value: str, where: str) -> signal.Signals:
    """``SIGTERM``, ``TERM``, ``term`` or ``15`` → ``signal.SIGTERM``; else ConfigError naming ``where``."""
    text = value.strip().upper()
    try:
        if text.isdigit():
            return signal.Signals(int(text))
        return signal.Signals[text if text.startswith("SIG") else "SIG" + text]
    except (KeyError, ValueError):
        raise ConfigError(
            f"{where}: unknown signal {value!r}; use a name such as 'SIGTERM', 'SIGUSR1' or 'SIGINT'"
        ) from None


def check_signal_rule(rule: SignalRuleConfig, where: str | None = None) -> None:
    where = where or f"actions.signals (rule {rule.name!r})"
    parse_signal(rule.signal, where + " signal")
    parse_signal(rule.escalate_signal, where + " escalate_signal")
    for text in rule.cmdline:
        try:
            re.compile(text)
        except re.error as exc:
            raise ConfigError(f"{where}: cmdline pattern {text!r} is not a valid regex: {exc}") from None
    if rule.escalate_after_s < 0:
        raise ConfigError(f"{where}: escalate_after_s must be >= 0, got {rule.escalate_after_s}")
    if not (rule.gpu_processes or rule.units or rule.cgroups or rule.pid_files or rule.cmdline):
        raise ConfigError(
            f"{where}: no target; set gpu_processes = true, or units, cgroups, pid_files or cmdline"
        )


def check_hook(hook: HookConfig, where: str | None = None) -> None:
    where = where or f"actions.hooks ({hook.name or 'unnamed'})"
    if not hook.argv or not hook.argv[0]:
        raise ConfigError(
            f'{where}: argv is empty; give the command as a list, e.g. ["/usr/local/bin/x", "--y"]'
        )
    if hook.timeout_s <= 0:
        raise ConfigError(f"{where}: timeout_s must be positive, got {hook.timeout_s}")


def redact(url: str) -> str:
    """``https://hooks.example.com:8443/services/T0/B0/secret?token=x`` → ``https://hooks.example.com:8443``."""
    try:
        parts = urlsplit(url)
        port = f":{parts.port}" if parts.port else ""
    except ValueError:
        return "(unparsable URL)"
    return f"{parts.scheme}://{parts.hostname or '?'}{port}"


def read_secret(path: Path, where: str) -> str:
    """The value in a secret file (a Kubernetes Secret's key, a systemd credential): its text without the
    trailing newline. ConfigError naming the file (never its content) when it cannot be read or is empty."""
    try:
        value = path.read_text(encoding="utf-8").rstrip("\r\n")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{where}: cannot read {path}: {exc}") from None
    if not value.strip() or "\n" in value or "\r" in value:
        raise ConfigError(f"{where}: {path} must hold one non-empty line")
    return value


def webhook_secrets(
    url: str, url_file: Path | None, headers: Mapping[str, str], header_files: Mapping[str, Path], name: str
) -> tuple[str, dict[str, str]]:
    """The webhook's url and headers with the values of ``url_file`` and ``header_files`` read in."""
    where = f"actions.webhooks ({name or (redact(url) if url else url_file)})"
    if url_file is not None:
        if url:
            raise ConfigError(f"{where}: give url or url_file, not both")
        url = read_secret(url_file, f"{where}: url_file")
    both = sorted(set(headers) & set(header_files))
    if both:
        raise ConfigError(f"{where}: header {both[0]!r} is in both headers and header_files")
    read = {
        header: read_secret(path, f"{where}: header_files.{header}") for header, path in header_files.items()
    }
    return url, {**headers, **read}


def check_webhook(hook: WebhookConfig, where: str | None = None) -> None:
    where = where or f"actions.webhooks ({hook.name or redact(hook.url)})"
    try:
        parts = urlsplit(hook.url)
        parts.port  # noqa: B018 - raises ValueError for a bad port
    except ValueError:
        raise ConfigError(f"{where}: url is not a valid URL") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"{where}: url must be an http:// or https:// URL, got {redact(hook.url)!r}")
    if hook.timeout_s <= 0 or hook.retries < 0 or hook.backoff_s < 0:
        raise ConfigError(f"{where}: timeout_s must be positive and retries, backoff_s not negative")
