"""batch/v1 Jobs for the fake API server (tests/k8s_fake.py): creating and reading Jobs (and the Services that
go with them), and the Job controller's part that decides what a pod's failure does to its Job, as Kubernetes
documents it:

- https://kubernetes.io/docs/concepts/workloads/controllers/job/ ("Pod failure policy", "Pod backoff failure
  policy", "Completion mode", "Delayed creation of replacement pods");
- https://kubernetes.io/docs/tasks/job/pod-failure-policy/ ("Handling retriable and non-retriable pod failures
  with Pod failure policy");
- the batch/v1 API reference of ``PodFailurePolicy``, ``PodFailurePolicyRule``,
  ``PodFailurePolicyOnExitCodesRequirement`` and ``PodFailurePolicyOnPodConditionsPattern`` (matching as in
  kubernetes/kubernetes pkg/controller/job/pod_failure_policy.go).

What it does: the rules are evaluated in order and the first one that matches a failed pod decides (no match:
``Count``). ``onExitCodes`` looks at the terminated app and init containers (only ``containerName`` if given),
leaves out exit code 0, and matches when one container's code is ``In`` (or ``NotIn``) the values;
``onPodConditions`` matches when one pattern's type and status (default ``True``) is one of the pod's conditions.
``Ignore``: the failure is not counted toward ``backoffLimit`` (nor in ``status.failed``) and a replacement pod
is created for the index; ``Count``: counted; ``FailJob``: the Job fails at once (reason ``PodFailurePolicy``).
More than ``backoffLimit`` counted failures fail the Job (reason ``BackoffLimitExceeded``); a failed Job's
active pods are deleted. A pod is only judged once it is terminal (``Failed``): with a pod failure policy the
replacement of a terminating pod waits until it has failed (``podReplacementPolicy: Failed``, the only value
allowed then). The Job's pods carry the ``batch.kubernetes.io/job-tracking`` finalizer, so an evicted pod stays
(terminating) until the controller has accounted for it.

A ``successPolicy`` (Indexed Jobs) completes the Job once one of its rules holds: ``succeededIndexes``
succeeded (``succeededCount`` of them, if given) or ``succeededCount`` indexes did; the lingering pods are
deleted (https://kubernetes.io/docs/concepts/workloads/controllers/job/#success-policy).

What it leaves out: NonIndexed Jobs, ``FailIndex`` and ``backoffLimitPerIndex``, suspension, deadlines,
the backoff delay between replacements. Scheduling and the kubelet are the test's: a new pod is bound to a
node that is schedulable for it (not cordoned, its NoSchedule and NoExecute taints tolerated) and has no other
running pod of the Job (as a pod that takes a node's GPUs), and runs at once; :meth:`JobController.exit` ends
a pod's container with an exit code.
"""

from __future__ import annotations

import copy
import secrets
import uuid
from collections.abc import Mapping
from typing import Any

from aiohttp import web

from tests.k8s_fake import FakeKube, PatchError, json_response, now_rfc3339, status_error

JOB_NAME = "batch.kubernetes.io/job-name"
CONTROLLER_UID = "batch.kubernetes.io/controller-uid"
COMPLETION_INDEX = "batch.kubernetes.io/job-completion-index"
TRACKING = "batch.kubernetes.io/job-tracking"
ACTIONS = ("FailJob", "Ignore", "Count")  # and FailIndex, which needs backoffLimitPerIndex (not served here)
TERMINAL = ("Succeeded", "Failed")


# --- the pod failure policy -------------------------------------------------------------------------------


def _exit_code_matches(requirement: Mapping[str, Any], pod: Mapping[str, Any]) -> bool:
    status = pod.get("status") or {}
    wanted = set(requirement.get("values") or [])
    name = requirement.get("containerName")
    for container in [*(status.get("containerStatuses") or []), *(status.get("initContainerStatuses") or [])]:
        terminated = (container.get("state") or {}).get("terminated")
        if terminated is None or (name is not None and container.get("name") != name):
            continue
        code = terminated.get("exitCode", 0)
        if (
            code == 0
        ):  # "Containers completed with success (exit code 0) are excluded from the requirement check"
            continue
        if (code in wanted) == (requirement["operator"] == "In"):
            return True
    return False


