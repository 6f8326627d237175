"""The fast lane (``scripts/test --fast``) leaves out what it must: every test that starts an external service
or several torch processes, read from the test sources themselves (a new test that forgets its marker fails
here), and the conftest's reading of a module's markers without importing it agrees with pytest's."""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import SERVICE_FIXTURES, module_marks

TESTS = Path(__file__).resolve().parents[1]

# What, named in a test or in a module-level helper it calls, starts an external service.
SERVICE_NAMES = frozenset(
    {"SlurmCluster", "RayCluster", "FakeKube", "socket_activated", "SYSTEMD_ANALYZE", "JOURNALD", "KUBECTL"}
)

Function = ast.FunctionDef | ast.AsyncFunctionDef


def modules() -> list[Path]:
    """The test modules, this one left out (it names what it looks for)."""
    return sorted(p for p in TESTS.rglob("test_*.py") if p.name != Path(__file__).name)


def decorator_marks(fn: Function) -> set[str]:
    names = set()
    for decorator in fn.decorator_list:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        if (
            isinstance(target, ast.Attribute)
            and isinstance(target.value, ast.Attribute)
            and target.value.attr == "mark"
        ):
            names.add(target.attr)
    return names


def is_fixture(fn: Function) -> bool:
    return any("fixture" in ast.unparse(d) for d in fn.decorator_list)


def body_uses(fn: Function) -> tuple[set[str], bool]:
    """The names in a function's body (decorators and docstring left out), and whether it starts torch
    ranks: names ``torch.distributed.run`` or gives a process environment a ``WORLD_SIZE``."""
    names: set[str] = set()
    ranks = False
    body = fn.body[1:] if ast.get_docstring(fn) is not None else fn.body
    for statement in body:
        for node in ast.walk(statement):
            if isinstance(node, ast.Name):
                names.add(node.id)
            elif isinstance(node, ast.Attribute):
                names.add(node.attr)
            elif isinstance(node, ast.Constant) and node.value == "torch.distributed.run":
                ranks = True
            elif isinstance(node, ast.Dict):
                ranks |= any(isinstance(k, ast.Constant) and k.value == "WORLD_SIZE" for k in node.keys)
    return names, ranks


def needs(path: Path) -> Iterator[tuple[Function, set[str], bool, set[str]]]:
    """Per test or fixture function: the service names it reaches and whether it starts torch ranks,
    through the module-level functions it calls (transitively), and the module's fixtures it takes
    (transitively)."""
    tree = ast.parse(path.read_text(), str(path))
    functions = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    direct = {name: body_uses(fn) for name, fn in functions.items()}

    def reach(name: str) -> tuple[set[str], bool]:
        seen, todo = {name}, [name]
        services: set[str] = set()
        ranks = False
        while todo:
            names, starts_ranks = direct[todo.pop()]
            services |= names & SERVICE_NAMES
            ranks |= starts_ranks
            for callee in names & functions.keys() - seen:
                seen.add(callee)
                todo.append(callee)
        return services, ranks

    def fixtures(fn: Function) -> set[str]:
        taken, todo = set(), [fn]
        while todo:
            for arg in todo.pop().args.args:
                if arg.arg not in taken:
                    taken.add(arg.arg)
                    if arg.arg in functions and is_fixture(functions[arg.arg]):
                        todo.append(functions[arg.arg])
        return taken

    for name, fn in functions.items():
        if name.startswith("test_") or is_fixture(fn):
            services, ranks = reach(name)
            yield fn, services, ranks, fixtures(fn)


def test_every_test_that_starts_a_service_is_left_out_of_the_fast_lane() -> None:
    """A test reaching Slurm, Ray, the Kubernetes fake, kubectl or systemd is marked ``service`` (itself, by
    its module, or by taking a fixture the conftest marks); a fixture that starts one is in that list."""
    unmarked = []
    for path in modules():
        module = module_marks(path)
        for fn, services, _, fixtures in needs(path):
            if not services or (fixtures | {fn.name}) & SERVICE_FIXTURES:
                continue
            if is_fixture(fn):
                unmarked.append(f"{path.name}: fixture {fn.name} starts {sorted(services)}")
            elif "service" not in decorator_marks(fn) | module:
                unmarked.append(f"{path.name}::{fn.name} reaches {sorted(services)}")
    assert [] == unmarked


def test_every_test_that_starts_torch_ranks_is_left_out_of_the_fast_lane() -> None:
    """A test that runs torchrun or gives processes a WORLD_SIZE is marked ``torch_mp`` (or ``slow``, which
    the fast lane leaves out as well), itself or by its module."""
    unmarked = []
    for path in modules():
        module = module_marks(path)
        for fn, _, ranks, _ in needs(path):
            if ranks and not is_fixture(fn) and not (decorator_marks(fn) | module) & {"torch_mp", "slow"}:
                unmarked.append(f"{path.name}::{fn.name}")
    assert [] == unmarked


def test_module_marks_read_from_the_source_are_the_modules_own(request: pytest.FixtureRequest) -> None:
    """For every test module this session imported, the markers the fast lane reads without importing a
    module are exactly those of its ``pytestmark``."""
    modules = {item.module for item in request.session.items if isinstance(item, pytest.Function)}
    modules.add(sys.modules[__name__])
    differ = {}
    for module in modules:
        declared = getattr(module, "pytestmark", [])
        declared = declared if isinstance(declared, list) else [declared]
        runtime = {mark.name for mark in declared}
        static = module_marks(Path(module.__file__))
        if static != runtime:
            differ[module.__name__] = (static, runtime)
    assert {} == differ
