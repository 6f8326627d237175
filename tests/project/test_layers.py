"""The folders are the layers: scripts/check_layers.py passes on this tree, and names an import that goes
up the layer order, a module that belongs to no layer, an import the design forbids and a function past the
gate. Each failing case runs the check on a few of this tree's modules copied out (the whole tree is checked
once, by the first test), with the fault added."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from tests.support import REPO

CHECK = REPO / "scripts" / "check_layers.py"


def run_check(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(CHECK), str(root)], check=False, capture_output=True, text=True, timeout=60
    )


def part_of_the_tree(root: Path, *modules: str) -> None:
    """Copy agent/'s ``modules`` (paths under agent/) into ``root``, with the ``__init__.py`` of every package
    above each."""
    for module in modules:
        source = REPO / "agent" / module
        for package in [source.parent, *source.parent.parents]:
            if package == REPO:
                break
            target = root / package.relative_to(REPO) / "__init__.py"
            if not target.exists():
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(package / "__init__.py", target)
        shutil.copyfile(source, root / "agent" / module)


def test_no_import_in_the_agent_goes_up_the_layers() -> None:
    """The checked-in tree passes the layering check."""
    result = run_check(REPO)
    assert (0, "") == (result.returncode, result.stderr), result.stdout


def test_an_upward_import_is_named_with_file_line_and_layers(tmp_path: Path) -> None:
    """A core module that imports the service fails the check, which says where and which layers."""
    part_of_the_tree(tmp_path, "core/board.py", "service/daemon.py")
    board = tmp_path / "agent" / "core" / "board.py"
    board.write_text(
        board.read_text() + "\n\ndef _late() -> None:\n    from agent.service import daemon  # noqa\n"
    )
    line = len(board.read_text().splitlines())
    result = run_check(tmp_path)
    expected = (
        f"agent/core/board.py:{line}: agent.core.board (core) imports agent.service.daemon (service), "
        "a layer above it"
    )
    assert (1, [expected]) == (result.returncode, [out.split(";")[0] for out in result.stdout.splitlines()])


def test_a_module_outside_every_layer_is_named(tmp_path: Path) -> None:
    """A new top-level module under agent/ fails the check until it is placed in a layer."""
    part_of_the_tree(tmp_path, "core/board.py")
    (tmp_path / "agent" / "stray.py").write_text('"""Placed nowhere."""\n')
    result = run_check(tmp_path)
    assert 1 == result.returncode
    assert ["agent/stray.py: agent.stray belongs to no layer"] == [
        out.split(";")[0] for out in result.stdout.splitlines()
    ]


def test_the_ram_tier_importing_the_client_is_named(tmp_path: Path) -> None:
    """The RAM tier may import the layer below it, but never the training-side library: an import of
    agent.client from agent/ramtier fails the check, which says where and what to import instead."""
    part_of_the_tree(tmp_path, "ramtier/tierfs.py", "client/transport.py")
    tierfs = tmp_path / "agent" / "ramtier" / "tierfs.py"
    tierfs.write_text(tierfs.read_text() + "\n\nfrom agent.client.transport import request_json  # noqa\n")
    line = len(tierfs.read_text().splitlines())
    result = run_check(tmp_path)
    expected = (
        f"agent/ramtier/tierfs.py:{line}: agent.ramtier.tierfs imports agent.client.transport; the RAM tier never "
        "imports the training-side library: the format both share is in agent.checkpoint"
    )
    assert (1, [expected]) == (result.returncode, result.stdout.splitlines())


def test_a_function_too_long_is_named_with_file_line_and_length(tmp_path: Path) -> None:
    """A function over the gate's line bound, not in ALLOWED, fails the check, which names it, where and how long."""
    part_of_the_tree(tmp_path, "core/board.py")
    board = tmp_path / "agent" / "core" / "board.py"
    line = len(board.read_text().splitlines()) + 3
    body = "".join(f"    x{n} = {n}\n" for n in range(70))
    board.write_text(board.read_text() + f"\n\ndef _sprawling() -> None:\n{body}")
    result = run_check(tmp_path)
    expected = f"agent/core/board.py:{line}: function _sprawling is 71 lines (max 60)"
    assert (1, [expected]) == (result.returncode, [out.split(";")[0] for out in result.stdout.splitlines()])
