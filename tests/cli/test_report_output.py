"""`preemptd report --png`, `--html` and the text: what a person sees, from a real agent's ledger."""

from __future__ import annotations

import argparse
import asyncio
import io
import os
import sys
from pathlib import Path

import pytest

from agent.cli.report import register, run
from tests.support import http_json, running_agent, short_tmp


async def report_with(tmp_path: Path, *flags: str) -> tuple[int, str, str]:
    """Run the verb against a real agent holding one job's checkpoints."""
    async with running_agent(short_tmp("pd-report-")) as agent:
        for step in (1, 2):
            body = {
                "kind": "checkpoint",
                "phase": "finished",
                "step": step,
                "duration_s": 5.0,
                "bytes": 10**6,
                "client": {"job": "j7", "pid": 10, "gpus": 8},
            }
            status, _ = await http_json(agent.config.socket, "POST", "/v1/reports", body)
            assert status == 202
        parser = argparse.ArgumentParser()
        register(parser.add_subparsers())
        args = parser.parse_args(["report", "--socket", str(agent.config.socket), *flags])
        out, err = io.StringIO(), io.StringIO()
        code = await asyncio.to_thread(run, args, out, err)
    return code, out.getvalue(), err.getvalue()


async def test_png_is_a_plot_of_where_the_gpu_hours_went(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    target = tmp_path / "cost.png"
    code, _, err = await report_with(tmp_path, "--png", str(target))
    data = await asyncio.to_thread(target.read_bytes)
    assert (0, b"\x89PNG") == (code, data[:4]), err


async def test_html_is_one_page_with_the_tables_and_the_plot_inline(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    target = tmp_path / "cost.html"
    code, _, err = await report_with(tmp_path, "--html", str(target))
    page = await asyncio.to_thread(target.read_text)
    assert (0, True, True, True) == (
        code,
        "<h2>Job j7</h2>" in page,
        "src='data:image/png;base64," in page,
        "prices missing" in page,
    ), err


async def test_png_without_matplotlib_names_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    code, _, err = await report_with(tmp_path, "--png", str(tmp_path / "x.png"))
    assert (1, True) == (code, "pip install 'preemptd[plot]'" in " ".join(err.split()))  # wrapped at 80


def linked(tmp_path: Path, name: str) -> tuple[Path, Path]:
    """A link ``name`` to a file that must survive a report written to the link."""
    target = tmp_path / "precious.txt"
    target.write_text("keep me\n")
    link = tmp_path / name
    link.symlink_to(target)
    return link, target


@pytest.mark.parametrize("flag", ["--html", "--png"])
async def test_a_link_as_the_output_file_is_replaced_and_its_target_left_alone(
    tmp_path: Path, flag: str
) -> None:
    """--html / --png FILE where FILE is a symbolic link: the link becomes the report, the file it pointed
    to is not overwritten (a link planted in a shared directory must not redirect the write)."""
    pytest.importorskip("matplotlib")
    link, target = linked(tmp_path, "cost.out")
    code, _, err = await report_with(tmp_path, flag, str(link))
    head = (await asyncio.to_thread(link.read_bytes))[:4]
    assert (0, "keep me\n", False, b"<!do" if flag == "--html" else b"\x89PNG") == (
        code,
        target.read_text(),
        link.is_symlink(),
        head,
    ), err


async def test_a_write_that_fails_leaves_no_temporary_file(tmp_path: Path) -> None:
    """--html onto a directory: exit 1 naming the file, and nothing left beside it."""
    target = tmp_path / "out"
    target.mkdir()
    code, _, err = await report_with(tmp_path, "--html", str(target))
    said = " ".join(err.split())  # wrapped at 80 columns
    assert (1, True, ["out"]) == (code, f"cannot write {target}:" in said, sorted(os.listdir(tmp_path)))


def row(text: str, name: str) -> str:
    """The value of the last ``  name   value`` row of the text report."""
    values = [
        line[2:].removeprefix(name).strip() for line in text.splitlines() if line[2:].startswith(name + " ")
    ]
    return values[-1]


async def test_text_names_the_job_its_gpus_and_its_checkpoints(tmp_path: Path) -> None:
    code, text, _ = await report_with(tmp_path)
    assert (0, True, "8", "2.0 MB") == (
        code,
        "Job j7" in text,
        row(text, "GPUs"),
        row(text, "checkpoint bytes written"),
    )


async def test_a_bad_window_is_refused_by_the_agent_with_the_reason() -> None:
    """GET /v1/ledger?since_s=abc answers 400 naming the parameter; the agent keeps running."""
    async with running_agent(short_tmp("pd-report-")) as agent:
        status, body = await http_json(agent.config.socket, "GET", "/v1/ledger?since_s=abc")
        again, _ = await http_json(agent.config.socket, "GET", "/v1/ledger?since_s=60")
    assert (400, True, 200) == (status, "since_s" in body["error"], again)
