"""Why the GPU monitor cannot see the GPUs: for each way NVML's start-up fails (no library, no device, no
permission, no kernel driver), the probable cause on this host or in this container, the library paths
looked at, and the section of docs/kubernetes.md that names each platform's story (Bottlerocket, GKE,
CRI-O). Read from the file system and the environment only; nothing here calls NVML.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DOCS = "docs/kubernetes.md#when-the-agent-cannot-see-the-gpu"
LIBRARY = "libnvidia-ml.so.1"
# Where a driver's libnvidia-ml.so.1 lives when the dynamic loader does not find it by name: the
# distributions' library directories, the NVIDIA container toolkit's and GKE device plugin's mount
# (/usr/local/nvidia), GKE's node driver (/home/kubernetes/bin/nvidia, when mounted), the GPU operator's
# driver container root (/run/nvidia/driver), WSL2.
DRIVER_DIRS: tuple[str, ...] = (
    "/usr/lib/x86_64-linux-gnu",
    "/usr/lib/aarch64-linux-gnu",
    "/usr/lib64",
    "/usr/lib",
    "/usr/local/nvidia/lib64",
    "/home/kubernetes/bin/nvidia/lib64",
    "/run/nvidia/driver/usr/lib/x86_64-linux-gnu",
    "/run/nvidia/driver/usr/lib64",
    "/usr/lib/wsl/lib",
)
DEVICE_NODE = re.compile(r"nvidia\d+$")

# What went wrong at start-up (agent/sources/nvml.py).
NO_LIBRARY = "library_not_found"
NO_DEVICE = "no_device"
NO_PERMISSION = "permission"
NO_DRIVER = "driver_not_loaded"


@dataclass(frozen=True)
class Diagnosis:
    """The probable cause of NVML being unavailable, for status (``sources.nvml.cause`` and the rest) and the
    start log. ``expected``: whether this looks like a host that should have a GPU (a Kubernetes pod, the
    NVIDIA runtime's variables, device nodes, a driver library), so that its absence is worth a warning."""

    problem: str
    cause: str
    tried: tuple[str, ...] = ()
    found: tuple[str, ...] = ()
    devices: tuple[str, ...] = ()
    expected: bool = False
    docs: str = DOCS

    def to_json(self) -> dict[str, Any]:
        return {
            "problem": self.problem,
            "cause": self.cause,
            "tried": list(self.tried),
            "found": list(self.found),
            "devices": list(self.devices),
            "docs": self.docs,
        }


def in_pod(env: Mapping[str, str]) -> bool:
    return bool(env.get("KUBERNETES_SERVICE_HOST"))


def device_nodes(dev: Path) -> tuple[str, ...]:
    """The GPU device nodes (``/dev/nvidia0``…) this process sees."""
    try:
        names = sorted(p.name for p in dev.iterdir() if DEVICE_NODE.match(p.name))
    except OSError:
        return ()
    return tuple(str(dev / name) for name in names)


def library_search(library_path: Path | None, env: Mapping[str, str], dirs: Sequence[str]) -> tuple[str, ...]:
    """The paths looked at for the library: the configured one only, or the dynamic loader's search by name
    (``LD_LIBRARY_PATH`` first) and the usual driver directories."""
    if library_path is not None:
        return (str(library_path),)
    loader = [d for d in env.get("LD_LIBRARY_PATH", "").split(":") if d]
    return tuple(dict.fromkeys(str(Path(d) / LIBRARY) for d in [*loader, *dirs]))


def _runtime(env: Mapping[str, str]) -> str:
    visible = env.get("NVIDIA_VISIBLE_DEVICES")
    shown = f"NVIDIA_VISIBLE_DEVICES={visible}" if visible is not None else "NVIDIA_VISIBLE_DEVICES unset"
    return (
        f"{shown}; the NVIDIA container runtime honours it only where the pod runs under it "
        "(runtimeClassName: nvidia, or nvidia as the node's default runtime; Bottlerocket ignores it for "
        "unprivileged pods, GKE and CRI-O have no such runtime by default)"
    )


def _no_library(library_path: Path | None, tried: tuple[str, ...], found: tuple[str, ...], pod: bool) -> str:
    if library_path is not None:
        return f"no loadable NVML library at gpu.library_path {library_path}"
    if found:
        return f"the driver's library is at {found[0]}, where the loader does not look: set gpu.library_path"
    if pod:
        return (
            "no NVIDIA driver library in this container: the runtime did not inject it (GKE: the driver "
            "is under /home/kubernetes/bin/nvidia on the node; mount it and set gpu.library_path)"
        )
    return "no NVIDIA driver on this host (a host without GPUs: set gpu.enabled = false)"


def diagnose(
    problem: str,
    library_path: Path | None,
    env: Mapping[str, str],
    *,
    dev: Path = Path("/dev"),
    dirs: Sequence[str] = DRIVER_DIRS,
) -> Diagnosis:
    """The probable cause of ``problem`` (one of ``NO_LIBRARY``, ``NO_DEVICE``, ``NO_PERMISSION``,
    ``NO_DRIVER``) here, from ``env`` (the process's environment), the device nodes under ``dev`` and the
    library paths of ``library_search``."""
    pod = in_pod(env)
    tried = library_search(library_path, env, dirs)
    found = tuple(p for p in tried if os.path.isfile(p))
    devices = device_nodes(dev)
    expected = pod or "NVIDIA_VISIBLE_DEVICES" in env or bool(devices) or bool(found) or problem != NO_LIBRARY
    if problem == NO_LIBRARY:
        cause = _no_library(library_path, tried, found, pod)
    elif problem == NO_DEVICE and not devices:
        cause = f"NVML loaded but no GPU device node (/dev/nvidia0…) is visible here: {_runtime(env)}"
    elif problem == NO_DEVICE:
        cause = "NVML loaded and the device nodes are here, but the driver lists no GPU: check nvidia-smi on the node"
    elif problem == NO_PERMISSION:
        cause = (
            "NVML may not open /dev/nvidiactl or the GPUs: the container's device cgroup or the nodes' modes "
            f"forbid it; {_runtime(env)}"
        )
    else:
        cause = (
            "the library is here but the NVIDIA kernel module is not loaded (a driver container still "
            "installing, or a driver upgrade without a reboot)"
        )
    return Diagnosis(problem, cause, tried, found, devices, expected)
