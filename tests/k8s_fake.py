"""An in-process fake of the few Kubernetes API endpoints that node termination handling uses (nodes,
nodes/status, pods, pods/eviction, events, the discovery documents kubectl reads), speaking the real wire
formats over plain HTTP on 127.0.0.1, recording every request.

It keeps the API server's semantics where they matter to a client: strategic-merge patches merge
``status.conditions`` by ``type`` and replace ``spec.taints`` whole (the list is atomic in the Node schema);
JSON merge patches (RFC 7386) replace lists; a ``metadata.resourceVersion`` in a patch is a precondition
(409 Conflict when stale); a status patch changes only the status and a node patch never does; an eviction
answers 429 while a PodDisruptionBudget blocks it and deletes the pod when it does not. Errors (403, 429
with ``Retry-After``, 409, 500) can be injected for the next matching requests. Usable from tests and from
the command line (``python -m tests.k8s_fake --kubeconfig FILE``) for trying kubectl by hand.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import datetime as dt
import ipaddress
import json
import re
import ssl
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

STRATEGIC = "application/strategic-merge-patch+json"
MERGE = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"
NODE = "gpu-node-1"  # the node the tests' fake cluster has (the conftest's ``kube``)

# Strategic-merge metadata of the Node and Pod fields a node handler touches, as in the Kubernetes API's
# Go struct tags: lists with a merge key merge element-wise by it; every other list is replaced whole.
MERGE_KEYS: dict[tuple[str, ...], str] = {
    ("status", "conditions"): "type",
    ("status", "addresses"): "type",
    ("metadata", "ownerReferences"): "uid",
}
TAINT_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")
CAPACITY = {
    "cpu": "96",
    "memory": "1056Gi",
    "nvidia.com/gpu": "8",
    "pods": "110",
    "ephemeral-storage": "900Gi",
}


def now_rfc3339() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class PatchError(Exception):
    """A patch the API server would refuse: (HTTP status, reason, message)."""

    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason


def json_merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386: objects merge recursively, ``null`` removes a key, anything else (lists too) replaces."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = json_merge_patch(result.get(key), value)
    return result


def strategic_merge_patch(target: Any, patch: Any, path: tuple[str, ...] = ()) -> Any:
    """Kubernetes' strategic merge patch for the fields in MERGE_KEYS, with the ``$patch`` (``replace``,
    ``delete``) and ``$setElementOrder/<list>`` directives; ``$retainKeys`` and primitive-list directives
    are refused, as nothing here sends them."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    directive = patch.get("$patch")
    if directive == "replace":
        return {k: copy.deepcopy(v) for k, v in patch.items() if k != "$patch"}
    if directive == "delete":
        return None
    if directive not in (None, "merge"):
        raise PatchError(422, "Invalid", f"unknown patch directive {directive!r}")
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if key == "$patch" or key.startswith("$setElementOrder/"):
            continue
        if key.startswith("$"):
            raise PatchError(422, "Invalid", f"unsupported strategic merge directive {key!r}")
        sub = (*path, key)
        if value is None:
            result.pop(key, None)
        elif isinstance(value, list) and sub in MERGE_KEYS:
            result[key] = _merge_list(result.get(key) or [], value, MERGE_KEYS[sub], sub)
        elif isinstance(value, dict):
            merged = strategic_merge_patch(result.get(key), value, sub)
            if merged is None:
                result.pop(key, None)
            else:
                result[key] = merged
        else:
            result[key] = copy.deepcopy(value)
    return result


def _merge_list(current: list[Any], patch: list[Any], key: str, path: tuple[str, ...]) -> list[Any]:
    if any(isinstance(item, dict) and item.get("$patch") == "replace" for item in patch):
        return [copy.deepcopy(i) for i in patch if not (isinstance(i, dict) and "$patch" in i)]
    merged = [copy.deepcopy(item) for item in current]
    for item in patch:
        if not isinstance(item, dict) or key not in item:
            raise PatchError(422, "Invalid", f"{'.'.join(path)}: every element needs its merge key {key!r}")
        index = next((i for i, old in enumerate(merged) if old.get(key) == item[key]), None)
        if item.get("$patch") == "delete":
            if index is not None:
                del merged[index]
        elif index is None:
            merged.append({k: copy.deepcopy(v) for k, v in item.items() if k != "$patch"})
        else:
            merged[index] = strategic_merge_patch(merged[index], item, path)
    return merged


