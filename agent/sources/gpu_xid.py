"""XID errors: how serious each one is, and how to read one from an ``NVRM: Xid`` kernel log line.

Pure functions and tables. The built-in classes follow NVIDIA's XID catalog (as NVSentinel publishes it) and
DCGM's health watches; ``gpu.xid_classes`` in the configuration overrides single entries.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping
from dataclasses import dataclass


class XidClass(str, enum.Enum):
    FATAL = "fatal"  # the GPU is going away or needs a reset: checkpoint now
    DEGRADED = "degraded"  # checkpoint soon, drain after the job
    INFO = "info"  # logged and shown in status only; no notice


_FATAL = (46, 48, 61, 62, 64, 74, 79, 95, 109, 119, 120, 140, 143, *range(144, 151))
# Application-level errors (the process on the GPU hit a CUDA error; the GPU itself is fine) and
# informational entries: 13, 31, 43, 45, 68 are what the Kubernetes device plugin also ignores.
_INFO = (13, 31, 43, 45, 63, 68)
# A contained ECC error (94) or a high single-bit rate (92): the GPU wants a reset after the job.
_DEGRADED = (69, 92, 94)

DEFAULT_XID_CLASSES: Mapping[int, XidClass] = {
    **dict.fromkeys(_FATAL, XidClass.FATAL),
    **dict.fromkeys(_DEGRADED, XidClass.DEGRADED),
    **dict.fromkeys(_INFO, XidClass.INFO),
}

XID_DESCRIPTIONS: Mapping[int, str] = {
    13: "graphics engine exception",
    31: "GPU memory page fault",
    43: "GPU stopped processing",
    45: "preemptive cleanup",
    46: "GPU stopped processing",
    48: "double-bit ECC error",
    61: "internal micro-controller breakpoint/warning",
    62: "internal micro-controller halt",
    63: "ECC page retirement or row remapping recorded",
    64: "ECC page retirement or row remapper failure",
    68: "video processor exception",
    69: "graphics engine class error",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    95: "uncontained ECC error",
    109: "context switch timeout",
    119: "GSP RPC timeout",
    120: "GSP error",
    140: "unrecovered ECC error",
    143: "GPU initialization failure",
    **dict.fromkeys(range(144, 151), "NVLink5 error"),
}


def classify_xid(
    xid: int, overrides: Mapping[int, str] | None = None, default: str = XidClass.DEGRADED.value
) -> XidClass:
    """The class of ``xid``: the configured override, else the built-in table, else ``default``."""
    if overrides and xid in overrides:
        return XidClass(overrides[xid])
    return DEFAULT_XID_CLASSES.get(xid, XidClass(default))


def describe_xid(xid: int) -> str:
    return XID_DESCRIPTIONS.get(xid, "see NVIDIA's XID catalog")


@dataclass(frozen=True)
class KmsgXid:
    """One ``NVRM: Xid`` kernel log line."""

    pci: tuple[int, int, int]  # (domain, bus, device)
    xid: int
    text: str


_XID_LINE = re.compile(
    r"NVRM: Xid \(PCI:(?P<domain>[0-9a-fA-F]+):(?P<bus>[0-9a-fA-F]+):(?P<device>[0-9a-fA-F]+)"
    r"(?:\.[0-9a-fA-F]+)?\): (?P<xid>\d+),\s*(?P<text>.*)"
)
_BUS_ID = re.compile(
    r"^(?:(?P<domain>[0-9a-fA-F]+):)?(?P<bus>[0-9a-fA-F]+):(?P<device>[0-9a-fA-F]+)(?:\.\w+)?$"
)


def parse_kmsg_xid(line: str) -> KmsgXid | None:
    """Parse a kernel log record (``/dev/kmsg`` form ``pri,seq,ts,flags;message`` or plain text) into the
    XID it reports, or None if it is not an NVRM Xid line."""
    match = _XID_LINE.search(line)
    if match is None:
        return None
    pci = (int(match["domain"], 16), int(match["bus"], 16), int(match["device"], 16))
    return KmsgXid(pci=pci, xid=int(match["xid"]), text=match["text"].strip())


def pci_key(bus_id: str) -> tuple[int, int, int] | None:
    """(domain, bus, device) of an NVML bus id (``00000000:2B:00.0``) or a kernel one (``0000:2b:00``)."""
    match = _BUS_ID.match(bus_id.strip())
    if match is None:
        return None
    return (int(match["domain"] or "0", 16), int(match["bus"], 16), int(match["device"], 16))
