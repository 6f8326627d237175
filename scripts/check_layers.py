"""Check that no import in agent/ goes up the layer order (docs/internals.md, "Layout"): each module may
import modules of its own layer and of the layers below it, never above. Imports inside functions and under
``TYPE_CHECKING`` count too: they hide an upward dependency from Python, not from a reader.

Run from anywhere: ``python3 scripts/check_layers.py [ROOT]`` (ROOT defaults to this checkout). Prints one
line per upward import (file, line, what imports what, and the two layers) and per import that ``APART``
forbids within the order (the RAM tier never imports the client), and exits 1 if there is any, or if a module
under agent/ belongs to no layer; exits 0 otherwise. Standard library only (CI runs it next to ruff and mypy). Cycles within a layer are not its business: shared import-cycle checks find those.
"""

from __future__ import annotations

import ast
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


def imported(module: str, path: Path, known: dict[str, Path]) -> list[tuple[int, str]]:
    """(line, module) for every agent module that ``module`` imports, wherever the import statement is."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
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


def main(argv: list[str]) -> int:
    root = Path(argv[1]).resolve() if len(argv) > 1 else Path(__file__).resolve().parent.parent
    problems = check(root)
    for problem in problems:
        print(problem)
    if not problems:
        print(
            f"layers: {len(modules(root))} modules, no import goes up ({' < '.join(name for name, _ in LAYERS)}), "
            + ", ".join(f"{importer} imports no {banned}" for importer, banned, _ in APART)
        )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