# What the discovery documents list: (resource, kind, namespaced, verbs) per group version.
GROUPS: dict[str, list[tuple[str, str, bool, list[str]]]] = {
    "v1": [
        ("nodes", "Node", False, ["get", "list", "patch", "update"]),
        ("nodes/status", "Node", False, ["get", "patch", "update"]),
        ("pods", "Pod", True, ["get", "list", "delete"]),
        ("pods/eviction", "Eviction", True, ["create"]),
        ("events", "Event", True, ["create", "get", "list"]),
    ],
    "apps/v1": [("daemonsets", "DaemonSet", True, ["get", "list"])],
    "policy/v1": [("poddisruptionbudgets", "PodDisruptionBudget", True, ["get", "list"])],
}


@dataclass
class Recorded:
    """One request as the fake saw it, with the status it answered."""

    method: str
    path: str
    query: dict[str, str]
    content_type: str
    body: Any
    user_agent: str
    authorization: str = ""
    at: float = 0.0  # time.monotonic() on arrival
    time: datetime | None = None  # the wall clock on arrival, to compare with the agent's event times
    status: int = 0

    def summary(self) -> tuple[str, str, str]:
        return (self.method, self.path, self.content_type)


@dataclass
class Fault:
    method: str
    path: re.Pattern[str]
    status: int
    times: int
    retry_after: float | None
    message: str


