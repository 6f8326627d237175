"""``preemptd demo`` end to end with a short lead time: the agent, the simulated EC2 metadata service and the
example training job on the CPU (the PyTorch one, or the standard-library one where torch cannot be imported);
the job flushes, exits 75, is restarted and resumes at the next step. A job that fails stops the demo at once,
saying which step it missed, with the tail of the job's stderr."""

from __future__ import annotations

import asyncio
import os
import re
import sys
import textwrap
from pathlib import Path

import pytest

from agent.cli.demo import (
    FIRST_LINE_NO_JOB,
    STDLIB_JOB,
    TORCH_JOB,
    WIDTH,
    DemoJob,
    JobChoice,
    Screen,
    choose_job,
    describe_job,
)
from tests.lazy import needs_torch
from tests.no_torch import no_torch_env
from tests.support import REPO, cli

# A training job that speaks the example's progress lines (its options accepted and ignored).
JOB_HEAD = """
import argparse, json, sys, time
from pathlib import Path
parser = argparse.ArgumentParser()
parser.add_argument("--checkpoint-dir", type=Path)
args, _ = parser.parse_known_args()
def emit(event, **fields):
    print(json.dumps({"event": event, **fields}), flush=True)
"""


async def demo(
    *args: str, base: Path, pythonpath: Path | None = None, env: dict[str, str] | None = None
) -> tuple[int, str, str]:
    """``preemptd demo`` with a short notice on a socket under ``base`` (later ``args`` override it);
    ``pythonpath`` first on the path of the demo and its job, or the whole ``env``. Returns the exit status,
    stdout and stderr."""
    if env is None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PREEMPTD_")}
        env["PYTHONPATH"] = os.pathsep.join(str(p) for p in (pythonpath, REPO) if p is not None)
    proc = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "agent", "demo", "--after", "0.5s", "--lead", "3s"),
        *("--socket", str(base / "demo.sock"), *args),
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 200)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


def flat(text: str) -> str:
    """Sentences wrapped at 80 columns, read as one line."""
    return " ".join(text.split())


def job_script(path: Path, body: str) -> Path:
    path.write_text(JOB_HEAD + textwrap.dedent(body))
    return path


@needs_torch
@pytest.mark.slow
@pytest.mark.timeout(240)
async def test_demo_flushes_the_job_and_resumes_it(base: Path) -> None:
    """With PyTorch installed the demo runs the PyTorch example, and says so on its first line."""
    code, out, err = await cli(
        "demo", "--after", "1s", "--lead", "12s", "--socket", str(base / "demo.sock"), timeout=230
    )
    assert 0 == code, err
    lines = out.splitlines()
    text = flat(out)
    flushed = re.search(r"job flushed step (\d+): [\d.]+ k?B in \d+ ms, [\d.]+s to spare", text)
    resumed = re.search(r"job resumed from the emergency checkpoint: step (\d+) is next", text)
    assert flushed is not None and resumed is not None, out
    assert (flushed.group(1), True, True, True) == (
        resumed.group(1),
        "job exited 75 (preempted): restarting it" in text,
        "READY every job saved its checkpoint (1 of 1)" in text,
        "CLEARED termination from aws" in text,
    ), out
    assert [] == [line for line in lines if len(line) > WIDTH]
    assert "{" not in out  # sentences, not JSON
    assert text.startswith(f"0.0s demo {TORCH_JOB.first_line}"), out


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_without_torch_the_demo_runs_the_standard_library_job_through_flush_and_resume(
    base: Path, tmp_path: Path
) -> None:
    """Where ``import torch`` fails (a venv with the base package only), the demo says on its first line that
    it runs the pure-Python linear regression, which flushes an emergency checkpoint through the client's store
    on the notice, exits 75, is restarted and resumes at the step it flushed; exit status 0."""
    env = no_torch_env(tmp_path / "no-torch")
    code, out, err = await demo("--lead", "8s", base=base, env=env)
    text = flat(out)
    flushed = re.search(r"job flushed step (\d+): \d+ B in \d+ ms, [\d.]+s to spare", text)
    resumed = re.search(r"job resumed from the emergency checkpoint: step (\d+) is next", text)
    assert (0, True, True, True) == (
        code,
        text.startswith(f"0.0s demo {STDLIB_JOB.first_line}"),
        "job starting stdlib_training.py" in text,
        "job exited 75 (preempted): restarting it" in text,
    ), (out, err)
    assert flushed is not None and resumed is not None, out
    assert (flushed.group(1), True, True) == (
        resumed.group(1),
        "READY every job saved its checkpoint (1 of 1)" in text,
        "CLEARED termination from aws" in text,
    ), out
    assert [] == [line for line in (out + err).splitlines() if len(line) > WIDTH]


@needs_torch
@pytest.mark.slow
@pytest.mark.timeout(240)
async def test_a_job_without_numpy_stops_the_demo_at_its_flush_with_its_traceback(
    base: Path, tmp_path: Path
) -> None:
    """The example job where numpy cannot be imported (a fresh venv before the torch extra brought it) fails
    in its emergency checkpoint: the demo stops there with "did not flush", the exit status and the job's
    traceback, exit status 1, instead of waiting for a job that will not come back."""
    (tmp_path / "sitecustomize.py").write_text('import sys\nsys.modules["numpy"] = None  # no numpy\n')
    code, out, err = await demo(base=base, pythonpath=tmp_path)
    text = flat(err)
    assert (1, True, True, True) == (
        code,
        "the training job did not flush: it exited with status 1 with no emergency checkpoint" in text,
        "RuntimeError: Numpy is not available" in text,
        "restarting" not in out,
    ), (out, err)
    assert [] == [line for line in (out + err).splitlines() if len(line) > WIDTH]


