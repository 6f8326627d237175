"""``preemptd advise``: the checkpoint interval, offline from given inputs (``--save-time 4m --mtbp 6h``) or live
from the running agent's ``/v1/advice``; ``--json``, ``--plot FILE.png`` and ``--simulate`` on top of either.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from agent.core.durations import parse_duration
from agent.core.screen import duration, fill, plural

if TYPE_CHECKING:
    from agent.advisor.advice import Inputs

# The advisor's formulas are imported where they are used, not at the top: the CLI imports this module to
# build its parser for every verb, and `preemptd status` has no use for them.

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_NO_AGENT = 69  # EX_UNAVAILABLE, as the other client verbs


def _duration(text: str) -> float:
    try:
        value = parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc
    return value


def _positive_duration(text: str) -> float:
    value = _duration(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(
            f"expected a positive duration such as 90s, 4m or 1.5h, got {text!r}"
        )
    return value


def _share(text: str) -> float:
    try:
        value = float(text.rstrip("%")) / (100.0 if text.endswith("%") else 1.0)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected a share such as 0.8 or 80%, got {text!r}") from exc
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"the announced share must be at least 0 and below 1, got {text!r}")
    return value


def register(subparsers: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "advise",
        help="checkpoint interval advice: live from the agent, or offline from --save-time and --mtbp",
        description=(
            "Advise how much compute to run between checkpoints (τ) so that the least GPU time is wasted. "
            "With --save-time and --mtbp it computes offline; with neither it asks the running agent, which "
            "measures both. Durations: 90s, 4m, 1.5h, 2d, 1h30m."
        ),
    )
    parser.add_argument(
        "--save-time", type=_positive_duration, metavar="DURATION", help="checkpoint save time δ"
    )
    parser.add_argument(
        "--mtbp",
        type=_positive_duration,
        metavar="DURATION",
        help="mean time between interruptions M (with --announced-share: of all interruptions)",
    )
    parser.add_argument(
        "--announced-share",
        type=_share,
        default=0.0,
        metavar="SHARE",
        help="share of interruptions that come with a notice long enough to flush (0 to <1, e.g. 0.8 or 80%%)",
    )
    parser.add_argument(
        "--restart",
        type=_duration,
        default=0.0,
        metavar="DURATION",
        help="restart and restore time R (default 0)",
    )
    parser.add_argument(
        "--emergency-save-time",
        type=_duration,
        metavar="DURATION",
        help="time to flush an emergency checkpoint on a notice (default: the save time)",
    )
    parser.add_argument(
        "--current", type=_positive_duration, metavar="DURATION", help="the interval used now"
    )
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument(
        "--plot", type=Path, metavar="FILE.png", help="draw waste against interval into a PNG"
    )
    parser.add_argument(
        "--simulate", action="store_true", help="check the waste with a Monte Carlo simulation"
    )
    parser.add_argument("--runs", type=int, default=1000, help="simulated jobs (default 1000)")
    parser.add_argument(
        "--periods", type=int, default=100, help="checkpoint periods per simulated job (default 100)"
    )
    parser.add_argument("--seed", type=int, default=0, help="random seed of the simulation (default 0)")
    parser.add_argument("--socket", type=Path, help="the agent's socket (live mode)")
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None) -> int:
    from agent.advisor.advice import calculate, waste_at

    out = out or sys.stdout
    err = err or sys.stderr
    offline = args.save_time is not None or args.mtbp is not None
    if offline and (args.save_time is None or args.mtbp is None):
        _say(
            err,
            "preemptd advise: offline advice needs both --save-time and --mtbp (or neither, to ask the agent)",
        )
        return EXIT_USAGE
    if offline:
        inputs = _offline_inputs(args)
        doc: dict[str, Any] = {"mode": "offline", "inputs": _inputs_json(inputs), **calculate(inputs)}
        doc["efficiency"] = {name: round(1.0 - waste_at(inputs, tau), 5) for name, tau in _rows(inputs)}
    else:
        try:
            live = _ask_agent(args.socket)
        except _NoAgent as exc:
            _say(err, f"preemptd advise: {exc}; give --save-time and --mtbp for offline advice")
            return EXIT_NO_AGENT
        doc = {"mode": "live", **live}
        inputs_or_none = _live_inputs(live, args.current)
        if inputs_or_none is None:
            if args.json:
                print(json.dumps(doc, indent=2), file=out)
            else:
                print(fill(live.get("explanation") or "The agent has no advice yet."), file=out)
            if args.plot or args.simulate:
                _say(err, "preemptd advise: no advice yet, nothing to plot or simulate")
                return EXIT_FAILED
            return EXIT_OK
        inputs = inputs_or_none
    if args.simulate:
        try:
            doc["simulation"] = _simulate(inputs, args)
        except ValueError as exc:
            _say(err, f"preemptd advise: {exc}")
            return EXIT_USAGE
    if args.plot:
        from agent.advisor.plot import PlotUnavailable, plot_waste

        try:
            plot_waste(args.plot, inputs)
        except PlotUnavailable as exc:
            _say(err, f"preemptd advise: {exc}")
            return EXIT_FAILED
        except OSError as exc:
            _say(err, f"preemptd advise: cannot write {args.plot}: {exc.strerror or exc}")
            return EXIT_FAILED
        doc["plot"] = str(args.plot)
    if args.json:
        print(json.dumps(doc, indent=2), file=out)
    else:
        _print_human(doc, inputs, out)
    return EXIT_OK


def _say(stream: TextIO, text: str) -> None:
    """A paragraph in lines of at most 80 columns, the lines after the first indented."""
    print(fill(text, indent="  "), file=stream)


class _NoAgent(Exception):
    pass


def _ask_agent(socket: Path | None) -> dict[str, Any]:
    from agent.client.transport import AgentHTTPError, AgentUnavailable, request_json

    try:
        answer = request_json("GET", "/v1/advice", socket_path=socket)
    except AgentUnavailable as exc:
        raise _NoAgent(str(exc)) from exc
    except AgentHTTPError as exc:
        raise _NoAgent(f"the agent has no advice endpoint ({exc})") from exc
    except OSError as exc:
        raise _NoAgent(f"cannot reach the agent: {exc}") from exc
    if not isinstance(answer, dict):
        raise _NoAgent(f"unexpected answer from the agent: {answer!r:.200}")
    return answer


def _offline_inputs(args: argparse.Namespace) -> Inputs:
    from agent.advisor.advice import Inputs

    share = args.announced_share
    return Inputs(
        save_s=args.save_time,
        mtbp_lost_s=args.mtbp / (1.0 - share),
        mtbp_announced_s=args.mtbp / share if share > 0 else None,
        restart_s=args.restart,
        emergency_save_s=args.emergency_save_time,
        current_s=args.current,
    )


def _live_inputs(doc: dict[str, Any], current: float | None) -> Inputs | None:
    from agent.advisor.advice import Inputs

    if doc.get("interval_s") is None:
        return None
    try:
        mtbp = doc["mtbp"]
        return Inputs(
            save_s=float(doc["save_time"]["value_s"]),
            mtbp_lost_s=float(mtbp["unannounced"]["value_s"]),
            mtbp_announced_s=_float(mtbp.get("announced", {}).get("value_s")),
            restart_s=float((doc.get("restart") or {}).get("value_s") or 0.0),
            emergency_save_s=_float((doc.get("emergency_save_time") or {}).get("value_s")),
            current_s=current or _float((doc.get("current_interval") or {}).get("value_s")),
        )
    except (KeyError, TypeError, ValueError, AttributeError):
        return None


def _float(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _inputs_json(inputs: Inputs) -> dict[str, Any]:
    return {
        "save_time_s": inputs.save_s,
        "mtbp_unannounced_s": inputs.mtbp_lost_s,
        "mtbp_announced_s": inputs.mtbp_announced_s,
        "restart_s": inputs.restart_s,
        "emergency_save_time_s": inputs.emergency_save_s,
        "current_interval_s": inputs.current_s,
    }


def _rows(inputs: Inputs) -> list[tuple[str, float]]:
    from agent.advisor import math as cm

    formulas = cm.intervals(inputs.save_s, inputs.mtbp_lost_s)
    rows = [
        ("young", formulas.young),
        ("daly_first_order", formulas.daly_first_order),
        ("daly_higher_order", formulas.daly_higher_order),
        ("exact", formulas.exact),
    ]
    if inputs.mtbp_announced_s is not None:
        from agent.advisor.advice import advised_interval

        rows.append(("advised", advised_interval(inputs)))
    if inputs.current_s:
        rows.append(("current", inputs.current_s))
    return [(name, tau) for name, tau in rows if tau > 0]


_LABELS = {
    "young": "Young (1974)        sqrt(2δM)",
    "daly_first_order": "Daly first order    sqrt(2δM) - δ",
    "daly_higher_order": "Daly higher order",
    "exact": "exact (Lambert W)",
    "advised": "advised (notice-aware)",
    "current": "current",
}


def _unit(seconds: float) -> tuple[float, str]:
    if seconds < 120:
        return 1.0, "s"
    if seconds < 10 * 3600:
        return 60.0, "min"
    return 3600.0, "h"


def _simulate(inputs: Inputs, args: argparse.Namespace) -> list[dict[str, Any]]:
    from agent.advisor.advice import advised_interval
    from agent.advisor.simulate import simulate

    rate_lost = 1.0 / inputs.mtbp_lost_s
    rate_announced = 1.0 / inputs.mtbp_announced_s if inputs.mtbp_announced_s else 0.0
    mtbp_all = 1.0 / (rate_lost + rate_announced)
    share = rate_announced * mtbp_all
    policies = [("advised", advised_interval(inputs))]
    if inputs.current_s:
        policies.append(("current", inputs.current_s))
    results = []
    for name, tau in policies:
        result = simulate(
            tau,
            inputs.save_s,
            mtbp_all,
            announced_share=share,
            restart=inputs.restart_s,
            emergency_delta=inputs.emergency_save_s,
            periods_per_run=args.periods,
            runs=args.runs,
            seed=args.seed,
        )
        results.append({"policy": name, **result.to_json()})
    return results


def _inputs_line(inputs: Inputs) -> str:
    """The inputs the advice was computed from, as a sentence."""
    line = (
        f"Inputs: checkpoint save time δ = {duration(inputs.save_s)}, "
        f"M (work-losing interruptions) = {duration(inputs.mtbp_lost_s)}"
    )
    if inputs.mtbp_announced_s:
        line += f", announced interruptions every {duration(inputs.mtbp_announced_s)}"
    return line + f", restart R = {duration(inputs.restart_s)}"


def _print_table(inputs: Inputs, scale: float, unit: str, out: TextIO) -> None:
    """Each formula's interval (in ``unit``, ``scale`` seconds each), waste and efficiency."""
    from agent.advisor.advice import waste_at

    # The table is 72 columns wide: it needs no wrapping.
    print(f"\n  {'formula':<36} {'interval τ':>12} {'waste':>8} {'efficiency':>11}", file=out)
    for name, tau in _rows(inputs):
        waste = waste_at(inputs, tau)
        print(
            f"  {_LABELS[name]:<36} {tau / scale:>8.1f} {unit:<3} {100 * waste:>7.1f}% {100 * (1 - waste):>10.1f}%",
            file=out,
        )


