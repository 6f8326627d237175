#!/usr/bin/env python3
"""Validate the GPU monitor against a real NVIDIA driver and write what every check returned.

Run on a host with NVIDIA GPUs (from the repository root, with the project's virtualenv):

    .venv/bin/python scripts/gpu-validate.py --out docs/gpu-validation.md

It records the driver, NVML and pynvml versions; for each GPU its identity, every periodic check's raw
value (or the NVML error) and latency, the supported event mask and one event wait; then it runs the real
:class:`agent.sources.nvml.NvmlSource` for ``--seconds`` and records its status and any notices. Every NVML
call runs on a daemon thread under ``--call-timeout`` so a wedged GPU cannot hang the script.
``--library PATH`` runs it against another libnvidia-ml (the test fake: see tests/fake_nvml/README.md).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agent.config import GpuConfig
from agent.core.notice import Observation, utcnow
from agent.sources import nvml as nv
from agent.sources import nvml_driver as driver
from agent.sources.gpu_health import CHECKS, CLOCK_REASON_NAMES


def bounded(fn: Callable[[], Any], timeout: float) -> tuple[str, Any, float]:
    """("ok", value, ms) / ("error", text, ms) / ("hung", None, ms), run on a daemon thread."""
    box: dict[str, Any] = {}

    def work() -> None:
        try:
            box["value"] = fn()
        except Exception as exc:
            code = driver.error_code(exc)
            box["error"] = driver.error_text(code) if code is not None else repr(exc)

    started = time.monotonic()
    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    thread.join(timeout)
    ms = round((time.monotonic() - started) * 1000, 2)
    if thread.is_alive():
        return "hung", None, ms
    if "error" in box:
        return "error", box["error"], ms
    return "ok", box.get("value"), ms


def fmt(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return "(" + ", ".join(fmt(v) for v in value) + ")"
    return str(value)


def raw_checks(library: Path | None, timeout: float) -> tuple[list[str], dict[str, Any]]:
    import pynvml

    lines: list[str] = []
    facts: dict[str, Any] = {}
    watch = driver.CallWatch()
    state, startup, _ = bounded(lambda: driver.start(watch, library), timeout)
    if state != "ok":
        lines.append(f"NVML start-up: **{state}**: {startup}")
        return lines, facts
    facts["driver_version"] = startup.driver_version
    for name, call in (
        ("NVML version", pynvml.nvmlSystemGetNVMLVersion),
        ("CUDA driver version", pynvml.nvmlSystemGetCudaDriverVersion),
    ):
        state, value, _ = bounded(call, timeout)
        facts[name] = value if state == "ok" else f"{state}: {value}"
    lines += [
        f"- driver version: `{startup.driver_version}`",
        f"- NVML version: `{facts['NVML version']}`; CUDA driver version: `{facts['CUDA driver version']}`",
        f"- GPUs: {len(startup.gpus)}",
        "",
    ]
    for ident, handle in startup.gpus:
        lines += [
            f"### GPU {ident.index}: {ident.name}",
            "",
            f"UUID `{ident.uuid}`, PCI bus id `{ident.pci_bus_id}`",
            "",
            "| check | result | value / error | ms |",
            "|---|---|---|---|",
        ]
        for check in CHECKS:
            state, value, ms = bounded(lambda c=check, h=handle: driver.read_check(watch, c, h), timeout)
            if check == "clocks" and state == "ok":
                names = [n for bit, n in CLOCK_REASON_NAMES.items() if int(value) & bit]
                value = f"0x{int(value):x} {names}"
            lines.append(f"| {check} | {state} | `{fmt(value)}` | {ms} |")
        for label, threshold in (
            ("threshold gpu_max", pynvml.NVML_TEMPERATURE_THRESHOLD_GPU_MAX),
            ("threshold mem_max", pynvml.NVML_TEMPERATURE_THRESHOLD_MEM_MAX),
        ):
            state, value, ms = bounded(
                lambda h=handle, t=threshold: pynvml.nvmlDeviceGetTemperatureThreshold(h, t), timeout
            )
            lines.append(f"| {label} | {state} | `{fmt(value)}` | {ms} |")
        state, mask, ms = bounded(lambda h=handle: pynvml.nvmlDeviceGetSupportedEventTypes(h), timeout)
        shown = (
            f"0x{int(mask):x} (monitor registers 0x{int(mask) & driver.EVENT_MASK:x})"
            if state == "ok"
            else mask
        )
        lines += [f"| supported events | {state} | `{shown}` | {ms} |", ""]

    # One event wait on all GPUs: on a healthy host it times out.
    def wait_once() -> str:
        event_set = pynvml.nvmlEventSetCreate()
        try:
            for _, handle in startup.gpus:
                supported = pynvml.nvmlDeviceGetSupportedEventTypes(handle) & driver.EVENT_MASK
                if supported:
                    pynvml.nvmlDeviceRegisterEvents(handle, supported, event_set)
            try:
                data = pynvml.nvmlEventSetWait_v2(event_set, 1000)
            except pynvml.NVMLError_Timeout:
                return "timed out after 1000 ms (no event: expected on a healthy host)"
            return f"event type 0x{data.eventType:x} data {data.eventData}"
        finally:
            pynvml.nvmlEventSetFree(event_set)

    state, value, ms = bounded(wait_once, timeout + 2)
    lines += ["### Event wait", "", f"`nvmlEventSetWait_v2`: {state}: {value} ({ms} ms)", ""]
    return lines, facts


class Sink:
    def __init__(self) -> None:
        self.log: list[str] = []
        self.active: dict[str, Observation] = {}
        self.health = "starting"

    def replace(self, observations: Iterable[Observation]) -> None:
        new = {o.key: o for o in observations}
        for key in new.keys() - self.active.keys():
            self.log.append(f"notice {new[key].kind.value} `{key}`: {new[key].reason}")
        for key in self.active.keys() - new.keys():
            self.log.append(f"cleared `{key}`")
        self.active = new

    def observe(self, obs: Observation) -> None:
        self.replace([*self.active.values(), obs])

    def clear(self, key: str, reason: str | None = None) -> None:
        self.replace([o for k, o in self.active.items() if k != key])

    def ok(self, **detail: Any) -> None:
        self.health = "ok"

    def error(self, message: str, **fields: Any) -> None:
        self.health = "degraded"
        self.log.append(f"source error: {message}")

    def identify(self, cloud: str, instance: Mapping[str, Any]) -> None:
        pass

    def disable(self, why: str) -> None:
        self.health = "disabled"
        self.log.append(f"disabled: {why}")


async def run_monitor(config: GpuConfig, seconds: float) -> tuple[Sink, Mapping[str, Any], float]:
    source = nv.NvmlSource(config)
    sink = Sink()
    task = asyncio.create_task(source.run(sink))  # type: ignore[arg-type]
    await asyncio.sleep(seconds)
    started = time.monotonic()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.wait_for(task, 10)
    stop_ms = (time.monotonic() - started) * 1000
    return sink, source.status(), stop_ms


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--library", type=Path, default=None, help="libnvidia-ml to load (default: the system's)"
    )
    parser.add_argument("--out", type=Path, default=Path("docs/gpu-validation.md"))
    parser.add_argument("--seconds", type=float, default=10.0, help="how long to run the monitor")
    parser.add_argument("--call-timeout", type=float, default=10.0)
    args = parser.parse_args()

    lines = [
        "# GPU monitor validation on real hardware",
        "",
        f"Written by `scripts/gpu-validate.py` on {utcnow().isoformat(timespec='seconds')}.",
        "",
        "## Host",
        "",
        f"- host: `{platform.node()}`, kernel `{platform.release()}`, Python {platform.python_version()}",
        f"- nvidia-ml-py: `{metadata.version('nvidia-ml-py')}`, library: `{args.library or driver.DEFAULT_LIBRARY}`",
    ]
    raw, facts = raw_checks(args.library, args.call_timeout)
    lines += ["", "## What NVML returned", "", *raw]
    config = GpuConfig(library_path=args.library, poll_interval_s=1.0, call_timeout_s=args.call_timeout)
    sink, status, stop_ms = asyncio.run(run_monitor(config, args.seconds))
    lines += [
        "## The monitor",
        "",
        f"`NvmlSource` ran for {args.seconds:g} s (poll 1 s); health at the end: **{sink.health}**; "
        f"stopped in {stop_ms:.0f} ms.",
        "",
        "Notices and errors while it ran:" if sink.log else "No notice was raised and no error reported.",
        "",
        *[f"- {entry}" for entry in sink.log],
        "",
        "Status (`sources.nvml` in `/v1/status`):",
        "",
        "```json",
        json.dumps(status, indent=2, default=str),
        "```",
        "",
    ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines))
    print(f"wrote {args.out} (driver {facts.get('driver_version', 'unknown')})")
    return 0 if "driver_version" in facts else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "default")
    sys.exit(main())
