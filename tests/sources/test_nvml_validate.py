"""scripts/gpu-validate.py (meant for a host with real GPUs) runs end to end against the fake driver."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fake_nvml.build import Scenario, fake_nvml_lib, scenario

__all__ = ["fake_nvml_lib", "scenario"]  # fixtures

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_validation_script_records_every_check_and_the_monitor_run(
    fake_nvml_lib: Path, scenario: Scenario, tmp_path: Path
) -> None:
    scenario.update({"device_count": 2, "gpu.1.not_supported": "nvmlDeviceGetRemappedRows"})
    out = tmp_path / "gpu-validation.md"
    result = subprocess.run(
        [
            sys.executable,
            "scripts/gpu-validate.py",
            "--library",
            str(fake_nvml_lib),
            "--out",
            str(out),
            "--seconds",
            "1",
        ],
        cwd=REPO,
        env={**os.environ, "PYTHONWARNINGS": "error"},
        capture_output=True,
        text=True,
        timeout=50,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    text = out.read_text()
    assert "- driver version: `999.99.99-fake`" in text
    assert "| remapped_rows | error | `Not Supported (3)` |" in text
    assert "| temperature | ok | `(40, 87, 92)` |" in text
    assert "No notice was raised and no error reported." in text
