"""The RAM tier's job id from the pod a process runs in (issue 24 item 1: "the pod's owner"): the Kubernetes
bridge names a JobSet's pods by the JobSet's UID and other pods by their controller, ``GET
/v1/ram-tier/job-id`` answers the asking process (SO_PEERCRED pid -> its cgroup -> its pod), and the client's
``resolve_job_id`` (what ``ShardedStore`` uses) takes it when its environment names no job. End to end: a real
agent with the fake API server, a process moved into a cgroup named as the kubelet names a pod's."""

from __future__ import annotations

import asyncio
import os
import sys
import textwrap
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lightkube", reason="the kubernetes extra is not installed")

from agent.bridges.kubernetes.jobname import JOBSET_UID, job_of_pod
from agent.client.peer.ramtier import NoJobId, job_id, resolve_job_id
from agent.core.jobs import JobName, JobNameRegistry, UnknownJob
from agent.service.daemon import Agent
from agent.window.limits import WINDOW_LIMITS
from tests.k8s_fake import FakeKube, pod_cgroup
from tests.support import REPO, agent_config, http_json, running_agent

NODE = "gpu-node-1"

# Asks the agent at argv[1] for its job once told (a line on stdin: it is in its pod's cgroup by then); prints
# the id, or the NoJobId message after "no: ".
ASK = textwrap.dedent(
    """
    import sys
    from agent.client.peer.ramtier import NoJobId, resolve_job_id
    sys.stdin.readline()
    try:
        print(resolve_job_id(None, sys.argv[1]))
    except NoJobId as exc:
        print("no:", exc)
    """
)


def _pod(labels: dict[str, str] | None = None, owners: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"metadata": {"namespace": "ml", "name": "train-0", "labels": labels, "ownerReferences": owners}}


def test_a_jobsets_pods_are_named_by_its_uid_and_other_pods_by_their_controller() -> None:
    job = {"kind": "Job", "name": "train-workers-0", "uid": "1b2c", "controller": True}
    assert "jobset-9f8e" == job_of_pod(_pod({JOBSET_UID: "9f8e"}, [job])).job
    named = job_of_pod(_pod({}, [{"kind": "Job", "uid": "0a", "controller": False}, job]))
    assert ("job-1b2c", "pod ml/train-0's controller Job train-workers-0") == (named.job, named.source)
    assert (
        "pytorchjob-77"
        == job_of_pod(_pod(None, [{"kind": "PyTorchJob", "uid": "77", "controller": True}])).job
    )
    with pytest.raises(UnknownJob, match="pod ml/train-0 has no controller"):
        job_of_pod(_pod())


async def test_the_registry_takes_the_first_source_that_names_a_valid_job_and_says_why_the_others_did_not() -> (
    None
):
    registry = JobNameRegistry()

    async def hangs(pid: int) -> JobName:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async def fails(pid: int) -> JobName:
        raise ConnectionResetError("the API server went away")

    async def unknown(pid: int) -> JobName:
        raise UnknownJob(f"pid {pid} runs in no pod")

    async def invalid(pid: int) -> JobName:
        return JobName("a job/with a slash", "somewhere")

    async def names(pid: int) -> JobName:
        return JobName(f"job-{pid}", "a test's source")

    for name, source in [("a", hangs), ("b", fails), ("c", unknown), ("d", invalid), ("e", names)]:
        registry.add(name, source)
    found, why = await registry.name_of(42, timeout=0.1)
    assert found == JobName("job-42", "a test's source")
    assert [
        "a: no answer in 0.1 s",
        "b: ConnectionResetError: the API server went away",
        "c: pid 42 runs in no pod",
        "d: 'a job/with a slash' (somewhere) is not a valid job id",
    ] == why
    del registry.sources["e"]
    assert (None, why) == await registry.name_of(42, timeout=0.1)


def test_an_id_in_the_environment_comes_first_and_none_anywhere_is_a_no_job_id(tmp_path: Path) -> None:
    assert "given" == resolve_job_id("given", tmp_path / "no.sock")
    with pytest.raises(NoJobId, match="set PREEMPTD_JOB_ID") as raised:
        job_id(None, {})
    assert isinstance(raised.value, ValueError)  # what callers caught before


@pytest.fixture
async def kube() -> AsyncIterator[FakeKube]:
    async with FakeKube() as fake:
        fake.add_node(NODE)
        yield fake