@dataclass
class FakeKube:
    """The fake API server: ``async with FakeKube() as kube:`` then ``kube.url``, ``kube.write_kubeconfig``,
    ``kube.add_node``, ``kube.add_pod``, ``kube.block_eviction``, ``kube.fail``, ``kube.requests``."""

    host: str = "127.0.0.1"
    nodes: dict[str, dict[str, Any]] = field(default_factory=dict)
    pods: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    daemonsets: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    events: list[dict[str, Any]] = field(default_factory=list)
    requests: list[Recorded] = field(default_factory=list)
    blocked: dict[tuple[str, str], str] = field(default_factory=dict)
    evicted: list[tuple[str, str]] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)
    port: int = 0
    # Bearer tokens the server accepts (401 for any other); None accepts any request.
    tokens: set[str] | None = None
    # (certificate, key) files: serve HTTPS, as an in-cluster API server does.
    tls: tuple[Path, Path] | None = None
    # Add-ons (tests/k8s_fake_jobs.py): more resources for discovery (as in GROUPS), more routes (tried after
    # the built-in ones, as in _routes) and callbacks run after every request answered (a controller's sync).
    extra_groups: dict[str, list[tuple[str, str, bool, list[str]]]] = field(default_factory=dict)
    extra_routes: list[tuple[str, str, Any]] = field(default_factory=list)
    after_request: list[Callable[[], None]] = field(default_factory=list)
    _version: int = 1000
    _runner: web.AppRunner | None = None
    _changed: asyncio.Condition | None = None

    # --- lifecycle ----------------------------------------------------------------------------------

    async def __aenter__(self) -> FakeKube:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def start(self, port: int = 0) -> None:
        self._changed = asyncio.Condition()
        app = web.Application(middlewares=[self._record])
        app.router.add_route("*", "/{tail:.*}", self._dispatch)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        context = None
        if self.tls is not None:
            context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            context.load_cert_chain(*self.tls)
        site = web.TCPSite(self._runner, self.host, port, ssl_context=context)
        await site.start()
        server = site._server
        assert server is not None
        self.port = server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.host}:{self.port}"

    def write_kubeconfig(self, path: Path, *, user: str = "tester") -> Path:
        """A kubeconfig for this server (plain HTTP, a static token) that kubectl and clients read."""
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": user, "user": {"token": f"token-of-{user}"}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": user}}],
            "current-context": "fake",
        }
        path.write_text(json.dumps(config, indent=2))
        return path

    # --- objects --------------------------------------------------------------------------------------

    def _next_version(self) -> str:
        self._version += 1
        return str(self._version)

    def add_node(
        self,
        name: str,
        *,
        taints: list[dict[str, Any]] | None = None,
        unschedulable: bool = False,
        labels: Mapping[str, str] | None = None,
    ) -> dict[str, Any]:
        spec: dict[str, Any] = {"podCIDR": "10.244.1.0/24", "providerID": f"fake:///{name}"}
        if taints:
            spec["taints"] = copy.deepcopy(taints)
        if unschedulable:
            spec["unschedulable"] = True
        node = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": name,
                "uid": str(uuid.uuid4()),
                "resourceVersion": self._next_version(),
                "creationTimestamp": now_rfc3339(),
                "labels": {"kubernetes.io/hostname": name, **(labels or {})},
                "annotations": {"node.alpha.kubernetes.io/ttl": "0"},
            },
            "spec": spec,
            "status": {
                "conditions": [
                    {
                        "type": "Ready",
                        "status": "True",
                        "reason": "KubeletReady",
                        "message": "kubelet is posting ready status",
                        "lastHeartbeatTime": now_rfc3339(),
                        "lastTransitionTime": now_rfc3339(),
                    }
                ],
                "addresses": [{"type": "Hostname", "address": name}],
                "capacity": dict(CAPACITY),
                "allocatable": dict(CAPACITY),
                "nodeInfo": {
                    "machineID": uuid.uuid4().hex,
                    "systemUUID": str(uuid.uuid4()),
                    "bootID": str(uuid.uuid4()),
                    "kernelVersion": "6.8.0-fake",
                    "osImage": "Ubuntu 24.04 LTS",
                    "containerRuntimeVersion": "containerd://2.1.0",
                    "kubeletVersion": "v1.37.0",
                    "kubeProxyVersion": "",
                    "operatingSystem": "linux",
                    "architecture": "amd64",
                },
            },
        }
        self.nodes[name] = node
        return node

    def add_pod(
        self,
        namespace: str,
        name: str,
        *,
        node: str,
        owner: str | None = "ReplicaSet",
        grace_s: int = 30,
        mirror: bool = False,
        host_network: bool = False,
        phase: str = "Running",
        labels: Mapping[str, str] | None = None,
    ) -> dict[str, Any]:
        """A pod bound to ``node``; ``owner`` is its controller's kind (``DaemonSet`` pods are skipped by
        drains, as are ``mirror`` pods), None for an unmanaged pod."""
        metadata: dict[str, Any] = {
            "name": name,
            "namespace": namespace,
            "uid": str(uuid.uuid4()),
            "resourceVersion": self._next_version(),
            "creationTimestamp": now_rfc3339(),
            "labels": dict(labels or {}),
        }
        if owner is not None:
            owner_name = f"{name.rsplit('-', 1)[0]}"
            metadata["ownerReferences"] = [
                {
                    "apiVersion": "apps/v1",
                    "kind": owner,
                    "name": owner_name,
                    "uid": str(uuid.uuid4()),
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ]
            if owner == "DaemonSet":
                self.daemonsets[(namespace, owner_name)] = {
                    "apiVersion": "apps/v1",
                    "kind": "DaemonSet",
                    "metadata": {"name": owner_name, "namespace": namespace, "uid": str(uuid.uuid4())},
                    "spec": {},
                    "status": {},
                }
        if mirror:
            metadata["annotations"] = {"kubernetes.io/config.mirror": uuid.uuid4().hex}
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": metadata,
            "spec": {
                "nodeName": node,
                "hostNetwork": host_network,
                "terminationGracePeriodSeconds": grace_s,
                "containers": [{"name": "main", "image": "example/train:1"}],
            },
            "status": {"phase": phase},
        }
        self.pods[(namespace, name)] = pod
        return pod

    def delete_pod(self, namespace: str, name: str, *, disruption: tuple[str, str] | None = None) -> None:
        """Delete a pod as the API server does: a pod that is not finished first gets the ``DisruptionTarget``
        condition (``disruption``: its reason and message) when the deletion is a disruption (an eviction);
        a pod with finalizers stays, with a ``deletionTimestamp``, until they are removed (the kubelet's
        termination is the test's to play); any other pod goes at once (the fake does not wait for a kubelet).
        The condition: https://kubernetes.io/docs/concepts/workloads/pods/disruptions/#pod-disruption-conditions
        (reason ``EvictionByEvictionAPI`` for the Eviction API)."""
        pod = self.pods[(namespace, name)]
        status = pod.setdefault("status", {})
        if disruption is not None and status.get("phase") not in ("Succeeded", "Failed"):
            conditions = [c for c in status.get("conditions") or [] if c.get("type") != "DisruptionTarget"]
            reason, message = disruption
            conditions.append(
                {
                    "type": "DisruptionTarget",
                    "status": "True",
                    "reason": reason,
                    "message": message,
                    "lastTransitionTime": now_rfc3339(),
                }
            )
            status["conditions"] = conditions
        if pod["metadata"].get("finalizers"):
            pod["metadata"].setdefault("deletionTimestamp", now_rfc3339())
            pod["metadata"]["resourceVersion"] = self._next_version()
        else:
            del self.pods[(namespace, name)]

    def block_eviction(self, namespace: str, name: str, budget: str = "train-pdb") -> None:
        """A PodDisruptionBudget (``budget``) forbids evicting this pod until :meth:`unblock_eviction`."""
        self.blocked[(namespace, name)] = budget

    def unblock_eviction(self, namespace: str, name: str) -> None:
        self.blocked.pop((namespace, name), None)

    def fail(
        self,
        method: str,
        path: str,
        status: int,
        *,
        times: int = 1,
        retry_after: float | None = None,
        message: str = "",
    ) -> None:
        """Answer the next ``times`` requests whose method is ``method`` and whose path matches the regular
        expression ``path`` (full match) with ``status`` instead of serving them."""
        self.faults.append(Fault(method.upper(), re.compile(path), status, times, retry_after, message))

    def node_events(self, node: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("involvedObject", {}).get("name") == node]

    def calls(self, method: str | None = None, pattern: str | None = None) -> list[Recorded]:
        """The recorded requests, optionally those with ``method`` whose path fully matches ``pattern``."""
        return [
            r
            for r in self.requests
            if (method is None or r.method == method) and (pattern is None or re.fullmatch(pattern, r.path))
        ]

    async def wait_for(self, predicate: Callable[[], bool], timeout: float = 20.0) -> None:
        """Wait until ``predicate()`` holds; it is checked after every request the fake answers."""
        assert self._changed is not None
        changed = self._changed

        async def wait() -> None:
            async with changed:
                await changed.wait_for(predicate)

        await asyncio.wait_for(wait(), timeout)

    # --- HTTP -----------------------------------------------------------------------------------------

    @web.middleware
    async def _record(self, request: web.Request, handler: Any) -> web.StreamResponse:
        raw = await request.read()
        try:
            body: Any = json.loads(raw) if raw else None
        except ValueError:
            body = raw.decode(errors="replace")
        entry = Recorded(
            method=request.method,
            path=request.path,
            query=dict(request.query),
            content_type=request.content_type if raw else "",
            body=body,
            user_agent=request.headers.get("User-Agent", ""),
            authorization=request.headers.get("Authorization", ""),
            at=time.monotonic(),
            time=datetime.now(timezone.utc),
        )
        self.requests.append(entry)
        response: web.StreamResponse
        fault = next(
            (
                f
                for f in self.faults
                if f.times > 0 and f.method == request.method and f.path.fullmatch(request.path)
            ),
            None,
        )
        token = request.headers.get("Authorization", "").removeprefix("Bearer ")
        if self.tokens is not None and token not in self.tokens:
            response = status_error(401, "Unauthorized", "Unauthorized")
        elif fault is not None:
            fault.times -= 1
            response = self._fault_response(fault, request)
        else:
            try:
                response = await handler(request)
            except web.HTTPException:
                raise
            except PatchError as exc:
                response = status_error(exc.code, exc.reason, str(exc))
        for callback in self.after_request:
            callback()
        entry.status = response.status
        assert self._changed is not None
        async with self._changed:
            self._changed.notify_all()
        return response

    def _fault_response(self, fault: Fault, request: web.Request) -> web.Response:
        reasons = {403: "Forbidden", 409: "Conflict", 429: "TooManyRequests", 500: "InternalError"}
        message = fault.message or f"injected {fault.status} for {request.method} {request.path}"
        response = status_error(fault.status, reasons.get(fault.status, "Unknown"), message)
        if fault.retry_after is not None:
            response.headers["Retry-After"] = f"{fault.retry_after:g}"
        return response

    async def _dispatch(self, request: web.Request) -> web.StreamResponse:
        path, method = request.path.rstrip("/") or "/", request.method
        for route_method, pattern, handler in self._routes():
            match = re.fullmatch(pattern, path)
            if match and route_method == method:
                result: web.StreamResponse = await handler(request, **match.groupdict())
                return result
        return status_error(
            404, "NotFound", f"the server could not find the requested resource ({method} {path})"
        )

    def _routes(self) -> list[tuple[str, str, Any]]:
        ns = r"/api/v1/namespaces/(?P<namespace>[^/]+)"
        return [
            ("GET", r"/version", self._version_info),
            ("GET", r"/api", self._api_versions),
            ("GET", r"/apis", self._api_groups),
            ("GET", r"/api/v1", self._core_resources),
            ("GET", r"/apis/(?P<group>[^/]+)/(?P<version>[^/]+)", self._group_resources),
            ("GET", r"/api/v1/nodes", self._list_nodes),
            ("GET", r"/api/v1/nodes/(?P<name>[^/]+)", self._get_node),
            ("PATCH", r"/api/v1/nodes/(?P<name>[^/]+)", self._patch_node),
            ("PATCH", r"/api/v1/nodes/(?P<name>[^/]+)/status", self._patch_node_status),
            ("GET", r"/api/v1/pods", self._list_pods),
            ("GET", ns + r"/pods", self._list_pods),
            ("GET", ns + r"/pods/(?P<name>[^/]+)", self._get_pod),
            ("POST", ns + r"/pods/(?P<name>[^/]+)/eviction", self._evict),
            (
                "GET",
                r"/apis/apps/v1/namespaces/(?P<namespace>[^/]+)/daemonsets/(?P<name>[^/]+)",
                self._get_ds,
            ),
            ("POST", ns + r"/events", self._create_event),
            ("GET", r"/api/v1/events", self._list_events),
            ("GET", ns + r"/events", self._list_events),
            *self.extra_routes,
        ]

    def groups(self) -> dict[str, list[tuple[str, str, bool, list[str]]]]:
        """GROUPS with the add-ons' resources."""
        merged = {gv: list(resources) for gv, resources in GROUPS.items()}
        for gv, resources in self.extra_groups.items():
            merged.setdefault(gv, []).extend(resources)
        return merged

    # --- discovery --------------------------------------------------------------------------------------

    async def _version_info(self, request: web.Request) -> web.Response:
        return json_response(
            {"major": "1", "minor": "37", "gitVersion": "v1.37.0-fake", "platform": "linux/amd64"}
        )

    async def _api_versions(self, request: web.Request) -> web.Response:
        # Legacy discovery only (plain application/json): kubectl falls back to it from aggregated discovery.
        return json_response(
            {
                "kind": "APIVersions",
                "versions": ["v1"],
                "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": self.url}],
            }
        )

    async def _api_groups(self, request: web.Request) -> web.Response:
        groups = []
        for group_version in self.groups():
            if "/" not in group_version:
                continue
            group, version = group_version.split("/")
            gv = {"groupVersion": group_version, "version": version}
            groups.append({"name": group, "versions": [gv], "preferredVersion": gv})
        return json_response({"kind": "APIGroupList", "apiVersion": "v1", "groups": groups})

    def _resource_list(self, group_version: str) -> web.Response:
        resources = [
            {
                "name": name,
                "singularName": "" if "/" in name else name.rstrip("s"),
                "namespaced": namespaced,
                "kind": kind,
                "verbs": verbs,
                **({"group": "policy", "version": "v1"} if name == "pods/eviction" else {}),
            }
            for name, kind, namespaced, verbs in self.groups()[group_version]
        ]
        return json_response(
            {
                "kind": "APIResourceList",
                "apiVersion": "v1",
                "groupVersion": group_version,
                "resources": resources,
            }
        )

    async def _core_resources(self, request: web.Request) -> web.Response:
        return self._resource_list("v1")

    async def _group_resources(self, request: web.Request, group: str, version: str) -> web.Response:
        if f"{group}/{version}" not in self.groups():
            return status_error(404, "NotFound", f"the server could not find the group {group}/{version}")
        return self._resource_list(f"{group}/{version}")

    # --- nodes ----------------------------------------------------------------------------------------

    async def _list_nodes(self, request: web.Request) -> web.Response:
        return json_response(
            {
                "kind": "NodeList",
                "apiVersion": "v1",
                "metadata": {"resourceVersion": str(self._version)},
                "items": list(self.nodes.values()),
            }
        )

    async def _get_node(self, request: web.Request, name: str) -> web.Response:
        node = self.nodes.get(name)
        if node is None:
            return status_error(404, "NotFound", f'nodes "{name}" not found', kind="nodes", name=name)
        return json_response(node)

    async def _patch_node(self, request: web.Request, name: str) -> web.Response:
        return await self._patch(request, name, status=False)

    async def _patch_node_status(self, request: web.Request, name: str) -> web.Response:
        return await self._patch(request, name, status=True)

    async def _patch(self, request: web.Request, name: str, *, status: bool) -> web.Response:
        node = self.nodes.get(name)
        if node is None:
            return status_error(404, "NotFound", f'nodes "{name}" not found', kind="nodes", name=name)
        patch = await request.json()
        kind = request.content_type
        if kind == STRATEGIC:
            patched = strategic_merge_patch(node, patch)
        elif kind == MERGE:
            patched = json_merge_patch(node, patch)
        else:
            return status_error(
                415, "UnsupportedMediaType", f"the fake does not serve patches of type {kind}"
            )
        wanted = (patch.get("metadata") or {}).get("resourceVersion") if isinstance(patch, dict) else None
        if wanted is not None and wanted != node["metadata"]["resourceVersion"]:
            return status_error(
                409,
                "Conflict",
                f'Operation cannot be fulfilled on nodes "{name}": the object has been modified; '
                "please apply your changes to the latest version and try again",
                kind="nodes",
                name=name,
            )
        # The status subresource changes only the status; the main resource never does.
        if status:
            patched = {**node, "status": patched.get("status", {})}
        else:
            patched["status"] = node["status"]
        for key in ("name", "uid", "creationTimestamp", "resourceVersion"):
            patched["metadata"][key] = node["metadata"][key]
        validate_node(patched)
        if patched != node:
            patched["metadata"]["resourceVersion"] = self._next_version()
            self.nodes[name] = patched
        return json_response(self.nodes[name])

    # --- pods -----------------------------------------------------------------------------------------

    async def _list_pods(self, request: web.Request, namespace: str | None = None) -> web.Response:
        selectors = parse_field_selector(request.query.get("fieldSelector", ""))
        items = []
        for (pod_ns, _), pod in self.pods.items():
            if namespace is not None and pod_ns != namespace:
                continue
            if all(match_field(pod, key, op, value) for key, op, value in selectors):
                items.append(pod)
        return json_response(
            {
                "kind": "PodList",
                "apiVersion": "v1",
                "metadata": {"resourceVersion": str(self._version)},
                "items": items,
            }
        )

    async def _get_pod(self, request: web.Request, namespace: str, name: str) -> web.Response:
        pod = self.pods.get((namespace, name))
        if pod is None:
            return status_error(404, "NotFound", f'pods "{name}" not found', kind="pods", name=name)
        return json_response(pod)

    async def _evict(self, request: web.Request, namespace: str, name: str) -> web.Response:
        body = await request.json()
        if (body.get("apiVersion"), body.get("kind")) != ("policy/v1", "Eviction"):
            return status_error(
                400,
                "BadRequest",
                f"expected a policy/v1 Eviction, got {body.get('apiVersion')}/{body.get('kind')}",
            )
        if body.get("metadata", {}).get("name") != name:
            return status_error(400, "BadRequest", "name in URL does not match name in Eviction object")
        if (namespace, name) not in self.pods:
            return status_error(404, "NotFound", f'pods "{name}" not found', kind="pods", name=name)
        budget = self.blocked.get((namespace, name))
        if budget is not None:
            response = status_error(
                429,
                "TooManyRequests",
                "Cannot evict pod as it would violate the pod's disruption budget.",
                causes=[
                    {
                        "reason": "DisruptionBudget",
                        "message": f"The disruption budget {budget} needs 1 healthy pods and has 1 currently",
                    }
                ],
            )
            return response
        self.evicted.append((namespace, name))
        self.delete_pod(namespace, name, disruption=("EvictionByEvictionAPI", "Eviction API: evicting"))
        return json_response(
            {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201},
            status=201,
        )

    async def _get_ds(self, request: web.Request, namespace: str, name: str) -> web.Response:
        ds = self.daemonsets.get((namespace, name))
        if ds is None:
            return status_error(404, "NotFound", f'daemonsets.apps "{name}" not found', kind="daemonsets")
        return json_response(ds)

    # --- events ---------------------------------------------------------------------------------------

    async def _create_event(self, request: web.Request, namespace: str) -> web.Response:
        event = await request.json()
        if (event.get("apiVersion"), event.get("kind")) != ("v1", "Event"):
            return status_error(400, "BadRequest", "expected a core v1 Event")
        if not event.get("involvedObject", {}).get("name") or not event.get("reason"):
            return status_error(422, "Invalid", "Event: involvedObject.name and reason are required")
        event.setdefault("metadata", {})
        event["metadata"].setdefault("name", f"{event['involvedObject']['name']}.{uuid.uuid4().hex[:16]}")
        event["metadata"].update(
            namespace=namespace, uid=str(uuid.uuid4()), resourceVersion=self._next_version()
        )
        self.events.append(event)
        return json_response(event, status=201)

    async def _list_events(self, request: web.Request, namespace: str | None = None) -> web.Response:
        selectors = parse_field_selector(request.query.get("fieldSelector", ""))
        items = [
            e
            for e in self.events
            if (namespace is None or e["metadata"]["namespace"] == namespace)
            and all(match_field(e, key, op, value) for key, op, value in selectors)
        ]
        return json_response({"kind": "EventList", "apiVersion": "v1", "metadata": {}, "items": items})


