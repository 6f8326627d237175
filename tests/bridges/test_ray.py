"""The Ray bridge against a real Ray (a head and a worker on this machine, tests/ray_cluster.py): the worker is
drained with reason preemption, the agent's message and the notice's deadline; the head is refused; several
raylets on one address need ``node_id``; drills stay away from Ray unless enabled; without Ray installed the
bridge says so at start; a GCS that is down is the agent's own log line, with nothing of Ray's raw."""

from __future__ import annotations

import asyncio
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from agent.bridges.common import drain_reason
from agent.bridges.ray import MAX_LOG_LINES, RayBridge, RayConfig, RayError, child_log, pick_node
from agent.bridges.ray_gcs import NOT_INSTALLED, RayNode
from agent.config import load_config
from agent.core.errors import ConfigError
from agent.core.notice import EventType, Notice
from tests.actions_support import event, make_notice
from tests.ray_cluster import RayCluster, Unavailable, _ports
from tests.support import AgentProcess, http_json, running_agent

pytestmark = pytest.mark.timeout(180)

# A driver that keeps an actor on the worker (resource pd_worker), so the drained worker stays up, draining,
# until the driver ends; prints the worker's node id once the actor runs.
HOLDER = textwrap.dedent(
    """
    import sys, ray
    ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
    @ray.remote(resources={"pd_worker": 1}, num_cpus=0)
    class Hold:
        def node(self):
            return ray.get_runtime_context().get_node_id()
    hold = Hold.remote()
    print(ray.get(hold.node.remote()), flush=True)
    sys.stdin.read()
    """
)


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[RayCluster]:
    pytest.importorskip("ray", reason="Ray is not installed (pip install 'preemptd[ray]')")
    cluster = RayCluster()
    try:
        cluster.start()
    except Unavailable as exc:
        cluster.stop()
        pytest.skip(f"no Ray cluster could start here: {exc}")
    yield cluster
    cluster.stop()


def bridge_for(cluster: RayCluster, node_id: str = "") -> RayBridge:
    return RayBridge(RayConfig(enabled=True, address=cluster.address, node_id=node_id, retries=1))


# --- pure ----------------------------------------------------------------------------------------------


def test_pick_node_by_address() -> None:
    nodes = [RayNode("aa", "10.0.0.1", True, True), RayNode("bb", "10.0.0.2", False, True)]
    assert pick_node(nodes, ["10.0.0.2", "host"]).node_id == "bb"


def test_pick_node_ignores_dead_nodes() -> None:
    nodes = [RayNode("aa", "10.0.0.2", False, False), RayNode("bb", "10.0.0.2", False, True)]
    assert pick_node(nodes, ["10.0.0.2"]).node_id == "bb"


def test_pick_node_needs_node_id_when_one_address_has_several() -> None:
    nodes = [RayNode("aa", "10.0.0.2", True, True), RayNode("bb", "10.0.0.2", False, True)]
    with pytest.raises(
        RayError, match=r"2 live Ray nodes run at this host's address .* set actions\.ray\.node_id"
    ):
        pick_node(nodes, ["10.0.0.2"])


def test_pick_node_unknown_id() -> None:
    with pytest.raises(RayError, match=r"no live node cc \(actions\.ray\.node_id\)"):
        pick_node([RayNode("aa", "10.0.0.2", False, True)], [], "cc")


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        (
            "[2026-12-03 18:27:32,169 W 25758 25776] rpc_client.h:153: Failed to connect to GCS at address "
            "127.0.0.1:1 within 5 seconds.",
            (
                "warning",
                {
                    "call": "nodes",
                    "at": "rpc_client.h:153",
                    "message": "Failed to connect to GCS at address 127.0.0.1:1 within 5 seconds.",
                },
            ),
        ),
        (
            "[2026-12-03 18:27:32,169 E 25758 25776] gcs_client.cc:210: Failed to get cluster ID",
            ("error", {"call": "nodes", "at": "gcs_client.cc:210", "message": "Failed to get cluster ID"}),
        ),
        (
            '{"level": "WARNING", "logger": "ray._private.services", "message": "Found multiple active Ray"}',
            (
                "warning",
                {"call": "nodes", "logger": "ray._private.services", "message": "Found multiple active Ray"},
            ),
        ),
        (
            '{"level": "bind", "logger": "x", "message": "an unknown level"}',
            ("warning", {"call": "nodes", "logger": "x", "message": "an unknown level"}),
        ),
        (
            "Traceback (most recent call last):",
            ("warning", {"call": "nodes", "message": "Traceback (most recent call last):"}),
        ),
    ],
)
def test_a_childs_stderr_line_becomes_a_ray_log_event(
    line: str, expected: tuple[str, dict[str, Any]]
) -> None:
    assert [expected] == child_log([line + "\n", "\n"], "nodes")


