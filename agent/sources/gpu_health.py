"""What GPU readings mean: pure evaluation of NVML readings into findings, and the hysteresis that keeps a
flapping condition from flooding clients. No NVML and no I/O here; :mod:`agent.sources.nvml` feeds it.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from agent.core.notice import Kind, Observation, Severity
from agent.sources.gpu_xid import XidClass, classify_xid, describe_xid

# The periodic checks, in the order they are read.
CHECKS: tuple[str, ...] = (
    "ecc",
    "retired_pages",
    "remapped_rows",
    "temperature",
    "clocks",
    "power",
    "recovery_action",
    "processes",
)

CLOCK_REASON_NAMES: Mapping[int, str] = {
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
}

RECOVERY_ACTIONS: Mapping[int, tuple[str, XidClass]] = {
    0: ("none", XidClass.INFO),
    1: ("gpu_reset", XidClass.FATAL),
    2: ("node_reboot", XidClass.FATAL),
    3: ("drain_p2p", XidClass.DEGRADED),
    4: ("drain_and_reset", XidClass.DEGRADED),
    5: ("recover_imex_domain", XidClass.FATAL),
    6: ("bus_reset", XidClass.FATAL),
    7: ("system_reboot", XidClass.FATAL),
}


class CheckState(str, enum.Enum):
    PENDING = "pending"
    OK = "ok"
    FINDING = "finding"
    NOT_SUPPORTED = "not_supported"
    ERROR = "error"


@dataclass(frozen=True)
class GpuIdentity:
    uuid: str
    index: int
    name: str
    pci_bus_id: str

    @property
    def label(self) -> str:
        return f"GPU {self.index} ({self.uuid})"

    def to_json(self) -> dict[str, Any]:
        return {"uuid": self.uuid, "index": self.index, "name": self.name, "pci_bus_id": self.pci_bus_id}


@dataclass(frozen=True)
class Finding:
    """A bad reading of one check: its class decides the notice kind; ``reason`` must not carry the
    reading's value (values go in ``detail``) so that a changing value does not send an update."""

    cls: XidClass
    reason: str
    detail: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Thresholds:
    temperature_shutdown_margin_c: float = 3.0
    power_tolerance: float = 0.05
    clock_event_mask: int = 0x8 | 0x20 | 0x40 | 0x80


def observation(gpu: GpuIdentity, condition: str, finding: Finding, source_path: str = "poll") -> Observation:
    """The notice-board observation of ``finding``; the key is stable per GPU UUID and condition."""
    kind = Kind.GPU_FAULT if finding.cls is XidClass.FATAL else Kind.GPU_DEGRADED
    severity = Severity.CRITICAL if finding.cls is XidClass.FATAL else Severity.WARNING
    detail = {**gpu.to_json(), "condition": condition, "class": finding.cls.value, "via": source_path}
    detail.update(finding.detail)
    return Observation(
        key=f"{gpu.uuid}/{condition}",
        kind=kind,
        severity=severity,
        reason=f"{gpu.label}: {finding.reason}",
        detail=detail,
    )


def evaluate(check: str, value: Any, limits: Thresholds) -> Finding | None:
    """The finding for one successful reading of ``check``, or None when the reading is healthy."""
    if check == "ecc":
        return _ecc_finding(int(value))
    if check == "retired_pages":
        return _retired_pages_finding(int(value))
    if check == "remapped_rows":
        return _remapped_rows_finding(value)
    if check == "temperature":
        return _temperature_finding(value, limits)
    if check == "clocks":
        return _clocks_finding(int(value), limits)
    if check == "power":
        return _power_finding(value, limits)
    if check == "recovery_action":
        return recovery_finding(int(value))
    return None


def _ecc_finding(count: int) -> Finding | None:
    if count > 0:
        return Finding(
            XidClass.DEGRADED,
            "volatile uncorrected ECC errors since the driver loaded; reset the GPU after the job",
            {"ecc_uncorrected_volatile": count},
        )
    return None


def _retired_pages_finding(pending: int) -> Finding | None:
    if pending:
        return Finding(
            XidClass.DEGRADED,
            "memory pages are pending retirement; reset the GPU after the job",
            {"retired_pages_pending": True},
        )
    return None


def _remapped_rows_finding(value: Any) -> Finding | None:
    """``value``: the counts of correctable and uncorrectable remaps, and the pending and failure flags."""
    corr, unc, pending, failure = (int(v) for v in value)
    detail = {
        "correctable": corr,
        "uncorrectable": unc,
        "pending": bool(pending),
        "failure": bool(failure),
    }
    if failure:
        return Finding(XidClass.FATAL, "row remapping failed: the GPU needs service", detail)
    if pending:
        return Finding(XidClass.DEGRADED, "a row remap is pending; reset the GPU after the job", detail)
    return None