def _settings(kube: FakeKube, base: Path, bridge: bool = True) -> dict[str, Any]:
    values: dict[str, Any] = {
        "ram_tier.enabled": True,
        "ram_tier.path": str(base / "ram"),
        "ram_tier.cap_bytes": 1 << 20,
    }
    if bridge:
        values.update(
            {
                "actions.kubernetes.enabled": True,
                "actions.kubernetes.node": NODE,
                "actions.kubernetes.kubeconfig": str(kube.write_kubeconfig(base / "kubeconfig")),
            }
        )
    return values


async def _ask(sock: Path, join: Any = None) -> str:
    """The answer of a process (in the pod's cgroup when ``join`` is given) whose environment names no job."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PREEMPTD_JOB_ID", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID")
    }
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-c", ASK, str(sock), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        env={**env, "PYTHONPATH": str(REPO)}, cwd=str(REPO),
    )  # fmt: skip
    if join is not None:
        join(child.pid)
    out, _ = await asyncio.wait_for(child.communicate(b"go\n"), 60)
    assert 0 == child.returncode
    return out.decode().strip()


async def test_a_process_in_a_jobsets_pod_gets_the_jobsets_id_from_the_agent(
    kube: FakeKube, base: Path
) -> None:
    """Two pods of one JobSet, one on this node; a process in that pod's cgroup gets ``jobset-<uid>``; a
    process in no pod, and one in a pod of another node, get a NoJobId saying so; the pod list is read again
    for a pod that was not in it."""
    jobset = "5d1c2a4e-0b7f-4c36-9a3e-2f1d6c0b9e11"
    train = kube.add_pod("ml", "train-workers-0-0", node=NODE, owner="Job", labels={JOBSET_UID: jobset})
    elsewhere = kube.add_pod("ml", "train-workers-0-1", node="other-node", owner="Job")
    async with running_agent(base, _settings(kube, base)):
        sock = base / "a.sock"
        outside = await _ask(sock)
        with pod_cgroup(elsewhere["metadata"]["uid"]) as join:
            other = await _ask(sock, join)
        later = kube.add_pod("ml", "eval-0", node=NODE, owner="PyTorchJob")
        with pod_cgroup(train["metadata"]["uid"]) as join:
            named = await _ask(sock, join)
        with pod_cgroup(later["metadata"]["uid"]) as join:
            added = await _ask(sock, join)
    assert f"jobset-{jobset}" == named
    assert f"pytorchjob-{later['metadata']['ownerReferences'][0]['uid']}" == added
    assert outside.startswith("no: no job id for the RAM tier") and "runs in no pod" in outside
    assert f"is not among node {NODE}'s pods" in other


async def test_without_a_part_that_knows_the_job_the_agent_says_so(kube: FakeKube, base: Path) -> None:
    async with running_agent(base, _settings(kube, base, bridge=False)):
        answer = await _ask(base / "a.sock")
        status, body = await http_json(base / "a.sock", "GET", "/v1/ram-tier/job-id")
    assert answer.startswith("no: ") and "no part of this agent knows which job" in answer
    assert 404 == status and "Kubernetes bridge" in body["error"]


async def test_a_reload_that_turns_the_bridge_off_takes_its_job_names_and_window_limit_back(
    kube: FakeKube, base: Path
) -> None:
    """The bridge's offers go with it: after a reload with ``[actions.kubernetes]`` off, the agent knows no
    job for a process in a pod (and the window no longer asks the pods' grace); turned on again, it does."""
    pod = kube.add_pod("ml", "train-0", node=NODE, owner="Job")
    values = _settings(kube, base)
    agent = Agent(agent_config(base, values), reload_config=lambda: agent_config(base, values))
    await agent.start()
    answers, limits = [], []
    try:
        with pod_cgroup(pod["metadata"]["uid"]) as join:
            for enabled in (True, False, True):
                values["actions.kubernetes.enabled"] = enabled
                await agent.reload()
                answers.append(await _ask(base / "a.sock", join))
                limits.append(sorted(agent.hooks.capability(WINDOW_LIMITS).sources))
    finally:
        await agent.stop()
    owner = pod["metadata"]["ownerReferences"][0]["uid"]
    assert [f"job-{owner}", f"job-{owner}"] == [answers[0], answers[2]]
    assert answers[1].startswith("no: ") and "no part of this agent knows which job" in answers[1]
    assert ["kubernetes" in names for names in limits] == [True, False, True]
