"""A real Ray cluster on this machine for the tests: a head and a worker started with ``ray start --block``
(each its own process group, temporary directory and ports), stopped by signalling exactly those groups.
The worker carries a custom resource ``pd_worker`` so a test can place work on it."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

RAY = Path(sys.executable).with_name("ray")


class Unavailable(Exception):
    """Ray cannot run here; the message says why."""


def _ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for sock in socks:
            sock.close()


def _node_args(temp_dir: Path, worker_ports: tuple[int, int]) -> list[str]:
    agent, grpc, metrics, runtime_env, manager, objects = _ports(6)
    return [
        "--node-ip-address=127.0.0.1",
        "--num-cpus=1",
        "--object-store-memory=80000000",
        f"--temp-dir={temp_dir}",
        f"--dashboard-agent-listen-port={agent}",
        f"--dashboard-agent-grpc-port={grpc}",
        f"--metrics-export-port={metrics}",
        f"--runtime-env-agent-port={runtime_env}",
        f"--node-manager-port={manager}",
        f"--object-manager-port={objects}",
        f"--min-worker-port={worker_ports[0]}",
        f"--max-worker-port={worker_ports[1]}",
        "--disable-usage-stats",
        "--block",
    ]


@dataclass
class RayCluster:
    root: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="pd-ray-", dir="/tmp")))
    address: str = ""
    _procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_ADDRESS": self.address}

    def start(self, timeout: float = 90.0) -> None:
        if not RAY.exists():
            raise Unavailable(f"Ray is not installed in this environment ({RAY} is missing)")
        (gcs,) = _ports(1)
        self.address = f"127.0.0.1:{gcs}"
        base = 30000 + (os.getpid() % 200) * 100
        head = ["--head", f"--port={gcs}", "--include-dashboard=false"]
        self._spawn("head", [*head, *_node_args(self.root / "head", (base, base + 40))])
        self.wait_nodes(1, timeout)
        worker = [f"--address={self.address}", '--resources={"pd_worker": 1}']
        self._spawn("worker", [*worker, *_node_args(self.root / "worker", (base + 50, base + 90))])
        self.wait_nodes(2, timeout)

    def _spawn(self, name: str, args: list[str]) -> None:
        log = open(self.root / f"{name}.log", "wb")  # noqa: SIM115 - the child writes it while it runs
        with log:
            proc = subprocess.Popen(
                [str(RAY), "start", *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,
            )
        self._procs.append(proc)

    def gcs(self) -> Any:
        import ray._raylet

        return ray._raylet.GcsClient(address=self.address)

    def nodes(self) -> dict[str, Any]:
        """Node id (hex) → GcsNodeInfo, alive or dead."""
        return {k.hex(): v for k, v in self.gcs().get_all_node_info(timeout=10).items()}

    def node_ids(self) -> tuple[str, str]:
        """(head, worker) ids of the live nodes."""
        alive = [(v.is_head_node, k) for k, v in self.nodes().items() if v.state == 0]
        head = next(k for is_head, k in alive if is_head)
        worker = next(k for is_head, k in alive if not is_head)
        return head, worker

    def wait_nodes(self, count: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        seen = 0
        while time.monotonic() < deadline:
            for proc in self._procs:
                if proc.poll() is not None:
                    raise Unavailable(f"ray start exited with {proc.returncode}: {self.logs()}")
            try:
                seen = sum(1 for v in self.nodes().values() if v.state == 0)
            except Exception:  # the GCS is not up yet
                seen = 0
            if seen >= count:
                return
            time.sleep(0.5)
        raise Unavailable(f"only {seen} of {count} Ray nodes came up in {timeout:g} s: {self.logs()}")

    def logs(self) -> str:
        parts = []
        for name in ("head", "worker"):
            path = self.root / f"{name}.log"
            if path.exists():
                parts.append(f"--- {name}\n{path.read_text(errors='replace')[-1500:]}")
        return "\n".join(parts)

    def stop_head(self) -> None:
        """Stop the head node's processes (its GCS with them): the cluster's control plane is down."""
        self._signal_group(self._procs[0])

    def _signal_group(self, proc: subprocess.Popen[bytes]) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()

    def stop(self) -> None:
        for proc in reversed(self._procs):
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
        deadline = time.monotonic() + 10
        for proc in reversed(self._procs):
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # whatever `ray start` left in its group
            proc.wait()
        self._procs.clear()
        shutil.rmtree(self.root, ignore_errors=True)
