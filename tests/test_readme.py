"""The README's training snippet and the project metadata, as a new user meets them."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

REPO = Path(__file__).resolve().parent.parent


def training_snippet() -> ast.Module:
    text = (REPO / "README.md").read_text()
    (block,) = [b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "agree_latest" in b]
    return ast.parse(block)


def test_readme_snippet_defines_the_start_step_on_a_fresh_run() -> None:
    """Every name the training loop's range() reads is bound at top level before the loop, not only in the
    branch that resumes."""
    module = training_snippet()
    (loop_index,) = [i for i, node in enumerate(module.body) if isinstance(node, ast.For)]
    bound = {
        target.id
        for node in module.body[:loop_index]
        if isinstance(node, ast.Assign)
        for target in node.targets
        if isinstance(target, ast.Name)
    }
    loop = module.body[loop_index]
    assert isinstance(loop, ast.For) and isinstance(loop.iter, ast.Call)
    read = {arg.id for arg in loop.iter.args if isinstance(arg, ast.Name)}
    assert {"start"} == read & {"start"} and "start" in bound


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
