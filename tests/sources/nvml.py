"""The NVML source's tests' shared parts: the fake library's GPUs, a fast-polling configuration, and a wait
for the monitor's next polls."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from agent.config import GpuConfig
from agent.sources.nvml import NvmlSource
from tests.fake_nvml.recording import RecordingSink

GPU0 = "GPU-fa4e0000-0000-4000-8000-000000000000"


GPU1 = "GPU-fa4e0000-0000-4000-8000-000000000001"


def gpu_config(library: Path | None, **overrides: Any) -> GpuConfig:
    base = GpuConfig(
        library_path=library,
        poll_interval_s=0.05,
        call_timeout_s=1.0,
        event_wait_ms=50,
        raise_after=2,
        clear_after=2,
        unknown_after=3,
        xid_hold_s=0.6,
        kmsg=False,
    )
    return dataclasses.replace(base, **overrides)


async def wait_polled(source: NvmlSource, sink: RecordingSink, rounds: int = 1) -> None:
    """Wait until the monitor has published ``rounds`` more times after every GPU's checks were read."""
    await sink.wait_for(
        lambda: (
            bool(source.status()["gpus"])
            and all(state != "pending" for g in source.status()["gpus"] for state in g["checks"].values())
        ),
        what="the first full poll",
    )
    target = sink.replaces + rounds
    await sink.wait_for(lambda: sink.replaces >= target, what=f"{rounds} more polls")