def _condition_matches(patterns: list[Mapping[str, Any]], pod: Mapping[str, Any]) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(
        c.get("type") == p.get("type") and c.get("status") == p.get("status", "True")
        for c in conditions
        for p in patterns
    )


def match_pod_failure_policy(
    policy: Mapping[str, Any] | None, pod: Mapping[str, Any]
) -> tuple[str, int | None]:
    """The action a failed pod gets and the index of the rule that decided it (None: no rule matched, or no
    policy, so the default: ``Count``)."""
    for index, rule in enumerate((policy or {}).get("rules") or []):
        if rule.get("action") not in ACTIONS:
            continue  # "Clients should react to an unknown action by skipping the rule."
        if "onExitCodes" in rule and _exit_code_matches(rule["onExitCodes"], pod):
            return rule["action"], index
        if "onPodConditions" in rule and _condition_matches(rule["onPodConditions"], pod):
            return rule["action"], index
    return "Count", None


def validate_job(job: Mapping[str, Any]) -> None:
    """What the API server's Job validation says about the fields served here (422 otherwise)."""
    spec = job.get("spec") or {}
    template = (spec.get("template") or {}).get("spec") or {}
    if not template.get("containers"):
        raise PatchError(422, "Invalid", "spec.template.spec.containers: Required value")
    restart = template.get("restartPolicy")
    if restart not in ("Never", "OnFailure"):
        raise PatchError(422, "Invalid", f'spec.template.spec.restartPolicy: Unsupported value: "{restart}"')
    if spec.get("completionMode") != "Indexed" or not isinstance(spec.get("completions"), int):
        raise PatchError(422, "Invalid", "the fake serves Indexed Jobs only (completionMode, completions)")
    success = spec.get("successPolicy")
    if success is not None:
        for i, rule in enumerate(success.get("rules") or []):
            if "succeededIndexes" not in rule and "succeededCount" not in rule:
                raise PatchError(
                    422, "Invalid", f"spec.successPolicy.rules[{i}]: succeededIndexes or succeededCount"
                )
            if not 1 <= rule.get("succeededCount", 1) <= spec["completions"]:
                raise PatchError(
                    422, "Invalid", f"spec.successPolicy.rules[{i}].succeededCount: out of range"
                )
    policy = spec.get("podFailurePolicy")
    if policy is None:
        return
    if restart != "Never":
        raise PatchError(
            422, "Invalid", "spec.podFailurePolicy: Invalid value: only allowed with restartPolicy Never"
        )
    if spec.get("podReplacementPolicy", "Failed") != "Failed":
        raise PatchError(422, "Invalid", "spec.podReplacementPolicy: must be Failed with a podFailurePolicy")
    names = {c.get("name") for c in [*template.get("containers", []), *template.get("initContainers", [])]}
    rules = policy.get("rules") or []
    if len(rules) > 20:
        raise PatchError(422, "Invalid", "spec.podFailurePolicy.rules: Too many: at most 20")
    for i, rule in enumerate(rules):
        where = f"spec.podFailurePolicy.rules[{i}]"
        if rule.get("action") == "FailIndex":
            raise PatchError(
                422, "Invalid", f"{where}.action: FailIndex needs backoffLimitPerIndex (not served)"
            )
        if rule.get("action") not in ACTIONS:
            raise PatchError(422, "Invalid", f"{where}.action: Unsupported value: {rule.get('action')!r}")
        if ("onExitCodes" in rule) == ("onPodConditions" in rule):
            raise PatchError(422, "Invalid", f"{where}: specifying one of onExitCodes and onPodConditions")
        codes = rule.get("onExitCodes")
        if codes is not None:
            values = codes.get("values") or []
            if codes.get("operator") not in ("In", "NotIn"):
                raise PatchError(422, "Invalid", f"{where}.onExitCodes.operator: Unsupported value")
            if not values or len(values) > 255 or values != sorted(set(values)):
                raise PatchError(
                    422, "Invalid", f"{where}.onExitCodes.values: 1 to 255 values, ordered, no duplicates"
                )
            if codes["operator"] == "In" and 0 in values:
                raise PatchError(422, "Invalid", f"{where}.onExitCodes.values: 0 cannot be used with In")
            if "containerName" in codes and codes["containerName"] not in names:
                raise PatchError(
                    422, "Invalid", f"{where}.onExitCodes.containerName: not a container of the pod template"
                )
        for pattern in rule.get("onPodConditions") or []:
            if not pattern.get("type") or pattern.get("status", "True") not in ("True", "False", "Unknown"):
                raise PatchError(
                    422, "Invalid", f"{where}.onPodConditions: type, and status True/False/Unknown"
                )


