"""Check that no import in agent/ goes up the layer order (docs/internals.md, "Layout"): each module may
import modules of its own layer and of the layers below it, never above. Imports inside functions and under
``TYPE_CHECKING`` count too: they hide an upward dependency from Python, not from a reader.

Run from anywhere: ``python3 scripts/check_layers.py [ROOT]`` (ROOT defaults to this checkout). Prints one
line per upward import (file, line, what imports what, and the two layers) and per import that ``APART``
forbids within the order (the RAM tier never imports the client), and exits 1 if there is any, or if a module
under agent/ belongs to no layer; exits 0 otherwise. Standard library only (CI runs it next to ruff and mypy). Cycles within a layer are not its business: shared import-cycle checks find those.

It also gates the size of each function and method in agent/: at most ``MAX_LINES`` lines from its ``def`` to
its last line, and at most ``MAX_BRANCHES`` branches (see ``branches``), but for the exceptions ``ALLOWED``
lists, each with its reason. Split a function that grows past them into well-named helpers.
"""

from __future__ import annotations

import ast
import functools
import gc
import sys
from pathlib import Path

# Bottom first. A module belongs to the layer of the longest prefix that names it.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("core", ("agent.core",)),
    ("checkpoint", ("agent.checkpoint",)),
    ("config, client, simulate", ("agent.config", "agent.client", "agent.simulate")),
    (
        "sources, actions, bridges, advisor",
        (
            "agent.sources",
            "agent.actions",
            "agent.bridges",
            "agent.advisor",
            "agent.ledger",
            "agent.ramtier",
            "agent.window",
        ),
    ),
    ("service", ("agent.service",)),
    ("cli", ("agent.cli",)),
    ("package face", ("agent", "agent.__main__")),
)

# Imports the layer order allows but the design does not: (importer's package, imported package, why).
APART: tuple[tuple[str, str, str], ...] = (
    (
        "agent.ramtier",
        "agent.client",
        "the RAM tier never imports the training-side library: the format both share is in agent.checkpoint",
    ),
)

# The function gate: a function longer than this, or with more branches, is split into helpers.
MAX_LINES = 60
MAX_BRANCHES = 20

# Functions past a bound that the gate lets be, by "path:qualified name", each with why; shrink it, never grow it.
ALLOWED: dict[str, str] = {}


def layer_of(module: str) -> int | None:
    """The index of the layer ``module`` belongs to, or None when no layer names it."""
    best: tuple[int, int] | None = None  # (prefix length, layer)
    for rank, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if module == prefix or module.startswith(prefix + "."):
                # "agent" names only the package itself: every other module has a more specific layer.
                if prefix == "agent" and module != "agent":
                    continue
                if best is None or len(prefix) > best[0]:
                    best = (len(prefix), rank)
    return None if best is None else best[1]