@pytest.mark.slow
async def test_without_a_training_job_the_demo_shows_the_notice_alone(base: Path, tmp_path: Path) -> None:
    """No job to run (here a missing script: the examples are in a source checkout, not in the wheel): the
    first line says so, the notice and its clearing are shown, exit status 0."""
    code, out, err = await demo("--job", str(tmp_path / "missing.py"), base=base)
    text = flat(out)
    assert (0, True, True, True, True) == (
        code,
        text.startswith(f"0.0s demo {FIRST_LINE_NO_JOB}"),
        "job no training job: the training script is not here" in text,
        "NOTICE termination from aws" in text,
        "CLEARED termination from aws" in text,
    ), (out, err)


async def test_a_job_that_fails_at_start_stops_the_demo_with_its_stderr(base: Path, tmp_path: Path) -> None:
    """A job that exits 3 before connecting to the agent: "did not start", its exit status and its stderr's
    last lines, before any notice is sent."""
    script = job_script(
        tmp_path / "broken.py",
        """
        sys.stderr.write("Traceback (most recent call last):\\nImportError: libcudart.so.12: no such file\\n")
        sys.exit(3)
        """,
    )
    code, out, err = await demo("--job", str(script), base=base)
    assert (1, True, True, False) == (
        code,
        "the training job did not start: it exited with status 3 before it connected to the agent"
        in flat(err),
        "  ImportError: libcudart.so.12: no such file" in err.splitlines(),
        "cloud" in out,
    ), (out, err)


@pytest.mark.slow
async def test_a_job_that_ignores_the_notice_stops_the_demo_as_not_flushed(
    base: Path, tmp_path: Path
) -> None:
    """A job that connects and then never saves: "did not flush" once the deadline (and a short grace) has
    passed, and it is not restarted."""
    script = job_script(
        tmp_path / "deaf.py",
        """
        emit("fresh", rank=0)
        emit("agent_connected", rank=0, step=1)
        time.sleep(3600)
        """,
    )
    code, out, err = await demo("--job", str(script), base=base)
    assert (1, True, True, False) == (
        code,
        "the training job did not flush: no emergency checkpoint by the notice's deadline" in flat(err),
        "It wrote nothing to stderr." in err,
        "restarting" in out,
    ), (out, err)


@pytest.mark.slow
async def test_a_job_that_cannot_load_its_checkpoint_stops_the_demo_as_not_resumed(
    base: Path, tmp_path: Path
) -> None:
    """A job that flushes and exits 75, but whose restart fails: "did not resume", the restarted job's exit
    status and its stderr."""
    script = job_script(
        tmp_path / "no-resume.py",
        """
        marker = args.checkpoint_dir / "saved"
        if marker.exists():
            sys.stderr.write("checkpoint step-7 is corrupt\\n")
            sys.exit(2)
        emit("fresh", rank=0)
        emit("agent_connected", rank=0, step=1)
        args.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        marker.touch()
        emit("checkpoint", rank=0, step=7, emergency=True, seconds=0.01, bytes=100, time_left=2.0)
        sys.exit(75)
        """,
    )
    code, out, err = await demo("--job", str(script), base=base)
    assert (1, True, True, True) == (
        code,
        "job exited 75 (preempted): restarting it" in flat(out),
        "the training job did not resume: the restarted job exited with status 2" in flat(err),
        "  checkpoint step-7 is corrupt" in err.splitlines(),
    ), (out, err)


async def test_a_silent_job_gets_a_line_saying_what_the_demo_waits_for(base: Path, tmp_path: Path) -> None:
    """While the job prints nothing, the demo says what it is waiting for, every ``every`` seconds, and
    gives up at the timeout (the job is still running: its exit is no milestone)."""
    lines: list[str] = []
    script = job_script(tmp_path / "silent.py", "time.sleep(3600)\n")
    job = DemoJob(script, base / "none.sock", tmp_path / "ckpt", Screen(lines.append))
    await job.start()
    try:
        came = await job.until(job.connected, 0.3, lambda: "still importing PyTorch", every=0.1)
    finally:
        await job.stop()
    assert (False, True) == (came, all("job     still importing PyTorch (" in line for line in lines))
    assert lines


@pytest.mark.parametrize(
    ("script", "has_torch", "expected"),
    [(None, True, TORCH_JOB), (None, False, STDLIB_JOB)],
)
def test_the_demo_runs_the_pytorch_example_only_where_torch_is_installed(
    script: Path | None, has_torch: bool, expected: JobChoice
) -> None:
    assert expected == choose_job(script, has_torch=has_torch)


def test_a_job_script_named_with_job_runs_whether_or_not_torch_is_installed(tmp_path: Path) -> None:
    script = job_script(tmp_path / "mine.py", "")
    chosen = [choose_job(script, has_torch=has_torch) for has_torch in (True, False)]
    assert [script, script] == [c.script if isinstance(c, JobChoice) else c for c in chosen]


@pytest.mark.parametrize(
    ("doc", "text"),
    [
        (
            {
                "event": "checkpoint",
                "emergency": True,
                "step": 39,
                "bytes": 12345,
                "seconds": 0.031,
                "time_left": 7.8,
            },
            "flushed step 39: 12.3 kB in 31 ms, 7.8s to spare",
        ),
        (
            {"event": "resumed", "step": 39, "next_step": 39},
            "resumed from the emergency checkpoint: step 39 is next",
        ),
        ({"event": "done"}, None),
    ],
)
def test_job_lines_read_as_sentences(doc: dict[str, object], text: str | None) -> None:
    assert text == describe_job(doc)