def validate_node(node: Mapping[str, Any]) -> None:
    """What the API server's Node validation says about taints (kubectl relies on it)."""
    seen: set[tuple[str, str]] = set()
    for taint in node.get("spec", {}).get("taints") or []:
        if not taint.get("key"):
            raise PatchError(422, "Invalid", "spec.taints.key: Required value")
        if taint.get("effect") not in TAINT_EFFECTS:
            raise PatchError(
                422, "Invalid", f"spec.taints.effect: Unsupported value: {taint.get('effect')!r}"
            )
        pair = (taint["key"], taint["effect"])
        if pair in seen:
            raise PatchError(
                422, "Invalid", f"spec.taints: Duplicate value: {taint['key']}:{taint['effect']}"
            )
        seen.add(pair)


def parse_field_selector(text: str) -> list[tuple[str, str, str]]:
    selectors = []
    for part in filter(None, text.split(",")):
        match = re.fullmatch(r"([^=!]+)(==|=|!=)(.*)", part)
        if match is None:
            raise PatchError(400, "BadRequest", f"invalid field selector {part!r}")
        key, op, value = match.groups()
        selectors.append((key, "!=" if op == "!=" else "=", value))
    return selectors


def match_field(obj: Mapping[str, Any], key: str, op: str, value: str) -> bool:
    current: Any = obj
    for part in key.split("."):
        current = current.get(part, "") if isinstance(current, Mapping) else ""
    actual = "" if current is None else str(current)
    return (actual == value) if op == "=" else (actual != value)


