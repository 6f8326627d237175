"""The client verbs (status, watch, drill, advise) start fast: they talk to the agent with the standard
library client and import none of the agent's own dependencies. Checked by module, not by time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from agent.cli import build_parser, main
from agent.cli.help import verb_parser
from tests.support import REPO

# What the daemon needs and a client verb must not load (each costs tens to hundreds of milliseconds).
DAEMON_ONLY = (
    "aiohttp",
    "structlog",
    "prometheus_client",
    "msgspec",
    "psutil",
    "pynvml",
    "multidict",
    "yarl",
)

# Run the verb through preemptd's main() in a fresh interpreter, then list the top-level modules it loaded.
PROBE = (
    "import json, sys\n"
    "from agent.cli import main\n"
    "code = main(sys.argv[1:])\n"
    "print(json.dumps([code, sorted({m.split('.')[0] for m in sys.modules})]))\n"
)


def loaded_by(argv: list[str], socket: Path) -> tuple[int, set[str]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREEMPTD_")}
    env.update(PYTHONPATH=str(REPO), PREEMPTD_SOCKET=str(socket))
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, *argv], env=env, capture_output=True, text=True, timeout=30, check=True
    )
    code, modules = json.loads(proc.stdout.splitlines()[-1])
    return code, set(modules)


@pytest.mark.parametrize(
    ("argv", "expected_code"),
    [
        (["status"], 69),
        (["watch"], 69),
        (["drill", "--in", "1m"], 69),
        (["advise"], 69),
        (["advise", "--save-time", "4m", "--mtbp", "6h", "--current", "30m"], 0),
    ],
    ids=["status", "watch", "drill", "advise-live", "advise-offline"],
)
def test_client_verb_imports_none_of_the_daemons_dependencies(
    argv: list[str], expected_code: int, base: Path
) -> None:
    """Against a socket where no agent listens (or offline, for advise), the verb runs to its end without
    importing what only the daemon needs."""
    code, modules = loaded_by(argv, base / "nobody.sock")
    assert (expected_code, []) == (code, sorted(modules & set(DAEMON_ONLY)))


def test_the_verb_list_reads_the_same_when_the_extension_verbs_are_not_imported() -> None:
    """`preemptd --help` lists advise, simulate and exec from cli_help's summaries without importing their
    modules; the list matches what those modules register."""
    assert build_parser().format_help() == build_parser("").format_help()


def test_run_cloud_help_names_every_cloud_the_configuration_accepts() -> None:
    """`run --cloud` is checked lazily (agent.config is not imported to build the parser): its help lists
    every value of agent.config.CLOUDS."""
    from agent.config import CLOUDS

    (cloud,) = [a for a in verb_parser(build_parser(), "run")._actions if a.dest == "cloud"]
    named = set(str(cloud.help).replace(",", " ").split())
    assert [] == [name for name in CLOUDS if name not in named]


def test_run_with_an_unknown_cloud_is_a_usage_error_naming_the_choices(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["run", "--cloud", "oracle"])
    assert (
        2,
        "argument --cloud: expected one of auto, none, aws, gcp, azure, alibaba, tencent, got 'oracle'",
    ) == (
        exited.value.code,
        capsys.readouterr().err.strip().splitlines()[-1].split("error: ", 1)[1],
    )


def test_simulate_names_exactly_the_built_in_clouds_that_have_a_simulator() -> None:
    """The simulate verb names its clouds without importing the simulators (aiohttp): its help lists the
    built-in simulators (a plug-in's is accepted too, checked when the verb runs)."""
    from agent.simulate import SIMULATORS
    from agent.simulate.cli import BUILTIN_HELP

    assert list(SIMULATORS.available()) == BUILTIN_HELP.split(", ")
