"""Every table is checked when the file is loaded: a bridge's (``[actions.slurm]``), a component's and the core
sections alike, so ``preemptd run --print-config``, start-up and a SIGHUP reload refuse a bad value with the
file, the key and what was expected, before anything binds; a table nobody declared is refused with a "did
you mean"."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import pytest
from msgspec import Meta

from agent.config import config_to_json, load_config
from agent.config.loader import read_toml
from agent.core.errors import ConfigError
from agent.core.plugins import Part, Table
from agent.service.components import COMPONENTS
from tests.support import REPO, AgentProcess, cli, http_json, hup_and_wait_ready

BAD_SLURM = '[actions.slurm]\nmargin_s = "x"\n'


def hooks(count: int) -> str:
    return "".join(f'[[actions.hooks]]\nname = "h{i}"\nargv = ["/bin/true"]\n' for i in range(count))


@dataclass(frozen=True)
class WidgetConfig:
    """A component's table, as a component outside agent/config declares it."""

    enabled: bool = False
    size: Annotated[int, Meta(ge=1)] = 4


@pytest.fixture
def widget() -> Iterator[type[WidgetConfig]]:
    with COMPONENTS.registered(Part("widget", lambda config: None, (Table("widget", WidgetConfig),))):
        yield WidgetConfig


async def test_print_config_refuses_a_bad_bridge_value_with_file_key_and_expectation(base: Path) -> None:
    """``margin_s = "x"`` under ``[actions.slurm]`` fails ``preemptd run --print-config`` with exit status 2
    (it printed the configuration and exited 0 before)."""
    path = base / "config.toml"
    path.write_text(BAD_SLURM)
    code, out, err = await cli("run", "--config", str(path), "--print-config")
    assert (
        2,
        "",
        f"preemptd: configuration error: {path}: key 'actions.slurm.margin_s': expected a number, got 'x'",
    ) == (
        code,
        out,
        err.strip(),
    )


async def test_start_up_with_a_bad_bridge_value_exits_before_the_socket_exists(base: Path) -> None:
    path = base / "config.toml"
    path.write_text("[actions.ray]\nenabled = true\ntimeout_s = 0\n")
    socket = base / "a.sock"
    code, _, err = await cli(
        "run", "--config", str(path), "--socket", str(socket), "--state-dir", str(base / "s")
    )
    assert (2, f"{path}: key 'actions.ray.timeout_s': expected a finite number of seconds >= 0.1, got 0") == (
        code,
        err.strip().removeprefix("preemptd: configuration error: "),
    )
    assert (False, False) == (socket.exists(), (base / "s").exists())


async def test_an_unknown_bridge_table_is_refused_with_did_you_mean(base: Path) -> None:
    path = base / "config.toml"
    path.write_text("[actions.slrum]\nenabled = true\n")
    code, _, err = await cli("run", "--config", str(path), "--print-config")
    assert (2, f"{path}: unknown table 'actions.slrum' (did you mean 'actions.slurm'?)") == (
        code,
        err.removeprefix("preemptd: configuration error: ").split(";")[0],
    )


async def test_reload_with_a_bad_bridge_value_keeps_the_running_configuration(base: Path) -> None:
    """SIGHUP with a file whose bridge table is bad: the error is logged (file, key, expectation), the
    agent keeps serving with the configuration it had (one hook, not two); a good file is taken next."""
    path = base / "config.toml"
    path.write_text(hooks(1))
    proc = AgentProcess(base, extra_args=["--config", str(path)], env={"PREEMPTD_GPU__ENABLED": "false"})
    await proc.start()
    try:
        path.write_text(hooks(2) + BAD_SLURM)
        await hup_and_wait_ready(proc)
        _, kept = await http_json(proc.socket_path, "GET", "/v1/status")
        path.write_text(hooks(2))
        await hup_and_wait_ready(proc)
        _, taken = await http_json(proc.socket_path, "GET", "/v1/status")
    finally:
        assert 0 == await proc.stop()
    failed = [r["error"] for r in proc.logs() if r.get("event") == "reload_failed"]
    assert ([f"{path}: key 'actions.slurm.margin_s': expected a number, got 'x'"], 1, 2) == (
        failed,
        kept["actions"]["rules"]["hooks"],
        taken["actions"]["rules"]["hooks"],
    )


def test_a_declared_component_table_is_checked_when_loading(
    tmp_path: Path, widget: type[WidgetConfig]
) -> None:
    path = tmp_path / "config.toml"
    path.write_text("[widget]\nsize = 0\n")
    with pytest.raises(ConfigError) as refused:
        load_config(path, env={})
    assert f"{path}: key 'widget.size': expected an integer >= 1, got 0" == str(refused.value)