def success_policy_met(policy: Mapping[str, Any] | None, completed: set[int]) -> bool:
    """Whether one of the ``successPolicy`` rules holds for the succeeded indexes: ``succeededIndexes`` (all
    of them, or ``succeededCount`` of them when both are given) or ``succeededCount`` of any indexes."""
    for rule in (policy or {}).get("rules") or []:
        indexes = set(_expand(rule["succeededIndexes"])) if "succeededIndexes" in rule else None
        done = completed if indexes is None else completed & indexes
        wanted = rule.get("succeededCount", len(indexes or ()))
        if len(done) >= wanted:
            return True
    return False


def compressed(indexes: set[int]) -> str:
    """``status.completedIndexes`` as the API writes it: ordered, runs as ``first-last`` (``"0,2-4"``)."""
    runs: list[list[int]] = []
    for index in sorted(indexes):
        if runs and index == runs[-1][1] + 1:
            runs[-1][1] = index
        else:
            runs.append([index, index])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _tolerated(taint: Mapping[str, Any], tolerations: list[Mapping[str, Any]]) -> bool:
    for t in tolerations:
        if t.get("effect") and t.get("effect") != taint.get("effect"):
            continue
        if t.get("operator") == "Exists" and (not t.get("key") or t.get("key") == taint.get("key")):
            return True
        if t.get("key") == taint.get("key") and t.get("value", "") == taint.get("value", ""):
            return True
    return False


# --- the controller -------------------------------------------------------------------------------------