def json_response(body: Any, status: int = 200) -> web.Response:
    """JSON as the API server sends it: ``Content-Type: application/json`` with no charset parameter
    (client libraries match that header exactly)."""
    return web.Response(
        body=json.dumps(body).encode(), status=status, headers={"Content-Type": "application/json"}
    )


def status_error(
    code: int,
    reason: str,
    message: str,
    *,
    kind: str | None = None,
    name: str | None = None,
    causes: list[dict[str, str]] | None = None,
) -> web.Response:
    """A ``metav1.Status`` failure, as the API server writes it."""
    details: dict[str, Any] = {}
    if kind:
        details["kind"] = kind
    if name:
        details["name"] = name
    if causes:
        details["causes"] = causes
    body: dict[str, Any] = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }
    if details:
        body["details"] = details
    return json_response(body, status=code)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--kubeconfig", type=Path, required=True)
    parser.add_argument("--node", default="gpu-node-1")
    args = parser.parse_args()

    async def serve() -> None:
        kube = FakeKube()
        kube.add_node(args.node)
        kube.add_pod("default", "train-0", node=args.node, owner="Job")
        await kube.start(args.port)
        kube.write_kubeconfig(args.kubeconfig)
        print(f"serving {kube.url}; kubeconfig {args.kubeconfig}", flush=True)
        try:
            await asyncio.Event().wait()
        finally:
            await kube.stop()

    asyncio.run(serve())


