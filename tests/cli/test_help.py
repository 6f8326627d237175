"""The command line as a new user meets it: every verb's --help (description, examples, exit statuses), the
verb's own usage for a wrong flag, and `preemptd status --json | head` without a traceback."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import pytest

from agent.cli import build_parser, main
from agent.cli.help import EXIT_BROKEN_PIPE, verb_parser
from tests.support import REPO, running_agent


def verbs() -> dict[str, str]:
    """Each registered verb and its --help text, as argparse formats it."""
    parser = build_parser()
    (sub,) = [a for a in parser._actions if a.dest == "verb"]
    assert isinstance(sub.choices, dict)
    return {name: p.format_help() for name, p in sub.choices.items()}


@pytest.mark.parametrize("verb", sorted(verbs()))
def test_every_verb_help_has_a_description_examples_and_exit_statuses(verb: str) -> None:
    text = verbs()[verb]
    description = text.split("\n\n")[1]
    first_example = text.split("examples:\n", 1)[-1].splitlines()[0].strip()
    assert (True, True, True) == (
        len(description.split()) >= 5,
        first_example.startswith(f"preemptd {verb}"),
        "exit status:\n  0 " in text,
    )


def test_status_help_says_it_exits_1_on_warning_or_critical() -> None:
    text = verbs()["status"]
    assert ["0", "1", "2", "69"] == [line.split()[0] for line in text.split("exit status:\n")[1].splitlines()]
    assert "1   overall warning or critical" in text


@pytest.mark.parametrize("verb", ["status", "watch", "drill", "advise", "run"])
def test_wrong_flag_after_a_verb_shows_that_verbs_usage(
    verb: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main([verb, "--no-such-flag"])
    err = capsys.readouterr().err
    assert (2, f"usage: preemptd {verb} ", "unrecognized arguments: --no-such-flag") == (
        exited.value.code,
        err.splitlines()[0][: len(f"usage: preemptd {verb} ")],
        err.strip().splitlines()[-1].split("error: ", 1)[1],
    )


async def test_status_json_into_a_closed_pipe_exits_quietly(base: Path) -> None:
    """The reader is gone before the first byte (as `| head` is, once it has its lines): no traceback."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREEMPTD_")}
    env.update(PYTHONPATH=str(REPO), PREEMPTD_SOCKET=str(base / "a.sock"))
    try:
        async with running_agent(base, components=[]):
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "agent", "status", "--json",
                stdout=write_end, stderr=asyncio.subprocess.PIPE, env=env,
            )  # fmt: skip
            _, err = await asyncio.wait_for(proc.communicate(), 30)
    finally:
        os.close(write_end)
    assert (EXIT_BROKEN_PIPE, "") == (proc.returncode, err.decode())


def test_exec_help_outside_the_cli_has_examples_and_exit_statuses(capsys: pytest.CaptureFixture[str]) -> None:
    """`preemptd exec` parses its own arguments (it must start fast) and still answers --help like the rest."""
    with pytest.raises(SystemExit):
        main(["exec", "--help"])
    out = capsys.readouterr().out
    assert (True, True) == ("examples:\n  preemptd exec -- torchrun" in out, "\n  75  " in out)


@pytest.mark.parametrize("verb", ["", *sorted(verbs())])
def test_every_help_screen_fits_80_columns(verb: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """`preemptd --help` and every verb's --help, on an 80-column terminal: no line is longer."""
    monkeypatch.setenv("COLUMNS", "80")
    parser = build_parser()
    text = (verb_parser(parser, verb) if verb else parser).format_help()
    assert [] == [line for line in text.splitlines() if len(line) > 80]
