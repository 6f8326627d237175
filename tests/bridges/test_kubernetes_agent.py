"""End to end: a real agent on a temporary socket with ``[actions.kubernetes]``, the fake API server
(tests/k8s_fake.py) as its cluster, and the training example as the participant on the node. A drill taints,
cordons and posts an Event at once; the training pod is evicted only after its emergency checkpoint made
the notice ready, or at deadline - grace - margin when it never reports; clearing puts the node back."""

from __future__ import annotations

import asyncio
import copy
import json
import os
import socket
import sys
import textwrap
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lightkube", reason="the kubernetes extra is not installed")

from agent.client import EXIT_PREEMPTED, CheckpointStore
from agent.client.reporting import Reporter, client_info
from agent.core.notice import parse_time
from agent.service.daemon import Agent
from tests.k8s_fake import FakeKube, pod_cgroup
from tests.support import REPO, ExampleRun, SSEClient, agent_config, drill, http_json, running_agent

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

NODE = "gpu-node-1"
# A pod's host name is its name (off the host network): the example's client reports this one.
TRAIN_POD = socket.gethostname()
ADMIN_TAINT = {"key": "dedicated", "value": "training", "effect": "NoSchedule"}


@pytest.fixture
async def kube() -> AsyncIterator[FakeKube]:
    async with FakeKube() as fake:
        fake.add_node(NODE, taints=[dict(ADMIN_TAINT)])
        fake.add_node("other-node")
        fake.add_pod("kube-system", "nvidia-dcgm-exporter-abcde", node=NODE, owner="DaemonSet")
        yield fake


def settings(kube: FakeKube, base: Path, **extra: Any) -> dict[str, Any]:
    values: dict[str, Any] = {
        "actions.kubernetes.enabled": True,
        "actions.kubernetes.node": NODE,
        "actions.kubernetes.kubeconfig": str(kube.write_kubeconfig(base / "kubeconfig")),
        "actions.kubernetes.drills": True,
        "actions.kubernetes.retry_max_s": 2.0,
        "actions.ready.grace_s": 60.0,
    }
    values.update(extra)
    return values


async def bridge_status(sock: Path) -> dict[str, Any]:
    status, body = await http_json(sock, "GET", "/v1/status")
    assert 200 == status, body
    shown: dict[str, Any] = body["actions"]["reactors"]["kubernetes"]
    return shown


def taint_keys(kube: FakeKube) -> list[str]:
    return [t["key"] for t in kube.nodes[NODE]["spec"].get("taints") or []]


def write_state(directory: Path) -> None:
    (directory / "model.bin").write_bytes(os.urandom(4096))


# A training process that has not saved yet: once told (a line on stdin: it is in its pod's cgroup by then),
# it subscribes and prints each event's type (the snapshot first, so the test knows it is subscribed).
SUBSCRIBER = textwrap.dedent(
    """
    import sys
    from agent.client.transport import EventStream
    sys.stdin.readline()
    for message in EventStream(sys.argv[1], read_timeout=None):
        print(message.event, flush=True)
    """
)


