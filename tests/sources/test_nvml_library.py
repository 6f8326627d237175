"""How the monitor finds libnvidia-ml: the system's library (here: the fake on LD_LIBRARY_PATH, set before
Python starts, as pynvml needs), or ``gpu.library_path``; switching between them drops pynvml's cache of
function pointers."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from agent.sources.nvml_driver import load_library
from tests.fake_nvml.build import Scenario, fake_nvml_lib, scenario

__all__ = ["fake_nvml_lib", "scenario"]  # fixtures

REPO = Path(__file__).resolve().parents[2]

PROGRAM = textwrap.dedent(
    """
    import asyncio, contextlib, json
    from agent.config import GpuConfig
    from agent.sources.nvml import NvmlSource
    from tests.fake_nvml.recording import RecordingSink

    async def main():
        source = NvmlSource(GpuConfig(library_path=None, poll_interval_s=0.05, kmsg=False))
        sink = RecordingSink("nvml")
        task = asyncio.create_task(source.run(sink))
        await sink.wait_for(lambda: sink.health != "starting", timeout=20)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        print(json.dumps({"health": sink.health, "driver": source.status()["driver_version"]}))

    asyncio.run(main())
    """
)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_the_system_library_is_found_on_ld_library_path(fake_nvml_lib: Path, scenario: Scenario) -> None:
    env = {**os.environ, "LD_LIBRARY_PATH": str(fake_nvml_lib.parent), "PYTHONWARNINGS": "error"}
    result = subprocess.run(
        [sys.executable, "-c", PROGRAM],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=50,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == '{"health": "ok", "driver": "999.99.99-fake"}'


def test_switching_libraries_drops_pynvmls_function_pointer_cache(fake_nvml_lib: Path) -> None:
    import pynvml

    load_library(fake_nvml_lib)
    pynvml._nvmlGetFunctionPointer_cache["marker"] = object()
    load_library(fake_nvml_lib)  # the same library: the cache stays
    kept = "marker" in pynvml._nvmlGetFunctionPointer_cache
    load_library(None)
    assert (kept, "marker" in pynvml._nvmlGetFunctionPointer_cache, pynvml.nvmlLib) == (True, False, None)
