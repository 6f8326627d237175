"""The one registry shape (agent/core/plugins.py): built-ins in their stated order, then entry points, then
registrations; the first of a name kept; a broken plug-in kept apart with its error; frozen at start; scoped
registrations for tests; and the tables its entries declare."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from agent.core.plugins import FrozenRegistryError, Part, Registry, Table
from tests.support import REPO


@dataclass(frozen=True)
class Widget:
    name: str
    rank: int = 0


# The built-ins a registry names: one module of widgets, written to a temporary directory.
WIDGETS = """
from tests.core.test_plugins import Widget

FIRST = Widget("first", rank=2)
SECOND = Widget("second", rank=1)
AGAIN = Widget("first", rank=9)
NOT_A_WIDGET = 42
"""


def accept(_name: str, loaded: object) -> Widget:
    if not isinstance(loaded, Widget):
        raise TypeError(f"a {type(loaded).__name__}, not a Widget")
    return loaded


@pytest.fixture
def module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    name = f"widgets_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(WIDGETS)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def widgets(*builtins: str, group: str | None = None, **options: object) -> Registry[Widget]:
    return Registry(
        "widget",
        builtins,
        group=group,
        accept=accept,
        name_of=lambda w: w.name,
        tables_of=lambda w: (Table(w.name, None),),
        **options,  # type: ignore[arg-type]
    )


def test_built_ins_come_in_their_stated_order_then_registrations(module: str) -> None:
    registry = widgets(f"{module}:SECOND", f"{module}:FIRST")
    registry.register(Widget("third"))
    assert ["second", "first", "third"] == list(registry.available())


def test_the_first_entry_of_a_name_is_kept_and_the_other_is_logged(module: str) -> None:
    registry = widgets(f"{module}:FIRST", f"{module}:AGAIN")
    with capture_logs() as logs:
        kept = registry.get("first")
    assert (2, ["widget_name_taken"]) == (kept.rank, [e["event"] for e in logs])


def test_an_entry_that_cannot_be_loaded_is_kept_apart_with_its_error(module: str) -> None:
    registry = widgets(f"{module}:NOT_A_WIDGET", f"{module}:FIRST", "no_such_module_here:X")
    entries = [(e.name, e.value is None, e.error.split(":")[0]) for e in registry.entries()]
    assert [
        (module, True, "TypeError"),
        ("first", False, ""),
        ("no_such_module_here", True, "ModuleNotFoundError"),
    ] == entries
    assert ["first"] == list(registry.available())


def test_order_sorts_the_loaded_entries(module: str) -> None:
    registry = widgets(f"{module}:FIRST", f"{module}:SECOND", order=lambda w: w.rank)
    assert ["second", "first"] == list(registry.available())


def test_an_entry_point_comes_after_the_built_ins(module: str, tmp_path: Path) -> None:
    group = f"preemptd.test_{uuid.uuid4().hex[:8]}"
    info = tmp_path / f"widgets_dist_{uuid.uuid4().hex[:8]}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: widgets-dist\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[{group}]\nsecond = {module}:SECOND\n")
    registry = widgets(f"{module}:FIRST", group=group)
    assert [("first", "builtin"), ("second", "entry point")] == [
        (e.name, e.origin.rpartition(" ")[0]) for e in registry.entries()
    ]


def test_a_registration_after_freeze_is_refused_saying_why() -> None:
    registry = widgets()
    registry.freeze()
    with pytest.raises(
        FrozenRegistryError, match=r"^cannot register the widget 'late': the agent has started"
    ):
        registry.register(Widget("late"))


def test_a_frozen_registry_keeps_what_it_found() -> None:
    registry = widgets()
    registry.register(Widget("early"))
    registry.freeze()
    assert (True, ["early"]) == (registry.frozen, list(registry.available()))


def test_a_scoped_registration_is_undone_and_gives_back_the_one_it_shadowed() -> None:
    registry = widgets()
    registry.register(Widget("w", rank=1))
    with registry.registered(Widget("w", rank=2)), registry.registered(Widget("extra")):
        inside = [(w.name, w.rank) for w in registry.available().values()]
    assert ([("w", 2), ("extra", 0)], [("w", 1)]) == (
        inside,
        [(w.name, w.rank) for w in registry.available().values()],
    )


def test_tables_come_from_the_loaded_entries_and_a_family_keeps_a_broken_ones_name(module: str) -> None:
    registry = Registry(
        "reactor",
        (f"{module}:NOT_A_WIDGET",),
        group=None,
        accept=lambda name, loaded: (
            Part(name, loaded) if isinstance(loaded, Widget) else accept(name, loaded)
        ),
        name_of=lambda part: part.name,
        tables_of=lambda part: part.tables,
        family="actions",
    )
    registry.register(Part("slurm", None, (Table("actions.slurm", Widget),)))
    assert [Table(f"actions.{module}", None), Table("actions.slurm", Widget)] == list(registry.tables())


def test_a_table_name_is_dotted_identifiers() -> None:
    with pytest.raises(ValueError, match="a table name is dotted identifiers"):
        Table("actions.", None)


def test_the_agent_freezes_every_registry_the_configuration_is_checked_against() -> None:
    """``preemptd run`` freezes the catalog's registries (agent/service/plugins.py) before the agent starts:
    in a fresh interpreter, so this process's registries stay open."""
    probe = (
        "import json\n"
        "from agent.config.catalog import registries\n"
        "from agent.core.plugins import FrozenRegistryError\n"
        "from agent.service import plugins\n"
        "from agent.sources.clouds import CLOUDS\n"
        "plugins.freeze()\n"
        "try:\n"
        "    CLOUDS.register(CLOUDS.get('aws'))\n"
        "    refused = ''\n"
        "except FrozenRegistryError as exc:\n"
        "    refused = str(exc)\n"
        "print(json.dumps([[r.kind for r in registries() if r.frozen], refused]))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREEMPTD_")}
    env["PYTHONPATH"] = str(REPO)
    proc = subprocess.run(
        [sys.executable, "-c", probe], check=False, env=env, capture_output=True, text=True, timeout=30
    )
    frozen, refused = json.loads(proc.stdout) if proc.returncode == 0 else ([], proc.stderr)
    assert ["cloud", "reactor", "component"] == frozen
    assert refused.startswith("cannot register the cloud 'aws': the agent has started"), refused