if __name__ == "__main__":
    main()


@contextlib.contextmanager
def pod_cgroup(pod_uid: str) -> Iterator[Callable[[int], None]]:
    """A cgroup named as the kubelet's systemd driver names a pod's, for a process that the agent must find
    in that pod (as it does on a node, through /proc/<pid>/cgroup); yields ``join(pid)``, which moves a
    process into it. Skips where no cgroup can be made or joined here (not root, no writable hierarchy)."""
    name = f"kubepods-besteffort-pod{pod_uid.replace('-', '_')}.slice"
    for root in (Path("/sys/fs/cgroup/pids"), Path("/sys/fs/cgroup/unified"), Path("/sys/fs/cgroup")):
        if not (root / "cgroup.procs").exists():
            continue
        try:
            (root / name).mkdir()
        except OSError:
            continue

        def join(pid: int, procs: Path = root / name / "cgroup.procs") -> None:
            try:
                procs.write_text(str(pid))
            except OSError as exc:
                pytest.skip(f"cannot move a process into a cgroup here: {exc}")

        try:
            yield join
        finally:
            with contextlib.suppress(OSError):
                (root / name).rmdir()
        return
    pytest.skip("no cgroup can be created here to stand for a pod (needs root and a writable cgroup mount)")


def make_certificate(directory: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1: the cluster CA and the API server's certificate at once."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kube-apiserver")])
    now = dt.datetime.now(dt.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(hours=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), True)
        .sign(key, hashes.SHA256())
    )
    cert_file, key_file = directory / "tls.crt", directory / "tls.key"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return cert_file, key_file
