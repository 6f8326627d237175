"""What torchrun told the worker's launcher: its node bounds, rendezvous and restarts, read from the parent
process' command line with torchrun's own argument parser (agent.client.elastic decides from them)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Launch", "listens_on", "restarts_left", "torchrun_args"]

_TORCHRUN_MODULES = ("torch.distributed.run", "torch.distributed.launch")
_DEFAULT_RDZV_PORT = 29400  # torchrun's default when --rdzv-endpoint names no port


@dataclass(frozen=True)
class Launch:
    """What torchrun (this worker's parent) was told: node bounds and rendezvous."""

    agent_pid: int
    min_nodes: int
    max_nodes: int
    rdzv_backend: str
    rdzv_endpoint: str
    max_restarts: int

    @property
    def elastic(self) -> bool:
        return self.rdzv_backend != "static" and self.min_nodes < self.max_nodes

    @property
    def store_port(self) -> int | None:
        """The port of the rendezvous store torchrun serves itself (c10d), None for an external one."""
        if self.rdzv_backend != "c10d":
            return None
        _, _, port = self.rdzv_endpoint.rpartition(":")
        return int(port) if port.isdigit() else _DEFAULT_RDZV_PORT

    @classmethod
    def of_parent(cls, pid: int | None = None) -> Launch | None:
        """The launch of the torchrun process ``pid`` (this process' parent by default); None when the parent
        is not torchrun or its command line cannot be read."""
        pid = os.getppid() if pid is None else pid
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            return None
        args = torchrun_args([a for a in argv if a != ""])
        if args is None:
            return None
        from torch.distributed.run import get_args_parser, parse_min_max_nnodes

        try:
            parsed, _ = get_args_parser().parse_known_args(args)
            low, high = parse_min_max_nnodes(parsed.nnodes) if ":" in parsed.nnodes else (0, 0)
            if ":" not in parsed.nnodes:
                low = high = int(parsed.nnodes)
        except (SystemExit, ValueError, RuntimeError):
            return None
        return cls(
            agent_pid=pid,
            min_nodes=int(low),
            max_nodes=int(high),
            rdzv_backend=str(parsed.rdzv_backend),
            rdzv_endpoint=str(parsed.rdzv_endpoint or ""),
            max_restarts=int(parsed.max_restarts),
        )


def torchrun_args(argv: list[str]) -> list[str] | None:
    """torchrun's own arguments in a command line (``torchrun …`` or ``python -m torch.distributed.run …``),
    None when the command is not torchrun."""
    if not argv:
        return None
    if os.path.basename(argv[0]) == "torchrun":
        return argv[1:]
    for index, arg in enumerate(argv[:-1]):
        if arg == "-m" and argv[index + 1] in _TORCHRUN_MODULES:
            return argv[index + 2 :]
    if len(argv) > 1 and os.path.basename(argv[1]) == "torchrun":  # python /usr/bin/torchrun …
        return argv[2:]
    return None


def listens_on(pid: int, port: int) -> bool:
    """Whether process ``pid`` holds a TCP socket listening on ``port`` (any address), from /proc."""
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(fields[9])
    if not inodes:
        return False
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for name in names:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{name}")
        except OSError:
            continue
        if target.startswith("socket:[") and target[8:-1] in inodes:
            return True
    return False


def restarts_left(launch: Launch | None) -> int:
    """The restarts this worker's torchrun has left: its ``--max-restarts`` less the restarts so far (torchrun
    tells its workers both)."""
    try:
        most = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", launch.max_restarts if launch else 0))
        return most - int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    except ValueError:
        return 0
