"""The Kubernetes API calls of the bridge, through lightkube (auth: the pod's service account with its
token re-read when it rotates, and the cluster CA; or a kubeconfig; patch types; the Eviction
subresource), each failure turned into a :class:`KubeError` that names the verb and the resource."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import Any, Literal, cast

import httpx2
from lightkube import ApiError, AsyncClient
from lightkube.config.kubeconfig import SERVICE_ACCOUNT, KubeConfig, SingleConfig
from lightkube.core.exceptions import ConfigError as LightkubeConfigError
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Event, Node, Pod
from lightkube.types import PatchType

from agent.bridges.kubernetes.config import KubernetesConfig
from agent.core.notice import utcnow

FIELD_MANAGER = "preemptd"

Failure = Literal[
    "config",
    "unreachable",
    "unauthorized",
    "forbidden",
    "not_found",
    "conflict",
    "throttled",
    "invalid",
    "error",
]


class KubeError(Exception):
    """A call that failed: ``failure`` says how, ``verb`` and ``resource`` what was attempted."""

    def __init__(
        self,
        failure: Failure,
        verb: str,
        resource: str,
        message: str,
        *,
        code: int | None = None,
        retry_after: float | None = None,
        causes: tuple[str, ...] = (),
    ) -> None:
        super().__init__(message)
        self.failure = failure
        self.verb = verb
        self.resource = resource
        self.code = code
        self.retry_after = retry_after
        self.causes = causes

    def __str__(self) -> str:
        text = f"{self.verb} {self.resource}: {self.failure}"
        if self.code is not None:
            text += f" ({self.code})"
        text += f": {self.args[0]}"
        if self.failure == "forbidden":
            text += (
                f"; the agent's service account needs '{self.verb}' on '{self.resource}' "
                "(packaging/kubernetes/rbac.yaml)"
            )
        return text


def retry_after_seconds(value: str | None) -> float | None:
    """A ``Retry-After`` header: seconds, or an HTTP date."""
    if not value:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, (when - utcnow()).total_seconds())


_FAILURES: Mapping[int, Failure] = {
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    409: "conflict",
    422: "invalid",
    429: "throttled",
}


def _translate(exc: Exception, verb: str, resource: str) -> KubeError:
    if isinstance(exc, ApiError):
        return _from_status(exc.response, exc.status.to_dict() if exc.status else {}, verb, resource)
    if isinstance(exc, httpx2.HTTPStatusError):
        # A Status body behind a proxy that rewrote its Content-Type is not an ApiError to lightkube.
        try:
            body = exc.response.json()
        except ValueError:
            body = {}
        return _from_status(exc.response, body if isinstance(body, dict) else {}, verb, resource)
    if isinstance(exc, (httpx2.TransportError, OSError)):
        return KubeError("unreachable", verb, resource, f"{type(exc).__name__}: {exc}".rstrip(": "))
    return KubeError("error", verb, resource, f"{type(exc).__name__}: {exc}")


def _from_status(response: httpx2.Response, status: Mapping[str, Any], verb: str, resource: str) -> KubeError:
    """A KubeError from a ``metav1.Status`` failure body (message, reason, causes) and the response."""
    code = int(status.get("code") or response.status_code)
    details = status.get("details") or {}
    causes = tuple(
        f"{c.get('reason', '')}: {c.get('message', '')}"
        for c in details.get("causes") or []
        if isinstance(c, dict)
    )
    retry_after = retry_after_seconds(response.headers.get("Retry-After"))
    if retry_after is None and isinstance(details.get("retryAfterSeconds"), int):
        retry_after = float(details["retryAfterSeconds"])
    return KubeError(
        _FAILURES.get(code, "error"),
        verb,
        resource,
        str(status.get("message") or response.reason_phrase or f"HTTP {code}"),
        code=code,
        retry_after=retry_after,
        causes=causes,
    )


def load_kubeconfig(config: KubernetesConfig, *, service_account: str | Path = SERVICE_ACCOUNT) -> KubeConfig:
    """The configured kubeconfig file, else the service account (in a pod), else KUBECONFIG or
    ~/.kube/config; KubeError("config") naming what was tried."""
    try:
        if config.kubeconfig:
            loaded = KubeConfig.from_file(config.kubeconfig)
        else:
            loaded = KubeConfig.from_env(service_account=service_account)
    except (LightkubeConfigError, OSError, ValueError) as exc:
        tried = config.kubeconfig or (
            f"the service account in {service_account}, then {os.environ.get('KUBECONFIG') or '~/.kube/config'}"
        )
        raise KubeError(
            "config", "load", "kubeconfig", f"no usable cluster configuration ({tried}): {exc}"
        ) from None
    return loaded


@dataclass
class KubeApi:
    """The calls the bridge makes, about one node. Every call has the configured timeout."""

    node: str
    client: AsyncClient

    @classmethod
    def connect(
        cls, config: KubernetesConfig, node: str, *, service_account: str | Path = SERVICE_ACCOUNT
    ) -> KubeApi:
        loaded = load_kubeconfig(config, service_account=service_account)
        chosen: KubeConfig | SingleConfig = loaded
        if config.context:
            try:
                chosen = loaded.get(config.context)  # type: ignore[assignment]
            except LightkubeConfigError:
                raise KubeError(
                    "config",
                    "load",
                    "kubeconfig",
                    f"context {config.context!r} is not in the kubeconfig (it has {sorted(loaded.contexts)})",
                ) from None
        client = AsyncClient(
            chosen, timeout=httpx2.Timeout(config.request_timeout_s), field_manager=FIELD_MANAGER
        )
        return cls(node=node, client=client)

    async def close(self) -> None:
        await self.client.close()

    async def get_node(self) -> dict[str, Any]:
        try:
            node = await self.client.get(Node, self.node)
        except Exception as exc:
            raise _translate(exc, "get", "nodes") from exc
        return node.to_dict()

    async def patch_node(self, patch: Mapping[str, Any]) -> dict[str, Any]:
        """A strategic-merge patch of the node (taints, unschedulable, annotations); a
        ``metadata.resourceVersion`` in it makes the API refuse (409) a node that changed meanwhile."""
        try:
            node = await self.client.patch(Node, self.node, dict(patch), patch_type=PatchType.STRATEGIC)
        except Exception as exc:
            raise _translate(exc, "patch", "nodes") from exc
        return node.to_dict()

    async def patch_node_status(self, patch: Mapping[str, Any]) -> dict[str, Any]:
        """A strategic-merge patch of the node's status: conditions merge by type."""
        try:
            node = await self.client.patch(
                Node.Status, self.node, dict(patch), patch_type=PatchType.STRATEGIC
            )
        except Exception as exc:
            raise _translate(exc, "patch", "nodes/status") from exc
        return node.to_dict()

    async def list_pods(self) -> list[dict[str, Any]]:
        try:
            return [
                pod.to_dict()
                async for pod in self.client.list(Pod, namespace="*", fields={"spec.nodeName": self.node})
            ]
        except Exception as exc:
            raise _translate(exc, "list", "pods") from exc

    async def evict(self, namespace: str, name: str) -> None:
        """Ask the API to evict a pod (policy/v1 Eviction): it honours PodDisruptionBudgets (429 while one
        blocks) and the pod's own terminationGracePeriodSeconds."""
        eviction = Pod.Eviction(metadata=ObjectMeta(name=name, namespace=namespace))
        try:
            await self.client.create(eviction, name=name, namespace=namespace)
        except Exception as exc:
            raise _translate(exc, "create", "pods/eviction") from exc

    async def create_event(self, event: Mapping[str, Any]) -> None:
        # The namespace is the Event's own (metadata.namespace).
        obj = cast(Event, Event.from_dict(dict(event)))
        try:
            await self.client.create(obj)
        except Exception as exc:
            raise _translate(exc, "create", "events") from exc