def test_a_declared_component_table_reads_file_environment_and_flags(
    tmp_path: Path, widget: type[WidgetConfig]
) -> None:
    path = tmp_path / "config.toml"
    path.write_text("[widget]\nenabled = true\n")
    config = load_config(path, env={"PREEMPTD_WIDGET__SIZE": "9"})
    assert WidgetConfig(True, 9) == config.table("widget", WidgetConfig)
    assert WidgetConfig(True, 2) == load_config(path, env={}, overrides={"widget.size": 2}).table(
        "widget", WidgetConfig
    )


def test_print_config_shows_a_declared_table_with_its_defaults(
    tmp_path: Path, widget: type[WidgetConfig]
) -> None:
    path = tmp_path / "config.toml"
    path.write_text("")
    assert {"enabled": False, "size": 4} == config_to_json(load_config(path, env={}))["widget"]


def test_an_unknown_top_level_table_is_refused_with_did_you_mean(
    tmp_path: Path, widget: type[WidgetConfig]
) -> None:
    path = tmp_path / "config.toml"
    path.write_text("[widgte]\nsize = 2\n")
    with pytest.raises(ConfigError) as refused:
        load_config(path, env={})
    assert f"{path}: unknown table 'widgte' (did you mean 'widget'?)" == str(refused.value).split(";")[0]


# The plug-in tables this process knows depend on what it imported first (this module imports them all): the
# tests below ask a fresh interpreter, as an entry point starts.
PACKAGED = REPO / "packaging" / "config.toml"


def fresh(code: str, *argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("PREEMPTD_")}
    environ.update(PYTHONPATH=str(REPO), **(env or {}))
    return subprocess.run(
        [sys.executable, "-c", code, *argv],
        check=False,
        env=environ,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_every_table_of_the_packaged_config_is_known_to_a_bare_load() -> None:
    """load_config on packaging/config.toml in an interpreter that imported only agent.config (no plug-in,
    no registry) takes every table of the file, [ram_tier] included."""
    probe = (
        "import json, sys\n"
        "from pathlib import Path\n"
        "from agent.config import load_config\n"
        "before = sorted(m for m in sys.modules if m.startswith(('agent.ramtier', 'agent.ledger', 'agent.service')))\n"
        "config = load_config(Path(sys.argv[1]), env={})\n"
        "print(json.dumps([before, sorted(config.built)]))\n"
    )
    proc = fresh(probe, str(PACKAGED))
    before, built = json.loads(proc.stdout) if proc.returncode == 0 else (None, [])
    tables = [key for key, value in read_toml(PACKAGED).items() if isinstance(value, dict)]
    assert ([], ["ram_tier"], []) == (before, tables, [t for t in tables if t not in built]), proc.stderr


def test_the_catalog_knows_every_top_level_table_an_entry_declares() -> None:
    """Every ``Table("name", ...)`` of a top-level table in agent/ is known to a bare load through the
    registries of agent/config/catalog.py (a cloud's, a component's)."""
    declared = set()
    for path in (REPO / "agent").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (
                isinstance(node, ast.Call)
                and getattr(node.func, "id", getattr(node.func, "attr", None)) == "Table"
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)
                and "." not in node.args[0].value
            ):
                declared.add(node.args[0].value)
    probe = (
        "import json\n"
        "from agent.config.tables import known\n"
        "print(json.dumps(sorted(n for n, d in known().declared.items() if '.' not in n and not d.cloud)))\n"
    )
    proc = fresh(probe)
    assert sorted(declared) == json.loads(proc.stdout or "null"), proc.stderr


def test_report_without_an_agent_reads_the_packaged_config(base: Path) -> None:
    """`preemptd report --config packaging/config.toml` with no agent on the socket reads the ledger file
    (it exited 2, "unknown table 'ram_tier'", since only `run` had imported the RAM tier's table)."""
    from agent.ledger import store

    store.connect(base / "ledger.sqlite").close()
    proc = fresh(
        "from agent.cli import main; raise SystemExit(main())",
        *("report", "--config", str(PACKAGED), "--socket", str(base / "nobody.sock"), "--json"),
        env={"PREEMPTD_STATE_DIR": str(base)},
    )
    doc = json.loads(proc.stdout) if proc.returncode == 0 else {}
    assert (0, "file", 0) == (proc.returncode, doc.get("source"), doc.get("total", {}).get("checkpoints")), (
        proc.stderr
    )
