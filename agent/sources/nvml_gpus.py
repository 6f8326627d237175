"""The GPU monitor's per-GPU state machine: what a poll's readings and errors, an NVML event, an XID from the
kernel log, a hung call or a lost GPU become for each GPU (its check states, its errors, and the findings
held by hysteresis or for ``gpu.xid_hold_s``). Runs on the loop thread and makes no NVML call: the driver
calls are in nvml_driver.py, the source that schedules them in nvml.py, and what one reading means in
gpu_health.py.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import structlog

from agent.config import GpuConfig
from agent.core.notice import Kind, Observation, Severity
from agent.sources.gpu_health import (
    CHECKS,
    CheckState,
    Finding,
    GpuIdentity,
    HeldFindings,
    Hysteresis,
    Thresholds,
    evaluate,
    merge,
    observation,
    recovery_finding,
    xid_finding,
)
from agent.sources.gpu_xid import XidClass
from agent.sources.nvml_driver import (
    EVENT_DBE,
    EVENT_GPU_UNAVAILABLE,
    EVENT_RECOVERY_ACTION,
    EVENT_SBE,
    EVENT_XID,
    FUNCTION_NOT_FOUND,
    GPU_IS_LOST,
    NOT_SUPPORTED,
    UNKNOWN,
    PollResult,
    Worker,
    error_text,
)

log = structlog.get_logger("preemptd.nvml")


@dataclass
class Gpu:
    """What the monitor knows of one GPU; owned by the loop thread."""

    ident: GpuIdentity
    handle: Any
    worker: Worker
    checks: dict[str, CheckState] = field(default_factory=lambda: dict.fromkeys(CHECKS, CheckState.PENDING))
    errors: dict[str, str] = field(default_factory=dict)
    pids: list[int] = field(default_factory=list)
    events: str = "pending"
    inflight: asyncio.Future[PollResult] | None = None
    hung_call: str | None = None
    unknown_streak: int = 0
    lost: bool = False
    last_xid: dict[str, Any] | None = None
    sbe_events: int = 0

    def disabled(self) -> frozenset[str]:
        return frozenset(c for c, s in self.checks.items() if s is CheckState.NOT_SUPPORTED)


class GpuFindings:
    """The findings of every GPU: conditions seen by polling go through hysteresis (``gpu.raise_after`` /
    ``gpu.clear_after``), events (XIDs, double-bit ECC, unavailable, recovery action) are held for
    ``gpu.xid_hold_s``."""

    def __init__(self, config: GpuConfig) -> None:
        self.config = config
        self.limits = Thresholds(
            temperature_shutdown_margin_c=config.temperature_shutdown_margin_c,
            power_tolerance=config.power_tolerance,
            clock_event_mask=config.clock_event_mask,
        )
        self._hyst = Hysteresis(config.raise_after, config.clear_after)
        self._held = HeldFindings()

    def active(self, system: Mapping[str, Observation]) -> list[Observation]:
        """Every finding that holds now, the GPUs' and then ``system``'s (not tied to one GPU)."""
        return merge(self._hyst.active(), self._held.active(time.monotonic()), system)

    def unusable(self, ident: GpuIdentity, code: int) -> None:
        """A GPU whose handle or identity could not be read at start-up: a fault at once."""
        reason = f"cannot be used (NVML: {error_text(code)} while enumerating GPUs)"
        self._hyst.bad(observation(ident, "lost", Finding(XidClass.FATAL, reason)), urgent=True)

    # -- polls -----------------------------------------------------------------------------------------

    def poll_failed(self, gpu: Gpu, error: BaseException) -> None:
        """The poll job itself raised (not one check: those are in the result)."""
        log.error("nvml_poll_failed", gpu=gpu.ident.uuid, error=repr(error))
        gpu.errors["poll"] = repr(error)

    def poll_done(self, gpu: Gpu, result: PollResult) -> None:
        """One poll of ``gpu`` returned: a hung call is over, a lost GPU is a fault, each check is read."""
        gpu.errors.pop("poll", None)
        hung_key = f"{gpu.ident.uuid}/hung"
        if gpu.hung_call is not None:
            log.info("nvml_call_returned", gpu=gpu.ident.uuid, call=gpu.hung_call)
            gpu.hung_call = None
        self._hyst.good(hung_key)
        lost_key = f"{gpu.ident.uuid}/lost"
        if result.lost is not None:
            gpu.lost = True
            reason = (
                "fallen off the bus (NVML: GPU is lost)"
                if result.lost == GPU_IS_LOST
                else "the GPU needs a reset (NVML: GPU requires restart)"
            )
            finding = Finding(XidClass.FATAL, reason, {"nvml_error": error_text(result.lost)})
            self._hyst.bad(observation(gpu.ident, "lost", finding), urgent=True)
            return
        unknown = any(code == UNKNOWN for code in result.errors.values())
        gpu.unknown_streak = gpu.unknown_streak + 1 if unknown else 0
        if gpu.unknown_streak >= self.config.unknown_after:
            gpu.lost = True
            finding = Finding(
                XidClass.FATAL,
                "not responding (NVML: Unknown Error on every poll)",
                {"nvml_error": error_text(UNKNOWN), "polls": gpu.unknown_streak},
            )
            self._hyst.bad(observation(gpu.ident, "lost", finding), urgent=True)
        elif not unknown:
            gpu.lost = False
            self._hyst.good(lost_key)
        for check in CHECKS:
            if check in result.failures:
                gpu.checks[check] = CheckState.ERROR
                gpu.errors[check] = result.failures[check]
            elif check in result.errors:
                self._check_failed(gpu, check, result.errors[check])
            elif check in result.values:
                gpu.errors.pop(check, None)
                self._check_read(gpu, check, result.values[check])

    def _check_failed(self, gpu: Gpu, check: str, code: int) -> None:
        if code in (NOT_SUPPORTED, FUNCTION_NOT_FOUND):
            # Normal for many calls on many SKUs and drivers: this one check is off for this GPU.
            gpu.checks[check] = CheckState.NOT_SUPPORTED
            gpu.errors.pop(check, None)
            self._hyst.forget(f"{gpu.ident.uuid}/{check}")
            log.info("nvml_check_not_supported", gpu=gpu.ident.uuid, check=check)
            return
        gpu.checks[check] = CheckState.ERROR
        gpu.errors[check] = error_text(code)

    def _check_read(self, gpu: Gpu, check: str, value: Any) -> None:
        if check == "processes":
            gpu.pids = list(value)
            gpu.checks[check] = CheckState.OK
            return
        finding = evaluate(check, value, self.limits)
        key = f"{gpu.ident.uuid}/{check}"
        if finding is None:
            self._hyst.good(key)
        else:
            self._hyst.bad(observation(gpu.ident, check, finding), urgent=finding.cls is XidClass.FATAL)
        gpu.checks[check] = CheckState.FINDING if self._hyst.is_active(key) else CheckState.OK

    # -- hung calls ------------------------------------------------------------------------------------

    def hung(self, gpu: Gpu, call: str) -> None:
        """``gpu``'s worker has been inside ``call`` for longer than ``gpu.call_timeout_s``."""
        if gpu.hung_call is None:
            log.error("nvml_call_hung", gpu=gpu.ident.uuid, call=call, bound_s=self.config.call_timeout_s)
        gpu.hung_call = call
        self._hyst.bad(self.hung_obs("hung", gpu.ident.label, call, gpu.ident), urgent=True)

    def hung_obs(self, condition: str, what: str, call: str, gpu: GpuIdentity | None) -> Observation:
        """The fault of a call that did not return in time, on one GPU or (``gpu`` None) the driver's."""
        reason = f"NVML call hung: {call} on {what} did not return within {self.config.call_timeout_s:g} s"
        detail: dict[str, Any] = {"call": call, "bound_s": self.config.call_timeout_s, "condition": "hung"}
        if gpu is not None:
            obs = observation(gpu, condition, Finding(XidClass.FATAL, "", detail))
            return Observation(obs.key, obs.kind, reason, severity=obs.severity, detail=obs.detail)
        return Observation(condition, Kind.GPU_FAULT, reason, severity=Severity.CRITICAL, detail=detail)

    # -- events ----------------------------------------------------------------------------------------

    def event(self, gpu: Gpu, event_type: int, data: int) -> None:
        """An NVML event (a mask of event types) on ``gpu``."""
        now = time.monotonic()
        if event_type & EVENT_XID:
            self.xid(gpu, data, "nvml", None)
        if event_type & EVENT_DBE:
            finding = Finding(XidClass.FATAL, "double-bit ECC error", {"event": "double_bit_ecc"})
            self._held.add(
                observation(gpu.ident, "double-bit-ecc", finding, "nvml"), now, self.config.xid_hold_s
            )
        if event_type & EVENT_SBE:
            gpu.sbe_events += 1
        if event_type & EVENT_GPU_UNAVAILABLE:
            finding = Finding(
                XidClass.FATAL, "the driver reports the GPU unavailable", {"event": "gpu_unavailable"}
            )
            self._held.add(
                observation(gpu.ident, "unavailable", finding, "nvml"), now, self.config.xid_hold_s
            )
        if event_type & EVENT_RECOVERY_ACTION:
            recovery = recovery_finding(data)
            if recovery is not None:
                obs = observation(gpu.ident, "recovery_action", recovery, "nvml")
                self._held.add(obs, now, self.config.xid_hold_s)

    def xid(self, gpu: Gpu, xid: int, via: str, text: str | None) -> None:
        """XID ``xid`` on ``gpu``, seen ``via`` NVML's events or the kernel log (with its ``text``)."""
        finding = xid_finding(xid, self.config.xid_classes, self.config.xid_default)
        gpu.last_xid = {"xid": xid, "class": finding.cls.value, "via": via, "text": text, "at": time.time()}
        log.warning("gpu_xid", gpu=gpu.ident.uuid, xid=xid, cls=finding.cls.value, via=via, text=text)
        if finding.cls is XidClass.INFO:
            return
        detail = dict(finding.detail)
        if text:
            detail["text"] = text
        finding = Finding(finding.cls, finding.reason, detail)
        obs = observation(gpu.ident, f"xid/{xid}", finding, via)
        # The same XID from NVML and from the kernel log lands on the same key: one notice.
        self._held.add(obs, time.monotonic(), self.config.xid_hold_s)