def test_a_childs_stderr_is_bounded() -> None:
    events = child_log(["x" * 5000] * (MAX_LOG_LINES + 3), "drain")
    assert MAX_LOG_LINES + 1 == len(events)
    assert 2000 == len(events[0][1]["message"])
    assert ("warning", {"call": "drain", "message": "3 more lines left out"}) == events[-1]


@pytest.mark.parametrize(
    ("setting", "key"),
    [("timeout_s = 1e-9", "timeout_s"), ("retries = -1", "retries"), ("history_size = 0", "history_size")],
)
def test_a_ray_value_out_of_range_is_refused_by_key(base: Path, setting: str, key: str) -> None:
    """A GCS timeout of a nanosecond (every call a busy failure), negative retries or no history: the loader
    refuses the value, naming its key."""
    path = base / "preemptd.toml"
    path.write_text(f"[actions.ray]\nenabled = true\n{setting}\n")
    with pytest.raises(ConfigError, match=rf"actions\.ray\.{key}"):
        load_config(path=path, env={}).table("actions.ray", RayConfig)


# The bridge's child as it runs where Ray is not installed.
WITHOUT_RAY = textwrap.dedent(
    """
    import runpy, sys
    sys.modules["ray"] = None
    runpy.run_module("agent.bridges.ray_gcs", run_name="__main__")
    """
)


async def test_without_ray_the_bridge_says_so_at_start() -> None:
    """Ray not importable (as on a host without the extra): degraded at start, with what to install."""
    without_ray = [sys.executable, "-c", WITHOUT_RAY]
    bridge = RayBridge(RayConfig(enabled=True), helper=without_ray)
    with capture_logs() as logs:
        await bridge.start()
        await bridge.drain_tasks()
    await bridge.stop(1)
    assert (bridge.status()["state"], bridge.status()["degraded_reason"]) == ("degraded", NOT_INSTALLED)
    assert "ray_degraded" in [e["event"] for e in logs]


# --- against the real Ray ------------------------------------------------------------------------------


@pytest.mark.slow
async def test_one_address_with_two_raylets_needs_node_id(ray_cluster: RayCluster) -> None:
    """Head and worker share 127.0.0.1 here: matching by address cannot choose, and says what to set."""
    bridge = RayBridge(RayConfig(enabled=True, address=ray_cluster.address), names=lambda: ["127.0.0.1"])
    await bridge.start()
    await bridge.drain_tasks()
    assert bridge.status()["state"] == "degraded"
    assert "set actions.ray.node_id" in bridge.status()["degraded_reason"]
    await bridge.stop(1)


async def test_head_node_is_refused(ray_cluster: RayCluster) -> None:
    head, _ = ray_cluster.node_ids()
    bridge = bridge_for(ray_cluster, node_id=head)
    await bridge.start()
    notice = make_notice(deadline_in=300, source="aws", drill=False)
    bridge.handle(event(EventType.NOTICE, notice))
    await bridge.drain_tasks()
    entry = bridge.status()["notices"][notice.id]
    assert entry["state"] == "refused"
    assert f"this host's Ray node {head} is the head node" in entry["error"]
    assert head not in ray_cluster.gcs().get_draining_nodes(timeout=10)
    assert ray_cluster.nodes()[head].state == 0  # still alive
    await bridge.stop(1)