async def test_drill_taints_at_once_and_evicts_the_training_pod_after_its_checkpoint(
    kube: FakeKube, base: Path
) -> None:
    """The test is the training process of pod train-0, through the client library: it saves when it
    chooses, so the order is the agent's alone."""
    kube.add_pod("ml", "train-0", node=NODE, owner="Job", grace_s=30)
    kube.add_pod("web", "inference-6d8f-x", node=NODE, owner="ReplicaSet")
    sock = base / "a.sock"
    reporter = Reporter(sock, client={**client_info(name="train.py"), "host": "train-0"})
    store = CheckpointStore(base / "ckpt", reporter=reporter)
    async with running_agent(base, settings(kube, base)):
        events = await SSEClient.connect(sock)
        try:
            await asyncio.to_thread(store.save, 1, write_state)  # a periodic save: now a participant
            assert await asyncio.to_thread(reporter.flush, 10)
            notice_id = await drill(sock, in_s=120)
            # At once: taint, cordon, condition and Event, and the pod without participants goes.
            await kube.wait_for(
                lambda: (
                    "preemptd.io/notice" in taint_keys(kube)
                    and bool(kube.nodes[NODE]["spec"].get("unschedulable"))
                    and bool(kube.node_events(NODE))
                    and ("web", "inference-6d8f-x") in kube.evicted
                )
            )
            waiting = (await bridge_status(sock))["drains"][notice_id]["pods"]["ml/train-0"]
            assert ("ml", "train-0") in kube.pods
            await asyncio.to_thread(store.save, 2, write_state, emergency=True, notice_id=notice_id)
            assert await asyncio.to_thread(reporter.flush, 10)
            ready = await events.until(lambda e: e["type"] == "ready", timeout=30)
            await kube.wait_for(lambda: ("ml", "train-0") in kube.evicted)
            shown = await bridge_status(sock)
        finally:
            await events.close()
            reporter.close()
    assert ("waiting", True) == (waiting["state"], waiting["participant"])
    assert (notice_id, "all_participants") == (ready["data"]["notice_id"], ready["data"]["reason"])
    ready_at = parse_time(ready["time"])
    [train_eviction] = kube.calls("POST", r"/api/v1/namespaces/ml/pods/train-0/eviction")
    assert train_eviction.time is not None and train_eviction.time >= ready_at
    assert ADMIN_TAINT in kube.nodes[NODE]["spec"]["taints"]
    assert ("kube-system", "nvidia-dcgm-exporter-abcde") in kube.pods  # a DaemonSet's pod stays
    [posted] = kube.node_events(NODE)
    assert ("TerminationNotice", "Warning") == (posted["reason"], posted["type"])
    assert "Drill: termination notice" in posted["message"] and "deadline" in posted["message"]
    pods = shown["drains"][notice_id]["pods"]
    assert ("evicted", "ready") == (pods["ml/train-0"]["state"], pods["ml/train-0"]["because"])
    assert ("evicted", False, "no_participants") == (
        pods["web/inference-6d8f-x"]["state"],
        pods["web/inference-6d8f-x"]["participant"],
        pods["web/inference-6d8f-x"]["because"],
    )


async def test_the_training_examples_emergency_checkpoint_releases_its_pod(
    kube: FakeKube, base: Path
) -> None:
    """The example (real torch) as the participant: its pod is evicted once its emergency checkpoint made
    the notice ready, and it exits 75."""
    kube.add_pod("ml", TRAIN_POD, node=NODE, owner="Job", grace_s=30)
    sock = base / "a.sock"
    async with running_agent(base, settings(kube, base)):
        events = await SSEClient.connect(sock)
        try:
            run = await ExampleRun.start(
                "--checkpoint-dir", str(base / "ckpt"), "--steps", "100000", "--step-time", "0.01",
                "--interval-s", "0.05", "--socket", str(sock),
            )  # fmt: skip
            await run.until("agent_connected")
            await run.until("checkpoint")  # a periodic one: the agent now knows this participant
            notice_id = await drill(sock, in_s=120)
            assert EXIT_PREEMPTED == await run.finish()
            ready = await events.until(lambda e: e["type"] == "ready", timeout=30)
            await kube.wait_for(lambda: ("ml", TRAIN_POD) in kube.evicted)
            shown = await bridge_status(sock)
        finally:
            await events.close()
    [eviction] = kube.calls("POST", rf"/api/v1/namespaces/ml/pods/{TRAIN_POD}/eviction")
    assert eviction.time is not None and eviction.time >= parse_time(ready["time"])
    pod = shown["drains"][notice_id]["pods"][f"ml/{TRAIN_POD}"]
    assert ("evicted", True, "ready") == (pod["state"], pod["participant"], pod["because"])


