"""The Slurm bridge's tests' shared parts, on the session's real one-node Slurm (tests/slurm_cluster.py): a
bridge on it, waits on its jobs and node, and an agent set up for it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from agent.bridges.common import drain_reason
from agent.bridges.slurm import SlurmBridge, SlurmConfig
from agent.core.notice import EventType, Notice
from tests.actions_support import event, make_notice
from tests.slurm_cluster import SlurmCluster


def bridge_for(cluster: SlurmCluster, **settings: Any) -> SlurmBridge:
    """A bridge on the test cluster; drills on, since the tests' notices are drills."""
    chosen: dict[str, Any] = {"timeout_s": 10.0, "retries": 1, "drills": True, **settings}
    return SlurmBridge(SlurmConfig(enabled=True, slurm_conf=str(cluster.conf), **chosen))


async def until(predicate: Callable[[], Any], timeout: float = 30.0, what: str = "condition") -> Any:
    """Poll ``predicate`` (the state of an external system) until it holds; fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = await asyncio.to_thread(predicate)
        if value:
            return value
        await asyncio.sleep(0.2)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")


def running(cluster: SlurmCluster, *options: str, script: str = "sleep 300") -> int:
    job_id = cluster.submit(script, *options)
    cluster.wait_job(job_id, lambda j: j["state"] == "RUNNING")
    return job_id


async def drained_for_a_notice(cluster: SlurmCluster, bridge: SlurmBridge) -> Notice:
    """A notice handed to ``bridge``, once the node is drained with the agent's reason for it."""
    notice = make_notice(deadline_in=600)
    bridge.handle(event(EventType.NOTICE, notice))
    await until(drained_with(cluster, drain_reason(notice)), what="the agent's drain")
    return notice


def agent_settings(cluster: SlurmCluster, **extra: Any) -> dict[str, Any]:
    return {
        "actions.slurm.enabled": True,
        "actions.slurm.slurm_conf": str(cluster.conf),
        "actions.slurm.drills": True,
        "actions.slurm.margin_s": 5.0,
        "actions.slurm.stop_wait_s": 30.0,
        **extra,
    }


def slurm_status(doc: dict[str, Any]) -> dict[str, Any]:
    return dict(doc["actions"]["reactors"]["slurm"])


def drained_with(cluster: SlurmCluster, reason: str) -> Callable[[], bool]:
    def check() -> bool:
        state = cluster.node_state()
        return bool(state["states"] & {"DRAIN", "DRAINED", "DRAINING"}) and state["reason"] == reason

    return check
