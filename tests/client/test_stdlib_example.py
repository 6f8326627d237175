"""``examples/stdlib_training.py``, the demo's job where PyTorch is not installed, run where ``import torch``
fails: a run stopped by a trigger saves an emergency checkpoint through the client's store and exits 75, and
the restarted run resumes at that step and ends exactly where an uninterrupted run ends."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.no_torch import no_torch_env
from tests.support import REPO

EXAMPLE = REPO / "examples" / "stdlib_training.py"
STEPS = 400

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def _args(checkpoint_dir: Path) -> list[str]:
    return [sys.executable, str(EXAMPLE), "--checkpoint-dir", str(checkpoint_dir), "--steps", str(STEPS)]


def _run(checkpoint_dir: Path, env: dict[str, str]) -> tuple[int, list[dict[str, Any]]]:
    done = subprocess.run(
        _args(checkpoint_dir), env=env, capture_output=True, text=True, check=False, timeout=100
    )
    assert "" == done.stderr
    return done.returncode, [json.loads(line) for line in done.stdout.splitlines()]


def _interrupted(checkpoint_dir: Path, env: dict[str, str]) -> tuple[int, list[dict[str, Any]]]:
    """A run given SIGUSR1 (a trigger, as a notice is) once it has saved its first periodic checkpoint."""
    with subprocess.Popen(
        [*_args(checkpoint_dir), "--interval-s", "0.05", "--step-time", "0.005"],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    ) as proc:
        assert proc.stdout is not None
        lines = []
        for line in proc.stdout:
            lines.append(json.loads(line))
            if lines[-1]["event"] == "checkpoint" and not lines[-1]["emergency"]:
                proc.send_signal(signal.SIGUSR1)
                break
        lines += [json.loads(line) for line in proc.stdout]
        return proc.wait(timeout=100), lines


def test_a_preempted_run_resumes_at_its_flushed_step_and_ends_as_an_uninterrupted_one(tmp_path: Path) -> None:
    env = no_torch_env(tmp_path / "no-torch")
    code, first = _interrupted(tmp_path / "ckpt", env)
    flushed = [line for line in first if line["event"] == "checkpoint" and line["emergency"]]
    assert (75, 1, "preempted") == (code, len(flushed), first[-1]["event"]), first
    step = flushed[0]["step"]
    manifest = json.loads((tmp_path / "ckpt" / f"step-{step:012d}" / "manifest.json").read_text())
    assert (True, ["state.json"]) == (manifest["emergency"], [f["path"] for f in manifest["files"]])

    code, second = _run(tmp_path / "ckpt", env)
    _, straight = _run(tmp_path / "straight", env)
    assert (0, "resumed", step, step, flushed[0]["digest"]) == (
        code,
        second[0]["event"],
        second[0]["step"],
        second[0]["next_step"],
        second[0]["digest"],
    ), second
    assert straight[-1] == second[-1] and "done" == second[-1]["event"]