def _print_human(doc: dict[str, Any], inputs: Inputs, out: TextIO) -> None:
    def say(text: str) -> None:
        _say(out, text)

    if doc["mode"] == "live" and doc.get("explanation"):
        print(fill(doc["explanation"]), file=out)
        print(file=out)
    say(_inputs_line(inputs))
    scale, unit = _unit(doc["interval_s"])
    _print_table(inputs, scale, unit, out)
    waste = doc["expected_waste"]
    print(file=out)
    say(
        f"Advice: checkpoint every {doc['interval_s'] / scale:.1f} {unit} of compute "
        f"({duration(doc['interval_s'])}; a checkpoint starts every {duration(doc['period_s'])}); "
        f"expected waste {100 * waste['advised']:.1f}%"
        + (f" against {100 * waste['current']:.1f}% now" if waste.get("current") is not None else "")
        + "."
    )
    if doc.get("two_level"):  # peer snapshots were reported
        print(file=out)
        say(doc["two_level"]["explanation"])
    naive = waste.get("if_every_interruption_lost_work")
    if naive:
        say(
            f"Counting every interruption as lost work would give {duration(naive['interval_s'])} "
            f"and {100 * naive['waste']:.1f}% waste."
        )
    benefit = doc.get("notice_benefit")
    if benefit:
        say(
            f"Notices make the interval x{benefit['interval_factor']:.2f} longer "
            f"(1/sqrt(1-a), a = {100 * benefit['covered_share']:.0f}% of interruptions covered; "
            f"x{benefit['exact_factor']:.2f} by the exact model): "
            f"{benefit['checkpoints_saved_per_day']:.1f} fewer checkpoints a day, "
            f"{duration(benefit['checkpoint_time_saved_per_day_s'])} of saving time saved."
        )
    for sim in doc.get("simulation") or []:
        low, high = sim["ci"]
        say(
            f"Simulated ({plural(sim['runs'], 'job')}, {plural(sim['interruptions'], 'interruption')}, "
            f"{sim['announced']} announced), {sim['policy']} interval: waste {100 * sim['waste']:.2f}% "
            f"({100 * sim['level']:.0f}% CI {100 * low:.2f}-{100 * high:.2f}%), "
            f"analytical {100 * sim['analytical_waste']:.2f}%"
            + ("" if sim["agrees"] else "  (outside the interval)")
        )
    if doc.get("plot"):
        say(f"Plot written to {doc['plot']}")
