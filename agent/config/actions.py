"""The ``[actions]`` section: signal rules, hooks, webhooks and the ready step (agent/actions/), each checked
when the file is loaded (agent/config/validate.py holds the checks their ``__post_init__`` runs)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from agent.config.types import (
    AtLeastOne,
    NonNegative,
    NoticeKindName,
    Seconds,
    SecondsUpToAYear,
    SeverityName,
)
from agent.config.validate import check_hook, check_signal_rule, check_webhook, webhook_secrets

ActionTrigger = Literal["notice", "update", "cleared", "ready"]


@dataclass(frozen=True)
class SignalRuleConfig:
    """One ``[[actions.signals]]`` rule: which notices send which signal to which processes."""

    name: str = "signal"
    kinds: tuple[NoticeKindName, ...] = ("termination", "maintenance")
    min_severity: SeverityName = "warning"
    drills: bool = True
    signal: str = "SIGTERM"
    # Targets; a rule with none of them does nothing.
    gpu_processes: bool = False
    gpu_scope: Literal["all", "notice"] = "all"
    units: tuple[str, ...] = ()
    cgroups: tuple[str, ...] = ()
    pid_files: tuple[Path, ...] = ()
    cmdline: tuple[str, ...] = ()
    # Sent to the processes still alive this long after the first signal; 0 disables escalation.
    escalate_after_s: float = 0.0
    escalate_signal: str = "SIGKILL"

    def __post_init__(self) -> None:
        # Checked when the file is loaded, so a bad rule fails `preemptd run` and a reload before anything
        # starts; agent/config/validate.py holds the checks.
        check_signal_rule(self)


@dataclass(frozen=True)
class HookConfig:
    """One ``[[actions.hooks]]`` entry: a command (argv, never a shell) run on some events."""

    argv: tuple[str, ...] = ()
    name: str = ""
    on: tuple[ActionTrigger, ...] = ("notice",)
    kinds: tuple[NoticeKindName, ...] = ()
    min_severity: SeverityName = "info"
    drills: bool = True
    timeout_s: Seconds = 30.0
    env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_hook(self)


@dataclass(frozen=True)
class WebhookConfig:
    """One ``[[actions.webhooks]]`` entry: an HTTP endpoint that receives events as JSON."""

    url: str = ""
    name: str = ""
    on: tuple[ActionTrigger, ...] = ("notice", "cleared", "ready")
    kinds: tuple[NoticeKindName, ...] = ()
    min_severity: SeverityName = "info"
    drills: bool = True
    format: Literal["event", "slack"] = "event"
    template: str = (
        "preemptd on $host: $event $kind ($severity) from $source: $reason; $seconds_left s left$drill"
    )
    headers: dict[str, str] = field(default_factory=dict)
    # Secrets kept out of the configuration file (a Kubernetes Secret's keys mounted as files, systemd
    # credentials): the url, and header values, each read from a file of one line at load and reload.
    url_file: Path | None = None
    header_files: dict[str, Path] = field(default_factory=dict)
    timeout_s: Seconds = 10.0
    retries: int = 3
    backoff_s: Seconds = 1.0
    backoff_max_s: Seconds = 30.0

    def __post_init__(self) -> None:
        if self.url_file is not None or self.header_files:
            url, headers = webhook_secrets(
                self.url, self.url_file, self.headers, self.header_files, self.name
            )
            object.__setattr__(self, "url", url)
            object.__setattr__(self, "headers", headers)
        check_webhook(self)


@dataclass(frozen=True)
class ReadyConfig:
    """When the agent declares a notice ``ready`` (participants saved) and acknowledges it to the cloud."""

    enabled: bool = True
    kinds: tuple[NoticeKindName, ...] = ("termination", "maintenance", "rebalance")
    min_severity: SeverityName = "warning"
    # Longest wait for participants after the notice; never later than ``deadline - deadline_margin_s``.
    grace_s: NonNegative = 120.0
    deadline_margin_s: NonNegative = 5.0
    # Without declared participants: ``grace`` waits out the grace (signalled programs may be saving),
    # ``immediately`` declares ready at once.
    without_participants: Literal["grace", "immediately"] = "grace"
    # A participant is forgotten when its process is gone or it has not reported for this long.
    participant_ttl_s: SecondsUpToAYear = 7 * 24 * 3600.0
    # Registered participants, per user and in all; a registration past a limit is refused with 429.
    max_participants_per_uid: AtLeastOne = 256
    max_participants: AtLeastOne = 1024
    azure_acknowledge: Literal["on_ready", "immediately", "never"] = "on_ready"


@dataclass(frozen=True)
class ActionsConfig:
    """What the agent does about notices besides telling clients: signals, hooks, webhooks, ready."""

    dry_run: bool = False
    signals: tuple[SignalRuleConfig, ...] = ()
    hooks: tuple[HookConfig, ...] = ()
    hook_concurrency: AtLeastOne = 4
    hook_output_max_bytes: AtLeastOne = 65536
    webhooks: tuple[WebhookConfig, ...] = ()
    ready: ReadyConfig = field(default_factory=ReadyConfig)
    # Bounded wait at shutdown for running actions; keep it below api.shutdown_timeout_s.
    stop_timeout_s: NonNegative = 2.0
    history_size: AtLeastOne = 100