def modules(root: Path) -> dict[str, Path]:
    """Every module under ROOT/agent, by dotted name."""
    found: dict[str, Path] = {}
    for path in sorted((root / "agent").rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


@functools.cache
def parsed(path: Path) -> ast.Module:
    """The module at ``path``, parsed once for both checks."""
    return ast.parse(path.read_text(), str(path))


def imported(module: str, path: Path, known: dict[str, Path]) -> list[tuple[int, str]]:
    """(line, module) for every agent module that ``module`` imports, wherever the import statement is."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: list[tuple[int, str]] = []
    for node in ast.walk(parsed(path)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                # "from agent.core import sse" imports the module agent.core.sse, not just the package.
                full = f"{target}.{alias.name}"
                out.append((node.lineno, full if full in known else target))
    return [(line, name) for line, name in out if name == "agent" or name.startswith("agent.")]


def within(module: str, package: str) -> bool:
    """Whether ``module`` is ``package`` or one of its modules."""
    return module == package or module.startswith(package + ".")


def check(root: Path) -> list[str]:
    """The problems found under ROOT, one sentence each; empty when the layering holds."""
    known = modules(root)
    problems: list[str] = []
    for module, path in known.items():
        rank = layer_of(module)
        where = path.relative_to(root)
        if rank is None:
            problems.append(
                f"{where}: {module} belongs to no layer; add its package to LAYERS in {Path(__file__).name}"
            )
            continue
        for line, target in imported(module, path, known):
            # The package itself (``__version__``) is loaded before any module in it: importing it adds nothing.
            target_rank = None if target == "agent" else layer_of(target)
            if target_rank is not None and target_rank > rank:
                problems.append(
                    f"{where}:{line}: {module} ({LAYERS[rank][0]}) imports {target} ({LAYERS[target_rank][0]}), "
                    "a layer above it; move the shared part down or invert the dependency (a port in agent.core.ports)"
                )
            for importer, banned, why in APART:
                if within(module, importer) and within(target, banned):
                    problems.append(f"{where}:{line}: {module} imports {target}; {why}")
    return problems


_BRANCHES = (
    ast.If,
    ast.IfExp,
    ast.For,
    ast.AsyncFor,
    ast.While,
    ast.ExceptHandler,
    ast.With,
    ast.AsyncWith,
    ast.match_case,
)


def branches(function: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """The places ``function``'s own body chooses a path (its nested functions and classes count on their own):
    each ``if``/``elif``, conditional expression, loop, ``except`` handler, ``with``, ``match`` case, extra
    operand of ``and``/``or``, and ``if`` of a comprehension."""
    count = 0
    todo = list(ast.iter_child_nodes(function))
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        if isinstance(node, _BRANCHES):
            count += 1
        elif isinstance(node, ast.BoolOp):
            count += len(node.values) - 1
        elif isinstance(node, ast.comprehension):
            count += len(node.ifs)
        todo.extend(ast.iter_child_nodes(node))
    return count


def functions(path: Path) -> list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """(qualified name, node) for every function and method in the module at ``path``, nested ones too."""
    found: list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]] = []
    todo: list[tuple[str, ast.AST]] = [("", parsed(path))]
    while todo:
        prefix, parent = todo.pop()
        for node in ast.iter_child_nodes(parent):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found.append((prefix + node.name, node))
                todo.append((f"{prefix}{node.name}.", node))
            elif isinstance(node, ast.ClassDef):
                todo.append((f"{prefix}{node.name}.", node))
            else:
                todo.append((prefix, node))
    return sorted(found, key=lambda item: item[1].lineno)


def oversized(root: Path) -> tuple[list[str], list[str]]:
    """The functions under ROOT/agent past a bound that ``ALLOWED`` does not list, one sentence each, and the
    ``ALLOWED`` entries whose function is now within the bounds (or gone)."""
    problems: list[str] = []
    needed: set[str] = set()
    for path in modules(root).values():
        where = path.relative_to(root).as_posix()
        for name, node in functions(path):
            lines = (node.end_lineno or node.lineno) - node.lineno + 1
            count = branches(node)
            found = []
            if lines > MAX_LINES:
                found.append(f"{where}:{node.lineno}: function {name} is {lines} lines (max {MAX_LINES})")
            if count > MAX_BRANCHES:
                found.append(
                    f"{where}:{node.lineno}: function {name} has {count} branches (max {MAX_BRANCHES})"
                )
            if found and f"{where}:{name}" in ALLOWED:
                needed.add(f"{where}:{name}")
                continue
            problems += [f"{problem}; split it into helpers" for problem in found]
    return problems, sorted(set(ALLOWED) - needed)


def main(argv: list[str]) -> int:
    gc.disable()  # the parsed modules are kept for both checks: the collector would walk them on each pass
    root = Path(argv[1]).resolve() if len(argv) > 1 else Path(__file__).resolve().parent.parent
    problems = check(root)
    too_big, spare = oversized(root)
    for problem in problems + too_big:
        print(problem)
    if problems or too_big:
        return 1
    print(
        f"layers: {len(modules(root))} modules, no import goes up ({' < '.join(name for name, _ in LAYERS)}), "
        + ", ".join(f"{importer} imports no {banned}" for importer, banned, _ in APART)
    )
    print(
        f"functions: none over {MAX_LINES} lines or {MAX_BRANCHES} branches but the {len(ALLOWED)} ALLOWED lists"
        + "".join(f"; {entry} is within the bounds now, remove it from ALLOWED" for entry in spare)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