async def ray_status(sock: Path, until: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    """The bridge's status once ``until`` holds for it (polled: the bridge works in the background)."""
    for _ in range(600):
        status, doc = await http_json(sock, "GET", "/v1/status")
        assert 200 == status, doc
        shown: dict[str, Any] = doc["actions"]["reactors"]["ray"]
        if until(shown):
            return shown
        await asyncio.sleep(0.2)
    raise AssertionError(f"the Ray bridge never got there: {shown}")


async def test_drills_are_off_by_default_and_leave_the_worker_alone(
    ray_cluster: RayCluster, base: Path
) -> None:
    """A drain cannot be undone in Ray (the node stays draining until it dies), so without ``drills = true``
    a drill reaches the clients but not Ray: status says why, and the worker is not draining. (Runs before
    the drill that drains the module's worker.)"""
    _, worker = ray_cluster.node_ids()
    settings = {
        "actions.ray.enabled": True,
        "actions.ray.address": ray_cluster.address,
        "actions.ray.node_id": worker,
    }
    async with running_agent(base, settings):
        sock = base / "a.sock"
        await ray_status(sock, lambda shown: shown["node_id"] == worker and shown["state"] == "ok")
        status, body = await http_json(sock, "POST", "/v1/drills", {"kind": "termination", "in_s": 300})
        assert 201 == status, body
        notice_id = body["notice"]["id"]
        shown = await ray_status(sock, lambda shown: notice_id in shown["notices"])
    draining = await asyncio.to_thread(ray_cluster.gcs().get_draining_nodes, timeout=10)
    assert (worker not in draining, 0) == (True, ray_cluster.nodes()[worker].state)  # alive, not draining
    assert "skipped" == shown["notices"][notice_id]["state"]
    assert "actions.ray.drills" in shown["notices"][notice_id]["why"]


@pytest.mark.slow
async def test_drill_drains_the_worker_with_reason_and_deadline(ray_cluster: RayCluster, base: Path) -> None:
    """Through the agent: a drill → the worker is draining with the notice's deadline; once idle it dies with
    the agent's reason (Ray's DRAIN_NODE_REASON_PREEMPTION)."""
    _, worker = ray_cluster.node_ids()
    holder = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        HOLDER,
        ray_cluster.address,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        env=ray_cluster.env,
    )
    assert holder.stdin is not None and holder.stdout is not None
    settings = {
        "actions.ray.enabled": True,
        "actions.ray.address": ray_cluster.address,
        "actions.ray.node_id": worker,
        "actions.ray.drills": True,
    }
    try:
        placed = await asyncio.wait_for(holder.stdout.readline(), 90)
        assert placed.decode().strip() == worker
        async with running_agent(base, settings):
            sock = base / "a.sock"
            status, body = await http_json(sock, "POST", "/v1/drills", {"kind": "termination", "in_s": 300})
            assert status == 201, body
            notice = Notice.from_json(body["notice"])
            for _ in range(300):
                _, doc = await http_json(sock, "GET", "/v1/status")
                shown = doc["actions"]["reactors"]["ray"]["notices"].get(notice.id, {})
                if shown.get("state") not in (None, "pending"):
                    break
                await asyncio.sleep(0.2)
        assert shown["state"] == "drained", shown
        assert notice.deadline is not None
        draining = await asyncio.to_thread(ray_cluster.gcs().get_draining_nodes, timeout=10)
        assert abs(draining[worker] - notice.deadline.timestamp() * 1000) <= 1
    finally:
        holder.stdin.close()
        await asyncio.wait_for(holder.wait(), 60)
    dead = None
    end = time.monotonic() + 60
    while time.monotonic() < end:
        dead = ray_cluster.nodes()[worker]
        if dead.state != 0:
            break
        await asyncio.sleep(0.5)
    assert dead is not None and dead.state != 0, "the drained worker did not stop once idle"
    assert dead.death_info.reason_message == drain_reason(notice)
    assert "PREEMPTED" in type(dead.death_info).Reason.Name(dead.death_info.reason)


@pytest.mark.slow
async def test_an_unreachable_gcs_is_one_clear_agent_line_and_nothing_of_ray_lands_raw(base: Path) -> None:
    """The agent as a process, its Ray bridge pointed at a GCS that is down (a closed port): its log (stdout
    and stderr) holds JSON lines only — Ray's own warnings come as ``ray_log`` events — and the agent says
    itself that the GCS did not answer, where, and what to check."""
    (port,) = _ports(1)
    address = f"127.0.0.1:{port}"
    agent = AgentProcess(
        base,
        [
            "--set", "actions.ray.enabled=true", "--set", f"actions.ray.address={address}",
            "--set", "actions.ray.timeout_s=2", "--set", "actions.ray.retries=0",
        ],
    )  # fmt: skip
    await agent.start(timeout=60)
    try:
        shown = await ray_status(agent.socket_path, lambda shown: shown["state"] == "degraded")
    finally:
        assert 0 == await agent.stop(timeout=60)
    raw = [line for line in agent.logs_text().splitlines() if not line.startswith("{")]
    assert [] == raw
    [line] = [r for r in agent.logs() if r["event"] == "ray_gcs_unreachable"]
    assert (address, "error") == (line["address"], line["level"])
    assert f"the Ray GCS at {address} did not answer" in line["error"]
    assert shown["degraded_reason"] == line["error"]


@pytest.mark.slow
async def test_a_gcs_that_goes_down_between_notices_is_said_without_waiting_for_one(
    ray_cluster: RayCluster,
) -> None:
    """The bridge found the cluster; then the head (its GCS) stops: the bridge's check of the GCS's port says
    so in the log (``ray_gcs_unreachable``, naming the address) and in status, with no notice needed. Last
    in the module: it stops the module's cluster."""
    # The module's drill took the worker away; the head is there.
    [head] = [key for key, info in ray_cluster.nodes().items() if info.is_head_node and info.state == 0]
    bridge = RayBridge(
        RayConfig(enabled=True, address=ray_cluster.address, node_id=head, retries=0, check_interval_s=0.2)
    )
    with capture_logs() as logs:
        await bridge.start()
        await bridge.drain_tasks()  # the lookup: the head, refused (degraded, but the GCS answers)
        assert "is the head node" in str(bridge.status()["degraded_reason"])
        await asyncio.to_thread(ray_cluster.stop_head)
        for _ in range(300):
            if any(e["event"] == "ray_gcs_unreachable" for e in logs):
                break
            await asyncio.sleep(0.1)
        await bridge.stop(1)
    [line] = [e for e in logs if e["event"] == "ray_gcs_unreachable"]
    assert ray_cluster.address == line["address"]
    assert f"the Ray GCS at {ray_cluster.address} did not answer" in line["error"]
    assert bridge.status()["degraded_reason"] == line["error"]
