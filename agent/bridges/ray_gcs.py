"""The Ray bridge's child process (``python -m agent.bridges.ray_gcs``): one call to Ray's GCS — the cluster's
nodes, or a drain — read as JSON on stdin and answered as one JSON line on stdout. Ray's Python log records
and warnings go to stderr as JSON lines, beside Ray's C++ lines, for the bridge to turn into its own events
(see agent/bridges/ray.py for why Ray runs apart from the agent). Standard library only, apart from Ray.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import sys
from dataclasses import asdict, dataclass
from typing import Any

NOT_INSTALLED = (
    "Ray is not installed in the agent's environment, so the Ray bridge cannot drain this node; "
    "install it with pip install 'preemptd[ray]' (the same Ray version as the cluster's)"
)


@dataclass(frozen=True)
class RayNode:
    """A node of the cluster as the GCS lists it."""

    node_id: str
    address: str
    is_head: bool
    alive: bool


def unreachable(address: str | None, detail: str) -> str:
    """What the agent says when the GCS did not answer: where, Ray's answer, what to check."""
    return (
        f"the Ray GCS at {address or 'this host'} did not answer ({detail}); check that the cluster's head "
        "is up and reachable from this host (actions.ray.address); notices still reach local clients, and "
        "the next notice tries again"
    )


class _JsonLines(logging.Handler):
    """A log record (Ray's Python loggers, warnings) as one JSON line on stderr."""

    def emit(self, record: logging.LogRecord) -> None:
        doc = {"level": record.levelname, "logger": record.name, "message": record.getMessage()}
        sys.stderr.write(json.dumps(doc) + "\n")


def serve(request: dict[str, Any]) -> dict[str, Any]:
    """One GCS call (``nodes`` or ``drain``); the answer, or an error and its failure."""
    address = str(request.get("address") or "")
    try:
        raylet = importlib.import_module("ray._raylet")
        autoscaler = importlib.import_module("ray.core.generated.autoscaler_pb2")
    except ImportError as exc:
        return {"error": NOT_INSTALLED, "failure": "not_installed", "detail": str(exc)}
    handler = _JsonLines()
    for name in ("ray", ""):  # Ray's own handler writes its own format: replace it
        logger = logging.getLogger(name)
        logger.handlers = [handler]
        logger.setLevel(logging.WARNING)
    if not address:
        services = importlib.import_module("ray._private.services")
        try:
            address = str(services.canonicalize_bootstrap_address_or_die(os.environ.get("RAY_ADDRESS")))
        except (ConnectionError, ValueError) as exc:
            return {
                "error": f"no Ray cluster found on this host ({exc}); set actions.ray.address",
                "failure": "no_cluster",
            }
    timeout = float(request.get("timeout_s") or 10.0)
    no_answer = (ConnectionError, TimeoutError, raylet.RpcError, raylet.GetTimeoutError)
    try:
        # The inner client, as the wrapper has no timeout of its own for connecting.
        client = raylet.InnerGcsClient.standalone(address, None, int(timeout * 1000))
        if request.get("op") == "drain":
            reason = autoscaler.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION")
            accepted, rejection = client.drain_node(
                request["node_id"], reason, request["message"], int(request["deadline_ms"]), timeout=timeout
            )
            return {"address": address, "result": [bool(accepted), str(rejection or "")]}
        infos = client.get_all_node_info(timeout=timeout)
    except no_answer as exc:
        detail = f"{type(exc).__name__}: {exc}".rstrip(": ")
        return {"address": address, "error": unreachable(address, detail), "failure": "unreachable"}
    except Exception as exc:  # Ray's own errors: said as they are
        return {"address": address, "error": f"Ray failed: {type(exc).__name__}: {exc}", "failure": "failed"}
    nodes = [
        RayNode(
            node_id=node_id.hex(),
            address=str(info.node_manager_address),
            is_head=bool(info.is_head_node),
            alive=int(info.state) == 0,  # GcsNodeInfo.ALIVE
        )
        for node_id, info in infos.items()
    ]
    return {"address": address, "result": [asdict(node) for node in nodes]}


def main() -> None:
    """``python -m agent.bridges.ray_gcs``: one request (JSON) on stdin, its answer as the last stdout line."""
    logging.captureWarnings(True)
    request = json.loads(sys.stdin.read() or "{}")
    answer = serve(request)
    sys.stdout.write(json.dumps(answer) + "\n")
    sys.stdout.flush()
    # Ray's threads may hold the interpreter's exit; the answer is out.
    os._exit(0)


if __name__ == "__main__":
    main()