async def test_a_subscribed_process_holds_its_pod_until_ready_before_it_ever_reported(
    kube: FakeKube, base: Path
) -> None:
    """A training process that is subscribed but has not saved yet (so it never reported): its pod is a
    training pod from its first connection, held for the notice's ready; a pod without one goes at once."""
    train = kube.add_pod("ml", "train-0", node=NODE, owner="Job", grace_s=30)
    kube.add_pod("web", "inference-6d8f-x", node=NODE, owner="ReplicaSet")
    sock = base / "a.sock"
    with pod_cgroup(train["metadata"]["uid"]) as join:
        async with running_agent(base, settings(kube, base)):
            child = await asyncio.create_subprocess_exec(
                sys.executable, "-c", SUBSCRIBER, str(sock), stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=str(REPO),
            )  # fmt: skip
            assert child.stdin is not None and child.stdout is not None
            try:
                join(child.pid)
                child.stdin.write(b"subscribe\n")
                assert b"snapshot\n" == await asyncio.wait_for(child.stdout.readline(), 60)
                notice_id = await drill(sock, in_s=120)
                await kube.wait_for(lambda: ("web", "inference-6d8f-x") in kube.evicted)
                shown = await bridge_status(sock)
            finally:
                child.kill()
                await child.wait()
    pod = shown["drains"][notice_id]["pods"]["ml/train-0"]
    assert ("waiting", True) == (pod["state"], pod["participant"])
    assert ("ml", "train-0") not in kube.evicted


async def test_an_eviction_refused_with_409_for_a_while_happens_once_the_api_answers_again(
    kube: FakeKube, base: Path
) -> None:
    """The API answers the training pod's eviction with 409 Conflict for its first seven attempts (about
    half a minute with a doubling backoff): the drain goes on retrying and evicts the pod, before the
    deadline, once the API takes it (with the default retry_max_s of 30 s)."""
    kube.add_pod("ml", "train-0", node=NODE, owner="Job", grace_s=3)
    kube.fail("POST", r"/api/v1/namespaces/ml/pods/train-0/eviction", 409, times=7)
    sock = base / "a.sock"
    extra = {"actions.kubernetes.retry_max_s": 30.0, "actions.kubernetes.eviction_retry_s": 1.0}
    async with running_agent(base, settings(kube, base, **extra)):
        notice_id = await drill(sock, in_s=50)  # no participant: the pod goes at once
        await kube.wait_for(lambda: ("ml", "train-0") in kube.evicted, timeout=60)
        shown = await bridge_status(sock)
    pod = shown["drains"][notice_id]["pods"]["ml/train-0"]
    assert ("evicted", 8) == (pod["state"], pod["attempts"])
    assert [409] * 7 + [201] == [r.status for r in kube.calls("POST", r".*/pods/train-0/eviction")]


async def test_a_participant_that_never_reports_is_evicted_at_deadline_minus_grace_minus_margin(
    kube: FakeKube, base: Path
) -> None:
    kube.add_pod("ml", "train-0", node=NODE, owner="Job", grace_s=3)
    sock = base / "a.sock"
    extra = {"actions.kubernetes.drain_margin_s": 2.0, "actions.ready.deadline_margin_s": 1.0}
    async with running_agent(base, settings(kube, base, **extra)):
        # A training process in pod train-0 declares itself a participant, then never saves.
        status, body = await http_json(
            sock,
            "POST",
            "/v1/reports",
            {
                "kind": "checkpoint",
                "phase": "finished",
                "step": 10,
                "duration_s": 1.0,
                "client": {"name": "train.py", "host": "train-0", "participant": True, "pid": os.getpid()},
            },
        )
        assert status in {200, 202}, body
        notice_id = await drill(sock, in_s=10)
        await kube.wait_for(lambda: ("ml", "train-0") in kube.evicted, timeout=30)
        shown = await bridge_status(sock)
        _, full = await http_json(sock, "GET", "/v1/status")
    deadline = parse_time(full["notices"][0]["deadline"])
    [eviction] = kube.calls("POST", r"/api/v1/namespaces/ml/pods/train-0/eviction")
    pod = shown["drains"][notice_id]["pods"]["ml/train-0"]
    assert ("evicted", True, "deadline") == (pod["state"], pod["participant"], pod["because"])
    latest = parse_time(pod["evict_at"])
    assert abs((deadline - latest).total_seconds() - 5.0) < 0.01  # grace 3 + margin 2
    assert eviction.time is not None and eviction.time >= latest


