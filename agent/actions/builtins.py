"""The built-in action reactors, each built from the ``[actions]`` section through the same factory shape as a
scheduler bridge (:data:`agent.core.ports.ReactorFactory`): signals, ready aggregation, the Azure
acknowledgement, hooks and webhooks, in the order they see each event.

Every built-in owns its tasks (one :class:`~agent.actions.common.TaskSet` each) and its record of what it did,
so that stopping or replacing one (a reload) never waits on another.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

from agent.actions.azure_ack import AzureAcknowledger
from agent.actions.common import Recent
from agent.actions.hooks import HookEngine
from agent.actions.ready import ReadyEngine
from agent.actions.signals import SignalEngine, SignalRule, call_gpu_pids
from agent.actions.webhooks import WebhookEngine
from agent.config import ActionsConfig
from agent.core.plugins import Part
from agent.core.ports import AZURE_ACK, GPU_PIDS, Host, ReactorFactory
from agent.core.tasks import TaskSet


def actions_config(host: Host) -> ActionsConfig:
    return host.config.table("actions", ActionsConfig)


def build_signals(host: Host) -> SignalEngine:
    cfg = actions_config(host)

    async def gpu_pids() -> Mapping[str, Iterable[int]]:
        return await call_gpu_pids(host.hooks.capability(GPU_PIDS))

    return SignalEngine(
        (SignalRule.from_config(rule, i) for i, rule in enumerate(cfg.signals)),
        dry_run=cfg.dry_run,
        tasks=TaskSet("actions-signals"),
        recent=Recent(cfg.history_size),
        gpu_pids=gpu_pids,
    )


def build_ready(host: Host) -> ReadyEngine:
    cfg = actions_config(host)
    return ReadyEngine(
        cfg.ready, publish=host.publish_ready, tasks=TaskSet("actions-ready"), history=cfg.history_size
    )


def build_azure_acknowledgement(host: Host) -> AzureAcknowledger:
    cfg = actions_config(host)
    return AzureAcknowledger(
        cfg.ready.azure_acknowledge,
        ack=lambda: host.hooks.capability(AZURE_ACK),
        tasks=TaskSet("actions-azure"),
        recent=Recent(cfg.history_size),
    )


def build_hooks(host: Host) -> HookEngine:
    cfg = actions_config(host)
    env = dict(os.environ)
    env.setdefault("PREEMPTD_SOCKET", str(host.config.socket))
    return HookEngine(
        cfg.hooks,
        concurrency=cfg.hook_concurrency,
        output_max_bytes=cfg.hook_output_max_bytes,
        tasks=TaskSet("actions-hooks"),
        recent=Recent(cfg.history_size),
        base_env=env,
    )


def build_webhooks(host: Host) -> WebhookEngine:
    cfg = actions_config(host)
    return WebhookEngine(cfg.webhooks, tasks=TaskSet("actions-webhooks"), recent=Recent(cfg.history_size))


# The built-in reactors, as the reactor registry lists them (agent/actions/registry.py: BUILTIN, in delivery
# order). They read the core [actions] section, no table of their own.
SIGNALS: Part[ReactorFactory] = Part("signals", build_signals)
READY: Part[ReactorFactory] = Part("ready", build_ready)
AZURE_ACKNOWLEDGEMENT: Part[ReactorFactory] = Part("azure_acknowledgement", build_azure_acknowledgement)
HOOKS: Part[ReactorFactory] = Part("hooks", build_hooks)
WEBHOOKS: Part[ReactorFactory] = Part("webhooks", build_webhooks)


def legacy_status(reactors: Mapping[str, Any], dry_run: bool) -> dict[str, Any]:
    """The ``actions`` keys of ``/v1/status`` that predate reactors, from the built-in reactors."""
    signals, hooks, webhooks = reactors.get("signals"), reactors.get("hooks"), reactors.get("webhooks")
    azure, ready = reactors.get("azure_acknowledgement"), reactors.get("ready")

    def recent(reactor: Any) -> list[dict[str, Any]]:
        return reactor.recent.to_json() if reactor is not None else []

    return {
        "dry_run": dry_run,
        "rules": {
            "signals": len(signals.rules) if signals is not None else 0,
            "hooks": len(hooks.hooks) if hooks is not None else 0,
            "webhooks": len(webhooks.hooks) if webhooks is not None else 0,
        },
        "signals": recent(signals),
        "hooks": recent(hooks),
        "webhooks": recent(webhooks),
        "azure_acknowledgements": recent(azure),
        "ready": ready.status() if ready is not None else {"participants": [], "notices": {}},
    }