class JobController:
    """Jobs and Services on a FakeKube: ``jobs = JobController(kube)``; Jobs are created through the API
    (``POST /apis/batch/v1/namespaces/NS/jobs``), and the controller runs after every request and on
    :meth:`sync`."""

    def __init__(self, kube: FakeKube) -> None:
        self.kube = kube
        self.jobs: dict[tuple[str, str], dict[str, Any]] = {}
        self.services: dict[tuple[str, str], dict[str, Any]] = {}
        # What the controller decided for each failed pod: (namespace, pod name) -> (action, rule index).
        self.decisions: dict[tuple[str, str], tuple[str, int | None]] = {}
        kube.extra_groups.setdefault("v1", []).append(("services", "Service", True, ["create", "get"]))
        kube.extra_groups.setdefault("batch/v1", []).extend(
            [("jobs", "Job", True, ["create", "get", "list"]), ("jobs/status", "Job", True, ["get"])]
        )
        ns = r"/namespaces/(?P<namespace>[^/]+)"
        kube.extra_routes.extend(
            [
                ("POST", r"/apis/batch/v1" + ns + r"/jobs", self._create_job),
                ("GET", r"/apis/batch/v1" + ns + r"/jobs", self._list_jobs),
                ("GET", r"/apis/batch/v1" + ns + r"/jobs/(?P<name>[^/]+)(?:/status)?", self._get_job),
                ("POST", r"/api/v1" + ns + r"/services", self._create_service),
                ("GET", r"/api/v1" + ns + r"/services/(?P<name>[^/]+)", self._get_service),
            ]
        )
        kube.after_request.append(self.sync)

    # --- what the test plays: the kubelet ------------------------------------------------------------------

    def pods_of(self, job: str, namespace: str = "default") -> list[dict[str, Any]]:
        """The Job's pods that are still in the API, oldest first."""
        uid = self.jobs[(namespace, job)]["metadata"]["uid"]
        return [
            pod
            for (pod_ns, _), pod in self.kube.pods.items()
            if pod_ns == namespace and pod["metadata"].get("labels", {}).get(CONTROLLER_UID) == uid
        ]

    def exit(self, namespace: str, name: str, exit_code: int, container: str | None = None) -> None:
        """The pod's container (the first, or ``container``) exits with ``exit_code``; the others, if any,
        with 0. The pod is then terminal (restartPolicy Never): Succeeded when every container exited 0."""
        pod = self.kube.pods[(namespace, name)]
        containers = pod["spec"]["containers"]
        failing = container or containers[0]["name"]
        statuses = []
        for each in containers:
            code = exit_code if each["name"] == failing else 0
            terminated = {
                "exitCode": code,
                "reason": "Completed" if code == 0 else "Error",
                "startedAt": pod["status"].get("startTime", now_rfc3339()),
                "finishedAt": now_rfc3339(),
            }
            statuses.append(_container_status(each, {"terminated": terminated}))
        pod["status"]["containerStatuses"] = statuses
        pod["status"]["phase"] = "Succeeded" if exit_code == 0 else "Failed"
        pod["metadata"]["resourceVersion"] = self.kube._next_version()
        self.sync()

    # --- the controller --------------------------------------------------------------------------------------

    def sync(self) -> None:
        for (namespace, _), job in self.jobs.items():
            if not self._finished(job):
                self._sync_job(namespace, job)

    @staticmethod
    def _finished(job: Mapping[str, Any]) -> bool:
        return any(
            c["type"] in ("Complete", "Failed") and c["status"] == "True"
            for c in job["status"].get("conditions") or []
        )

    def _sync_job(self, namespace: str, job: dict[str, Any]) -> None:
        spec, status = job["spec"], job["status"]
        pods = self.pods_of(job["metadata"]["name"], namespace)
        completed = {int(i) for i in _expand(status.get("completedIndexes", ""))}
        fail_message = None
        for pod in pods:
            meta = pod["metadata"]
            if TRACKING not in (meta.get("finalizers") or []) or pod["status"].get("phase") not in TERMINAL:
                continue
            index = int(meta["annotations"][COMPLETION_INDEX])
            if pod["status"]["phase"] == "Succeeded":
                completed.add(index)
                status["succeeded"] = status.get("succeeded", 0) + 1
            else:
                action, rule = match_pod_failure_policy(spec.get("podFailurePolicy"), pod)
                self.decisions[(namespace, meta["name"])] = (action, rule)
                if action != "Ignore":
                    status["failed"] = status.get("failed", 0) + 1
                if action == "FailJob":
                    fail_message = f"Pod {namespace}/{meta['name']} matched FailJob rule at index {rule}"
            self._release(pod)
        status["completedIndexes"] = compressed(completed)
        if fail_message is not None:
            self._finish(namespace, job, "Failed", "PodFailurePolicy", fail_message)
            return
        if status.get("failed", 0) > spec["backoffLimit"]:
            message = "Job has reached the specified backoff limit"
            self._finish(namespace, job, "Failed", "BackoffLimitExceeded", message)
            return
        if len(completed) >= spec["completions"]:
            self._finish(
                namespace, job, "Complete", "CompletionsReached", "Reached expected number of succeeded pods"
            )
            return
        if success_policy_met(spec.get("successPolicy"), completed):
            self._finish(
                namespace, job, "Complete", "SuccessPolicy", "The Job met a rule of its success policy"
            )
            return
        self._create_pods(namespace, job, completed)
        self._schedule(namespace, job)
        live = [
            p
            for p in self.pods_of(job["metadata"]["name"], namespace)
            if p["status"].get("phase") not in TERMINAL
        ]
        status["active"] = sum(1 for p in live if "deletionTimestamp" not in p["metadata"])
        status["terminating"] = sum(1 for p in live if "deletionTimestamp" in p["metadata"])

    def _release(self, pod: dict[str, Any]) -> None:
        """Accounted for: the finalizer goes, and a pod being deleted with it."""
        meta = pod["metadata"]
        meta["finalizers"] = [f for f in meta.get("finalizers") or [] if f != TRACKING]
        meta["resourceVersion"] = self.kube._next_version()
        if "deletionTimestamp" in meta and not meta["finalizers"]:
            del self.kube.pods[(meta["namespace"], meta["name"])]

    def _finish(self, namespace: str, job: dict[str, Any], kind: str, reason: str, message: str) -> None:
        # The controller first sets the interim condition (FailureTarget / SuccessCriteriaMet), then, once
        # the pods are gone, the final one; the fake removes the pods at once and sets both.
        interim = "FailureTarget" if kind == "Failed" else "SuccessCriteriaMet"
        for each in (interim, kind):
            job["status"].setdefault("conditions", []).append(
                {
                    "type": each,
                    "status": "True",
                    "reason": reason,
                    "message": message,
                    "lastTransitionTime": now_rfc3339(),
                }
            )
        for pod in self.pods_of(job["metadata"]["name"], namespace):
            if pod["status"].get("phase") not in TERMINAL:
                self._release(pod)
                self.kube.delete_pod(namespace, pod["metadata"]["name"])
        job["status"]["active"] = 0
        job["metadata"]["resourceVersion"] = self.kube._next_version()

    def _create_pods(self, namespace: str, job: dict[str, Any], completed: set[int]) -> None:
        spec = job["spec"]
        live = [
            p
            for p in self.pods_of(job["metadata"]["name"], namespace)
            if p["status"].get("phase") not in TERMINAL
        ]
        # podReplacementPolicy Failed (the only value with a podFailurePolicy): a terminating pod keeps its
        # index until it has failed; TerminatingOrFailed (the default otherwise): it does not.
        waits = spec.get("podReplacementPolicy", "TerminatingOrFailed") == "Failed"
        holding = [p for p in live if waits or "deletionTimestamp" not in p["metadata"]]
        busy = {int(p["metadata"]["annotations"][COMPLETION_INDEX]) for p in holding}
        room = spec["parallelism"] - len(holding)
        wanted = [i for i in range(spec["completions"]) if i not in completed and i not in busy]
        for index in wanted[: max(room, 0)]:
            self._new_pod(namespace, job, index)

    def _new_pod(self, namespace: str, job: dict[str, Any], index: int) -> None:
        name, uid = job["metadata"]["name"], job["metadata"]["uid"]
        template = copy.deepcopy(job["spec"]["template"])
        meta = template.get("metadata") or {}
        pod_spec = template["spec"]
        labels = {
            **(meta.get("labels") or {}),
            JOB_NAME: name,
            CONTROLLER_UID: uid,
            "job-name": name,
            "controller-uid": uid,
        }
        annotations = dict(meta.get("annotations") or {})
        labels[COMPLETION_INDEX] = annotations[COMPLETION_INDEX] = str(index)
        pod_spec.setdefault("hostname", f"{name}-{index}")
        for container in pod_spec["containers"]:
            container.setdefault("env", []).append({"name": "JOB_COMPLETION_INDEX", "value": str(index)})
        pod_name = f"{name}-{index}-{secrets.token_hex(3)[:5]}"
        self.kube.pods[(namespace, pod_name)] = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": pod_name,
                "namespace": namespace,
                "uid": str(uuid.uuid4()),
                "resourceVersion": self.kube._next_version(),
                "creationTimestamp": now_rfc3339(),
                "labels": labels,
                "annotations": annotations,
                "finalizers": [TRACKING],
                "ownerReferences": [
                    {
                        "apiVersion": "batch/v1",
                        "kind": "Job",
                        "name": name,
                        "uid": uid,
                        "controller": True,
                        "blockOwnerDeletion": True,
                    }
                ],
            },
            "spec": pod_spec,
            "status": {"phase": "Pending"},
        }

    def _schedule(self, namespace: str, job: dict[str, Any]) -> None:
        """Stands in for the scheduler and the kubelet, for this Job's pods: bind each pending pod to a node
        it may be scheduled on with no other running pod of the Job, and run it."""
        pods = self.pods_of(job["metadata"]["name"], namespace)
        taken = {p["spec"].get("nodeName") for p in pods if p["status"].get("phase") not in TERMINAL}
        for pod in pods:
            if pod["spec"].get("nodeName") or "deletionTimestamp" in pod["metadata"]:
                continue
            tolerations = pod["spec"].get("tolerations") or []
            for name, node in self.kube.nodes.items():
                blocking = [
                    t
                    for t in node["spec"].get("taints") or []
                    if t.get("effect") in ("NoSchedule", "NoExecute") and not _tolerated(t, tolerations)
                ]
                if name in taken or node["spec"].get("unschedulable") or blocking:
                    continue
                taken.add(name)
                pod["spec"]["nodeName"] = name
                running = [
                    _container_status(c, {"running": {"startedAt": now_rfc3339()}})
                    for c in pod["spec"]["containers"]
                ]
                pod["status"] = {"phase": "Running", "startTime": now_rfc3339(), "containerStatuses": running}
                pod["metadata"]["resourceVersion"] = self.kube._next_version()
                break

    # --- the API -----------------------------------------------------------------------------------------

    async def _create_job(self, request: web.Request, namespace: str) -> web.Response:
        body = await request.json()
        if (body.get("apiVersion"), body.get("kind")) != ("batch/v1", "Job"):
            return status_error(400, "BadRequest", "expected a batch/v1 Job")
        name = (body.get("metadata") or {}).get("name")
        if not name:
            return status_error(422, "Invalid", "metadata.name: Required value")
        if (namespace, name) in self.jobs:
            return status_error(
                409, "AlreadyExists", f'jobs.batch "{name}" already exists', kind="jobs", name=name
            )
        job = copy.deepcopy(body)
        spec = job.setdefault("spec", {})
        validate_job(job)
        uid = str(uuid.uuid4())
        # The API server's defaults.
        spec.setdefault("parallelism", 1)
        spec.setdefault("backoffLimit", 6)
        spec.setdefault("suspend", False)
        if "podFailurePolicy" in spec:
            spec.setdefault("podReplacementPolicy", "Failed")
            for rule in spec["podFailurePolicy"]["rules"]:
                for pattern in rule.get("onPodConditions") or []:
                    pattern.setdefault("status", "True")
        spec["selector"] = {"matchLabels": {CONTROLLER_UID: uid}}
        labels = spec["template"].setdefault("metadata", {}).setdefault("labels", {})
        labels.update({JOB_NAME: name, CONTROLLER_UID: uid, "job-name": name, "controller-uid": uid})
        job["metadata"] = {
            **job.get("metadata", {}),
            "name": name,
            "namespace": namespace,
            "uid": uid,
            "resourceVersion": self.kube._next_version(),
            "creationTimestamp": now_rfc3339(),
            "generation": 1,
        }
        job["status"] = {"startTime": now_rfc3339(), "active": 0}
        self.jobs[(namespace, name)] = job
        self._sync_job(namespace, job)
        return json_response(job, status=201)

    async def _list_jobs(self, request: web.Request, namespace: str) -> web.Response:
        items = [job for (job_ns, _), job in self.jobs.items() if job_ns == namespace]
        return json_response({"kind": "JobList", "apiVersion": "batch/v1", "metadata": {}, "items": items})

    async def _get_job(self, request: web.Request, namespace: str, name: str) -> web.Response:
        job = self.jobs.get((namespace, name))
        if job is None:
            return status_error(404, "NotFound", f'jobs.batch "{name}" not found', kind="jobs", name=name)
        return json_response(job)

    async def _create_service(self, request: web.Request, namespace: str) -> web.Response:
        body = await request.json()
        name = (body.get("metadata") or {}).get("name")
        if (body.get("apiVersion"), body.get("kind")) != ("v1", "Service") or not name:
            return status_error(400, "BadRequest", "expected a v1 Service with a name")
        if (namespace, name) in self.services:
            return status_error(
                409, "AlreadyExists", f'services "{name}" already exists', kind="services", name=name
            )
        service = copy.deepcopy(body)
        service["metadata"].update(
            namespace=namespace, uid=str(uuid.uuid4()), resourceVersion=self.kube._next_version()
        )
        self.services[(namespace, name)] = service
        return json_response(service, status=201)

    async def _get_service(self, request: web.Request, namespace: str, name: str) -> web.Response:
        service = self.services.get((namespace, name))
        if service is None:
            return status_error(404, "NotFound", f'services "{name}" not found', kind="services", name=name)
        return json_response(service)


def _container_status(container: Mapping[str, Any], state: dict[str, Any]) -> dict[str, Any]:
    """A ``ContainerStatus`` as the kubelet reports it (``image`` and ``imageID`` are required fields)."""
    return {
        "name": container["name"],
        "image": container.get("image", ""),
        "imageID": f"{container.get('image', '')}@sha256:{'0' * 64}",
        "ready": "running" in state,
        "started": "running" in state,
        "restartCount": 0,
        "state": state,
    }


def _expand(text: str) -> list[int]:
    """The indexes of a ``completedIndexes`` string."""
    out: list[int] = []
    for part in filter(None, text.split(",")):
        first, _, last = part.partition("-")
        out.extend(range(int(first), int(last or first) + 1))
    return out