def _temperature_finding(value: Any, limits: Thresholds) -> Finding | None:
    """``value``: the temperature and the slowdown and shutdown thresholds (None: unknown)."""
    temp, slowdown, shutdown = value
    detail = {"temperature_c": temp, "slowdown_c": slowdown, "shutdown_c": shutdown}
    if shutdown is not None and temp >= shutdown - limits.temperature_shutdown_margin_c:
        return Finding(XidClass.FATAL, "temperature near its shutdown threshold", detail)
    if slowdown is not None and temp >= slowdown:
        return Finding(XidClass.DEGRADED, "temperature at or above its slowdown threshold", detail)
    return None


def _clocks_finding(event_reasons: int, limits: Thresholds) -> Finding | None:
    reasons = event_reasons & limits.clock_event_mask
    if reasons:
        names = [name for bit, name in CLOCK_REASON_NAMES.items() if reasons & bit]
        return Finding(
            XidClass.DEGRADED,
            "clocks slowed by " + ", ".join(names),
            {"clock_event_reasons": event_reasons, "reasons": names},
        )
    return None


def _power_finding(value: Any, limits: Thresholds) -> Finding | None:
    """``value``: the power draw and the enforced limit, in milliwatts."""
    usage, limit = value
    if limit and usage > limit * (1.0 + limits.power_tolerance):
        return Finding(
            XidClass.DEGRADED,
            "power draw above the enforced limit",
            {"power_w": usage / 1000.0, "limit_w": limit / 1000.0},
        )
    return None


def recovery_finding(action: int) -> Finding | None:
    """The driver's GPU recovery action (field 230 or a GpuRecoveryAction event); NONE is healthy."""
    if action == 0:
        return None
    name, cls = RECOVERY_ACTIONS.get(action, (f"action_{action}", XidClass.FATAL))
    return Finding(cls, f"the driver asks for recovery action {name}", {"recovery_action": name})


def xid_finding(xid: int, overrides: Mapping[int, str], default: str) -> Finding:
    cls = classify_xid(xid, overrides, default)
    return Finding(cls, f"XID {xid}: {describe_xid(xid)}", {"xid": xid})


class Hysteresis:
    """Level-triggered conditions with hysteresis, keyed by observation key.

    A condition becomes active after ``raise_after`` bad readings in a row, or on the first one when it is
    urgent, and inactive after ``clear_after`` good readings in a row. A key with no reading this round
    keeps its state.
    """

    def __init__(self, raise_after: int, clear_after: int) -> None:
        self.raise_after = max(1, raise_after)
        self.clear_after = max(1, clear_after)
        self._bad: dict[str, int] = {}
        self._good: dict[str, int] = {}
        self._active: dict[str, Observation] = {}

    def bad(self, obs: Observation, urgent: bool = False) -> None:
        key = obs.key
        self._good.pop(key, None)
        self._bad[key] = self._bad.get(key, 0) + 1
        if key in self._active or urgent or self._bad[key] >= self.raise_after:
            self._active[key] = obs

    def good(self, key: str) -> None:
        self._bad.pop(key, None)
        if key not in self._active:
            return
        self._good[key] = self._good.get(key, 0) + 1
        if self._good[key] >= self.clear_after:
            del self._active[key]
            self._good.pop(key, None)

    def forget(self, key: str) -> None:
        self._bad.pop(key, None)
        self._good.pop(key, None)
        self._active.pop(key, None)

    def is_active(self, key: str) -> bool:
        return key in self._active

    def active(self) -> dict[str, Observation]:
        return dict(self._active)


class HeldFindings:
    """Edge-triggered findings (an XID, a driver event): active for ``hold_s`` after the last occurrence."""

    def __init__(self) -> None:
        self._held: dict[str, tuple[Observation, float]] = {}

    def add(self, obs: Observation, now: float, hold_s: float) -> None:
        self._held[obs.key] = (obs, now + hold_s)

    def active(self, now: float) -> dict[str, Observation]:
        for key in [k for k, (_, until) in self._held.items() if until <= now]:
            del self._held[key]
        return {key: obs for key, (obs, _) in self._held.items()}


def merge(*layers: Mapping[str, Observation]) -> list[Observation]:
    """One observation per key, the most severe one where layers overlap."""
    merged: dict[str, Observation] = {}
    for layer in layers:
        for key, obs in layer.items():
            current = merged.get(key)
            if current is None or obs.effective_severity.rank >= current.effective_severity.rank:
                merged[key] = obs
    return [merged[key] for key in sorted(merged)]


def pids_text(pids: Sequence[int]) -> str:
    return ",".join(str(p) for p in pids)
