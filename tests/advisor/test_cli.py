"""``preemptd advise`` offline: the reference table and Daly's values recomputed from the command line, the
plot, the simulation and the errors a user can make."""

from __future__ import annotations

import argparse
import io
import json
import struct
import sys
from pathlib import Path
from typing import Any

import pytest

from agent.advisor.cli import register, run
from agent.cli import build_parser

MIN = 60.0


def advise(*argv: str) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["advise", *argv])
    out, err = io.StringIO(), io.StringIO()
    code = run(args, out, err)
    return code, out.getvalue(), err.getvalue()


def advise_json(*argv: str) -> dict[str, Any]:
    code, out, err = advise(*argv, "--json")
    assert code == 0, err
    doc: dict[str, Any] = json.loads(out)
    return doc


@pytest.mark.parametrize(
    ("mtbp", "expected"),
    [("6h", (53.7, 49.7, 51.0, 85.8)), ("90m", (26.8, 22.8, 24.2, 73.0))],
)
def test_reference_table_from_the_command_line(mtbp: str, expected: tuple[float, ...]) -> None:
    doc = advise_json("--save-time", "4m", "--mtbp", mtbp)
    formulas = doc["formulas"]
    assert (
        round(formulas["young_s"] / MIN, 1),
        round(formulas["daly_first_order_s"] / MIN, 1),
        round(formulas["daly_higher_order_s"] / MIN, 1),
        round(100 * doc["efficiency"]["daly_first_order"], 1),
    ) == expected


@pytest.mark.parametrize(("mtbp", "expected"), [("24h", "117"), ("6h", "57"), ("15m", "9.1")])
def test_daly_check_values_from_the_command_line(mtbp: str, expected: str) -> None:
    doc = advise_json("--save-time", "5m", "--restart", "10m", "--mtbp", mtbp)
    value = doc["formulas"]["daly_higher_order_s"] / MIN
    assert f"{value:.{1 if '.' in expected else 0}f}" == expected


def test_human_output_lists_every_formula_and_the_advice() -> None:
    code, out, _ = advise("--save-time", "5m", "--mtbp", "24h", "--restart", "10m")
    assert code == 0
    assert all(
        text in out
        for text in ("Young (1974)", "Daly first order", "116.7 min", "exact (Lambert W)", "Advice:")
    )


def test_current_interval_waste_is_compared() -> None:
    doc = advise_json("--save-time", "4m", "--mtbp", "90m", "--current", "2h")
    assert doc["expected_waste"]["current"] > doc["expected_waste"]["advised"]


def test_announced_share_raises_m_for_losses() -> None:
    doc = advise_json("--save-time", "4m", "--mtbp", "6h", "--announced-share", "80%")
    assert doc["inputs"]["mtbp_unannounced_s"] == pytest.approx(30 * 3600.0)


def test_half_the_offline_inputs_is_a_usage_error() -> None:
    code, _, err = advise("--save-time", "4m")
    assert (code, "--mtbp" in err) == (2, True)


def test_bad_duration_is_rejected_with_an_example(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        advise("--save-time", "four minutes", "--mtbp", "6h")
    assert "such as 90s, 4m or 1.5h" in capsys.readouterr().err


def test_simulation_agrees_with_the_formula() -> None:
    doc = advise_json("--save-time", "4m", "--mtbp", "90m", "--simulate", "--runs", "400", "--periods", "50")
    sim = doc["simulation"][0]
    assert (sim["policy"], sim["agrees"]) == ("advised", True)


def test_plot_is_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    target = tmp_path / "waste.png"
    code, _, err = advise("--save-time", "4m", "--mtbp", "90m", "--current", "30m", "--plot", str(target))
    header = target.read_bytes()[:24]
    width, height = struct.unpack(">II", header[16:24])
    assert (code, header[:8], width > 400, height > 300) == (0, b"\x89PNG\r\n\x1a\n", True, True), err


def test_plot_onto_a_link_replaces_the_link_and_leaves_its_target_alone(tmp_path: Path) -> None:
    """--plot FILE where FILE is a symbolic link: the link itself becomes the PNG (written beside it and
    renamed over it); the file it pointed to keeps its content, and no temporary file is left."""
    pytest.importorskip("matplotlib")
    target = tmp_path / "precious.txt"
    target.write_text("keep me\n")
    link = tmp_path / "waste.png"
    link.symlink_to(target)
    code, _, err = advise("--save-time", "4m", "--mtbp", "90m", "--plot", str(link))
    assert (0, "keep me\n", False, b"\x89PNG", ["precious.txt", "waste.png"]) == (
        code,
        target.read_text(),
        link.is_symlink(),
        link.read_bytes()[:4],
        sorted(p.name for p in tmp_path.iterdir()),
    ), err


def test_plot_without_matplotlib_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    code, _, err = advise("--save-time", "4m", "--mtbp", "90m", "--plot", str(tmp_path / "w.png"))
    assert (code, "preemptd[plot]" in err) == (1, True)


def test_live_mode_without_an_agent_explains_the_offline_way(tmp_path: Path) -> None:
    code, _, err = advise("--socket", str(tmp_path / "none.sock"))
    assert (code, "--save-time" in err) == (69, True)


def test_advise_is_a_verb_of_preemptd() -> None:
    args = build_parser().parse_args(["advise", "--save-time", "90s", "--mtbp", "1.5h"])
    assert (args.save_time, args.mtbp) == (90.0, 5400.0)


def test_preemptd_main_runs_the_advise_verb(capsys: pytest.CaptureFixture[str]) -> None:
    from agent.cli import main

    code = main(["advise", "--save-time", "4m", "--mtbp", "6h", "--json"])
    assert (code, round(json.loads(capsys.readouterr().out)["formulas"]["young_s"] / MIN, 1)) == (0, 53.7)
