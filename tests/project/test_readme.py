"""The README's training example (run as a user would: under ``preemptd exec``, next to an agent, with a
drill) and the project metadata, as a new user meets them."""

from __future__ import annotations

import ast
import asyncio
import contextlib
import json
import os
import re
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from agent.client import EXIT_PREEMPTED, CheckpointStore
from tests.support import http_json, running_agent

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[2]
# The line README.md puts right before the example's fenced block: the example is found by it, wherever the
# block moves in the section and whatever other Python blocks the README gains.
EXAMPLE_MARKER = "<!-- tests/project/test_readme.py runs this block as train.py"


def readme_example() -> str:
    """The Python block after EXAMPLE_MARKER in README.md (AssertionError saying what is missing)."""
    text = (REPO / "README.md").read_text()
    assert 1 == text.count(EXAMPLE_MARKER), f"README.md: expected one line starting {EXAMPLE_MARKER!r}"
    after = text[text.index(EXAMPLE_MARKER) :].split("\n", 1)[1]
    found = re.match(r"```python\n(.*?)^```", after, re.S | re.M)
    assert found is not None, f"README.md: no ```python block right after {EXAMPLE_MARKER!r}"
    return found.group(1)


def test_the_readme_example_is_one_script_of_the_standard_library_and_agent_client() -> None:
    """It runs with what its section says to install (the package, no extra): it imports nothing else, so
    it needs no torch."""
    module = ast.parse(readme_example())
    imported = {
        name.split(".")[0]
        for node in ast.walk(module)
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for name in ([a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""])
    }
    assert set() == imported - set(sys.stdlib_module_names) - {"agent"}


def _env(sock: Path) -> dict[str, str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("PREEMPTD_")}
    # PYTHONPATH: this checkout, as `pip install -e .` would give it
    return {**environ, "PYTHONPATH": str(REPO), "PREEMPTD_SOCKET": str(sock)}


@contextlib.asynccontextmanager
async def _train(
    script: Path, ckpt: Path, steps: int, sock: Path
) -> AsyncIterator[asyncio.subprocess.Process]:
    """``preemptd exec -- python3 train.py CKPT STEPS``, as the README says to run it; killed if it is still
    running at the end (a SIGKILLed exec takes the example along)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "agent", "exec", "--", sys.executable, str(script), str(ckpt), str(steps),
        env=_env(sock), cwd=str(script.parent),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        yield proc
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def _until_watching(sock: Path, proc: asyncio.subprocess.Process, timeout: float = 30.0) -> None:
    """Until the example's watcher holds the agent's event stream (a subscriber in its status)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while loop.time() < end:
        assert proc.returncode is None, "the example ended before its watcher connected"
        status, doc = await http_json(sock, "GET", "/v1/status")
        if status == 200 and doc["subscribers"]["connected"] >= 1:
            return
        await asyncio.sleep(0.02)
    raise TimeoutError(f"the example's watcher did not connect within {timeout}s")


async def _finish(proc: asyncio.subprocess.Process, timeout: float = 60.0) -> tuple[int, str, str]:
    out, err = await asyncio.wait_for(proc.communicate(), timeout)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_the_readme_example_flushes_on_a_drill_exits_75_and_resumes_at_the_next_step(
    base: Path,
) -> None:
    """The README's example as train.py, under ``preemptd exec`` next to a real agent: a drill makes it save
    an emergency checkpoint for that notice (its CRCs written: ``store.close()`` before the exit) and exit 75;
    run again, it resumes at the step it saved and trains to the end (the drill, still active, is handled)."""
    script, ckpt, sock = base / "train.py", base / "ckpt", base / "a.sock"
    script.write_text(readme_example())
    async with running_agent(base):
        async with _train(script, ckpt, 100_000, sock) as first:
            await _until_watching(sock, first)
            status, drill = await http_json(sock, "POST", "/v1/drills", {"kind": "termination", "in_s": 30})
            assert 201 == status, drill
            code, out, err = await _finish(first)
        saved = re.fullmatch(r"saved step (\d+) for the notice; exiting 75\n", out)
        assert (EXIT_PREEMPTED, True) == (code, saved is not None), (out, err[-3000:])
        assert saved is not None
        step = int(saved.group(1))
        manifest = json.loads((ckpt / f"step-{step:012d}" / "manifest.json").read_text())
        assert (True, drill["notice"]["id"], "crc32") == (
            manifest["emergency"],
            manifest["notice_id"],
            manifest["checksum"],
        ), manifest
        async with _train(script, ckpt, step + 3, sock) as second:
            code, out, err = await _finish(second)
    latest = CheckpointStore(ckpt, report=False).latest()
    assert (0, f"resumed at step {step}\n", step) == (code, out, latest and latest.step), err[-3000:]


def test_readme_says_how_a_training_image_gets_the_client() -> None:
    text = (REPO / "README.md").read_text()
    assert ("pip wheel" in text, "[torch]" in text, "torchrun --nproc-per-node" in text) == (True, True, True)


def test_pyproject_license_is_an_spdx_expression() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert "Apache-2.0" == project["license"]


def _readme_command(heading: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(REPO / ".ci" / "readme_command.py"), heading],
        capture_output=True,
        text=True,
        check=False,
        timeout=30,
    )


def test_ci_takes_the_try_it_line_from_the_readme() -> None:
    """The command CI runs in a clean venv (.ci/try-it) is the README's "Try it" line: a new venv, the base
    package alone (no extra, no other index: it takes seconds wherever PyPI is reachable), then the demo."""
    done = _readme_command("Try it")
    line = done.stdout.strip()
    assert (0, True, False, False) == (
        done.returncode,
        line.startswith("python3 -m venv .venv && .venv/bin/pip install -e . && .venv/bin/preemptd demo"),
        "[torch]" in line,
        "index-url" in line,
    ), done


def test_readme_command_names_a_missing_section() -> None:
    """A heading the README does not have: exit status 1 and a message naming the file and the heading."""
    done = _readme_command("Try it on Windows")
    assert (1, f"{REPO / 'README.md'}: no '## Try it on Windows' section") == (
        done.returncode,
        done.stderr.strip(),
    )