async def test_clearing_the_notice_puts_the_node_back_and_keeps_the_administrators_taint(
    kube: FakeKube, base: Path
) -> None:
    before = copy.deepcopy(kube.nodes[NODE]["spec"])
    sock = base / "a.sock"
    async with running_agent(base, settings(kube, base)):
        notice_id = await drill(sock, in_s=120)
        await kube.wait_for(
            lambda: (
                bool(kube.nodes[NODE]["spec"].get("unschedulable"))
                and "PreemptdNotice" in [c["type"] for c in kube.nodes[NODE]["status"]["conditions"]]
                and bool(kube.node_events(NODE))
            )
        )
        status, body = await http_json(sock, "DELETE", f"/v1/drills/{notice_id}")
        assert status in (200, 204), body
        await kube.wait_for(lambda: kube.nodes[NODE]["spec"] == before and len(kube.node_events(NODE)) == 2)
        shown = await bridge_status(sock)
    assert [ADMIN_TAINT] == kube.nodes[NODE]["spec"]["taints"]
    assert ["Ready"] == [c["type"] for c in kube.nodes[NODE]["status"]["conditions"]]
    assert "preemptd.io/cordoned-for" not in kube.nodes[NODE]["metadata"]["annotations"]
    assert ["TerminationNotice", "NoticeCleared"] == [e["reason"] for e in kube.node_events(NODE)]
    assert "idle" == shown["state"]


@pytest.mark.service
async def test_an_unreachable_api_never_holds_up_the_notice_and_shows_in_status_and_metrics(
    base: Path,
) -> None:
    async with FakeKube() as gone:
        config = settings(gone, base)
    sock = base / "a.sock"
    async with running_agent(base, config) as agent:
        events = await SSEClient.connect(sock)
        try:
            await events.until(lambda e: e["type"] == "snapshot")
            notice_id = await drill(sock, in_s=60)
            notice = await events.until(lambda e: e["type"] == "notice")
        finally:
            await events.close()
        await agent.components[0].reactors.by_name()["kubernetes"].settled()
        shown = await bridge_status(sock)
        _, metrics = await http_json(sock, "GET", "/metrics")
    assert notice_id == notice["notice"]["id"]
    assert "unreachable: ConnectError" in shown["last_error"]
    assert 'preemptd_kubernetes_calls_total{outcome="unreachable",resource="nodes",verb="get"}' in str(
        metrics
    )


async def test_enabled_without_a_node_name_stops_the_agent_with_what_to_do(base: Path) -> None:
    config = base / "config.toml"
    config.write_text(
        f'socket = "{base / "a.sock"}"\nstate_dir = "{base / "state"}"\ncloud = "none"\nlog_format = "json"\n'
        "[actions.kubernetes]\nenabled = true\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "NODE_NAME" and not k.startswith("PREEMPTD_")}
    env["PYTHONPATH"] = str(REPO)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "agent", "run", "--config", str(config), env=env, cwd=str(REPO),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    out, _ = await asyncio.wait_for(proc.communicate(), 60)
    assert 2 == proc.returncode, out.decode()
    [line] = [json.loads(x) for x in out.decode().splitlines() if '"config_invalid"' in x]
    assert "actions.kubernetes.node: no node name" in line["error"]
    assert "NODE_NAME" in line["error"]


async def test_after_a_reload_the_new_bridge_still_clears_what_the_old_one_set(
    kube: FakeKube, base: Path
) -> None:
    before = copy.deepcopy(kube.nodes[NODE]["spec"])
    values = settings(kube, base)
    agent = Agent(agent_config(base, values), reload_config=lambda: agent_config(base, values))
    await agent.start()
    try:
        sock = base / "a.sock"
        notice_id = await drill(sock, in_s=120)
        await kube.wait_for(
            lambda: bool(kube.nodes[NODE]["spec"].get("unschedulable")) and bool(kube.node_events(NODE))
        )
        values["actions.kubernetes.event"] = False
        await agent.reload()
        status, body = await http_json(sock, "DELETE", f"/v1/drills/{notice_id}")
        assert status in (200, 204), body
        await kube.wait_for(lambda: kube.nodes[NODE]["spec"] == before)
        shown = await bridge_status(sock)
    finally:
        await agent.stop()
    assert ("idle", []) == (shown["state"], shown["notices"])
    assert ["TerminationNotice"] == [e["reason"] for e in kube.node_events(NODE)]  # events now off
