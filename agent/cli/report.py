"""``preemptd report``: what preemption cost, per job and in total, from the ledger: through the running agent
(``GET /v1/ledger``: the socket is what a user may reach when the state directory is root's), or from the
ledger file itself when no agent answers. ``--json``, ``--html FILE`` and ``--png FILE``; docs/ledger.md.
"""

from __future__ import annotations

import argparse
import html
import json
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, TextIO

from agent.core.durations import parse_duration
from agent.core.screen import KEEP, duration, fill, keep, plural, when, wrap

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_NO_LEDGER = 69  # EX_UNAVAILABLE: no agent answered and there is no ledger file to read


def _duration(text: str) -> float:
    try:
        value = parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive duration such as 7d or 12h, got {text!r}")
    return value


def register(subparsers: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "report",
        help="what preemption cost: interruptions, flushes, GPU-hours redone, discount, break-even",
        description=(
            "Report what preemption cost on this host, per job and in total, from the agent's ledger: "
            "interruptions with and without notice, flushes in time, late or lost, GPU-hours redone and spent "
            "checkpointing, goodput and, with [cost] prices, the realised discount and the break-even "
            "preemption rate."
        ),
    )
    parser.add_argument(
        "--since", type=_duration, default=7 * 86400.0, metavar="DURATION", help="how far back (default 7d)"
    )
    parser.add_argument("--job", metavar="ID", help="one job only")
    output = parser.add_mutually_exclusive_group()
    output.add_argument("--json", action="store_true", help="print JSON (every field is in docs/ledger.md)")
    output.add_argument(
        "--html", type=Path, metavar="FILE", help="write an HTML page (with a plot if it can)"
    )
    output.add_argument("--png", type=Path, metavar="FILE", help="plot where the GPU-hours went into a PNG")
    parser.add_argument(
        "--drills", action="store_true", help="count drill notices as interruptions (a rehearsal costs too)"
    )
    parser.add_argument("--prices", type=Path, metavar="FILE", help="a TOML file of [cost] prices to use")
    parser.add_argument("--socket", type=Path, help="the agent's socket")
    parser.add_argument(
        "--config", type=Path, help="config file to find the ledger and prices when no agent answers"
    )
    parser.set_defaults(func=run)
    return parser


class _Failed(Exception):
    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


def run(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None) -> int:
    out = out or sys.stdout
    err = err or sys.stderr
    try:
        doc = _report(args)
    except _Failed as exc:
        print(fill(f"preemptd report: {exc}", indent="  "), file=err)
        return exc.code
    if args.json:
        print(json.dumps(doc, indent=2), file=out)
        return EXIT_OK
    try:
        if args.png is not None:
            from agent.ledger.plot import plot_report

            plot_report(args.png, doc)
            print(fill(f"preemptd report: wrote {args.png}", indent="  "), file=out)
        elif args.html is not None:
            from agent.core.files import replace_file

            replace_file(args.html, render_html(doc).encode("utf-8"))
            print(fill(f"preemptd report: wrote {args.html}", indent="  "), file=out)
        else:
            out.write(render_text(doc))
    except OSError as exc:
        target = args.png or args.html
        print(fill(f"preemptd report: cannot write {target}: {exc.strerror or exc}", indent="  "), file=err)
        return EXIT_FAILED
    except RuntimeError as exc:  # PlotUnavailable: matplotlib is not installed
        print(fill(f"preemptd report: {exc}", indent="  "), file=err)
        return EXIT_FAILED
    return EXIT_OK


def _report(args: argparse.Namespace) -> dict[str, Any]:
    from agent.client.transport import AgentHTTPError, AgentUnavailable, request_json
    from agent.ledger.facts import Facts
    from agent.ledger.report import build_report, prices_from_json
    from agent.ledger.tally import Rules

    query = f"/v1/ledger?since_s={args.since:.3f}"
    if args.job:
        from urllib.parse import quote

        query += f"&job={quote(args.job, safe='')}"
    try:
        answer = request_json("GET", query, socket_path=args.socket)
    except AgentUnavailable:
        answer = None
    except AgentHTTPError as exc:
        if exc.status != 404:  # 404: an agent without a ledger; read the file
            raise _Failed(f"the agent could not give its ledger: {exc}", EXIT_FAILED) from exc
        answer = None
    if isinstance(answer, dict):
        try:
            facts = Facts.from_json(answer)
            now = _parse_time(answer["now"])
        except (KeyError, ValueError) as exc:
            raise _Failed(f"unexpected answer from the agent: {exc}", EXIT_FAILED) from exc
        prices = prices_from_json(answer.get("prices") or {})
        rules_doc = answer.get("rules") or {}
        rules = Rules(
            interrupting_kinds=tuple(rules_doc.get("interrupting_kinds") or Rules().interrupting_kinds),
            active_s=float(rules_doc.get("active_s") or Rules().active_s),
            drills=args.drills,
        )
        source = "agent"
    else:
        facts, prices, rules, now = _from_file(args)
        source = "file"
    if args.prices is not None:
        prices = _prices_file(args.prices)
    since = now - timedelta(seconds=args.since)
    return build_report(facts, now, since, args.job, prices, rules, source=source)


def _prices_file(path: Path) -> Any:
    from agent.core.errors import ConfigError
    from agent.ledger.config import prices_from_file
    from agent.ledger.report import prices_of

    try:
        return prices_of(prices_from_file(path))
    except ConfigError as exc:
        raise _Failed(str(exc), EXIT_USAGE) from exc


def _from_file(args: argparse.Namespace) -> tuple[Any, Any, Any, datetime]:
    """No agent answered: the ledger file and the prices from the configuration."""
    from agent.config import load_config
    from agent.core.errors import ConfigError
    from agent.ledger import store
    from agent.ledger.component import ledger_path
    from agent.ledger.config import CostConfig, LedgerConfig
    from agent.ledger.report import prices_of
    from agent.ledger.tally import Rules

    try:
        config = load_config(path=args.config)
        ledger = config.table("ledger", LedgerConfig)
        prices = prices_of(config.table("cost", CostConfig).merged())
    except ConfigError as exc:
        raise _Failed(str(exc), EXIT_USAGE) from exc
    path = ledger_path(ledger, config.state_dir)
    now = datetime.now(timezone.utc)
    try:
        facts = store.read(path, (now - timedelta(seconds=args.since)).timestamp())
    except FileNotFoundError as exc:
        raise _Failed(f"no agent answered and there is no ledger at {path}", EXIT_NO_LEDGER) from exc
    except store.LedgerCorrupt as exc:
        raise _Failed(f"the ledger cannot be read: {exc}", EXIT_FAILED) from exc
    except PermissionError as exc:
        raise _Failed(
            f"no agent answered and {path} is not readable: {exc.strerror}", EXIT_NO_LEDGER
        ) from exc
    rules = Rules(ledger.interrupting_kinds, ledger.active_s, args.drills)
    return facts, prices, rules, now


def _parse_time(text: Any) -> datetime:
    from agent.core.notice import parse_time

    if not isinstance(text, str):
        raise ValueError(f"'now' is not a time: {text!r}")
    try:
        return parse_time(text)
    except Exception as exc:
        raise ValueError(str(exc)) from exc


# ----- rendering ---------------------------------------------------------------------------------------


def _pct(value: Any) -> str:
    return "n/a" if value is None else keep(f"{100.0 * value:.1f} %")


def _hours(value: Any) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def _bytes(value: Any) -> str:
    size = float(value or 0)
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if size < 1000 or unit == "TB":
            return keep(f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}")
        size /= 1000
    return keep(f"{size:.1f} TB")


def _rate(value: float) -> str:
    """A rate a day as people read it: two decimals (``0.14``), none from ten on."""
    return f"{value:.2f}" if value < 10 else f"{value:.0f}"


def _since(doc: dict[str, Any]) -> str:
    return keep(when(doc["since"])) if doc.get("since") else "the start of the ledger"


def _rows(fig: dict[str, Any]) -> list[tuple[str, str]]:
    inter = fig["interruptions"]
    flushes = fig["flushes"]
    rows = [
        ("GPUs", str(fig["gpus"])),
        ("GPU-hours", _hours(fig["gpu_hours"])),
        ("interruptions", f"{inter['announced']} announced, {inter['unannounced']} unannounced"),
        ("notice coverage", _pct(fig["notice_coverage"])),
        ("flushes", f"{flushes['in_time']} in time, {flushes['late']} late, {flushes['lost']} lost"),
        ("GPU-hours redone", _hours(fig["redone_gpu_hours"])),
        (
            "GPU-hours checkpointing",
            f"{_hours(fig['checkpoint_gpu_hours'])} periodic, {_hours(fig['flush_gpu_hours'])} flushing",
        ),
        ("GPU-hours restarting", _hours(fig["restart_gpu_hours"])),
        ("checkpoint bytes written", _bytes(fig["checkpoint_bytes"])),
        ("steps redone", str(fig["steps_redone"])),
        ("goodput", _pct(fig["goodput"])),
    ]
    rows += _reform_rows(fig.get("reforms"))  # absent from a document of an older agent
    rows += _snapshot_rows(fig.get("snapshots"))  # likewise
    benefit = fig["notice_benefit"]
    if benefit["interval_factor"] is not None:
        rows.append(
            (
                "notices lengthen T* by",
                f"x{benefit['interval_factor']:.2f} (covered share {_pct(benefit['covered_share'])}; "
                f"saves {_hours(benefit['checkpoint_gpu_hours_saved'])} GPU-h, "
                f"{_bytes(benefit['checkpoint_bytes_saved'])} of checkpoints)",
            )
        )
    cost = fig["cost"]
    if cost.get("missing"):
        rows.append(("cost", "prices missing: set " + ", ".join(cost["missing"]) + " (or --prices FILE)"))
    else:
        rows.append(("spot cost", f"{cost['spot']:.2f} (storage {cost['storage']:.2f})"))
        rows.append(("same work on demand", f"{cost['on_demand_equivalent']:.2f}"))
        rows.append(
            ("discount", f"{_pct(cost['effective_discount'])} realised, {_pct(cost['list_discount'])} list")
        )
        rate, even = cost["preemptions_per_day"], cost["break_even_per_day"]
        if even is not None:
            verdict = "spot is cheaper" if rate is not None and rate < even else "reserved would be cheaper"
            shown = _rate(rate) if rate is not None else "not measured"
            rows.append(("preemptions per day", f"{shown}; break-even {_rate(even)}: {verdict}"))
        elif rate is not None:
            rows.append(
                ("preemptions per day", f"{_rate(rate)}; break-even: no interruption cost measured yet")
            )
        if cost.get("assumed_zero"):
            rows.append(("not priced", ", ".join(cost["assumed_zero"]) + " (counted as 0)"))
    return rows


def _reform_rows(fig: dict[str, Any] | None) -> list[tuple[str, str]]:
    """An elastic job's re-forms, departures and stops on this host; nothing for a job that had none."""
    rows: list[tuple[str, str]] = []
    if not fig:
        return rows
    if fig["reformed"]:
        said = f"{fig['reformed']}x instead of stopping: {fig['halted_gpu_seconds']:.1f} GPU-s halted"
        saved = fig["saved_gpu_hours"]
        if saved is None:
            said += "; no relaunch measured on this host"
        elif fig["relaunch_s"] is not None:
            said += f", a relaunch here takes {duration(fig['relaunch_s'])}: saved {_gpu_h(saved)}"
        else:  # the total: each job against its own relaunch time
            said += f"; saved {_gpu_h(saved)} over {plural(fig['saved_reforms'], 're-form')} with a relaunch measured"
        rows.append(("re-formed", said))
    if fig["left"]:
        rows.append(("left", f"{fig['left']}x (this host's ranks left; the job went on elsewhere)"))
    if fig["stopped"]:
        reasons = "; ".join(fig["stopped_reasons"])
        rows.append(("stopped", f"{fig['stopped']}x instead of shrinking: {reasons}"))
    return rows


def _interval(fig: dict[str, Any]) -> str:
    """A measured mean interval: ``every 20 steps (1m10s)``, or that it was not measured."""
    if not fig["pairs"]:
        return "not measured"
    steps = fig["steps"]
    shown = f"{steps:.0f}" if float(steps).is_integer() else f"{steps:.1f}"
    return f"every {shown} steps ({keep(duration(fig['seconds']))})"


def _snapshot_rows(fig: dict[str, Any] | None) -> list[tuple[str, str]]:
    """A job's peer snapshots, their intervals and what they saved; nothing for a job that took none."""
    if not fig or not (fig["taken"] or fig["failed"]):
        return []
    said = f"{fig['taken']} taken, {fig['failed']} failed; stall {_gpu_h(fig['stall_gpu_hours'])}"
    if fig["complete_s_median"] is not None:
        said += f"; committed in {keep(duration(fig['complete_s_median']))} (median)"
    said += f"; {_bytes(fig['bytes'])}" if fig["bytes"] is not None else "; bytes not reported"
    intervals = f"snapshots {_interval(fig['interval'])}, durable {_interval(fig['durable_interval'])}"
    rows = [("snapshots", said), ("checkpoint intervals", intervals)]
    if fig["interruptions"]:
        saved = (
            f"{plural(fig['saved_steps'], 'step')} ({_gpu_h(fig['saved_gpu_hours'])}) over "
            f"{plural(fig['interruptions'], 'unannounced interruption')} against durable checkpoints alone"
        )
        rows.append(("snapshots saved", saved))
    else:
        rows.append(("snapshots saved", "nothing yet: no unannounced interruption here"))
    return rows


def _gpu_h(value: float) -> str:
    """GPU-hours a re-form or a snapshot saved, small as they are: 0.009, 0.000278, 1.25."""
    if value == 0:
        return "0 GPU-h"
    if abs(value) >= 1:
        return f"{value:.2f} GPU-h"
    return f"{value:.3f} GPU-h" if abs(value) >= 0.001 else f"{value:.6f} GPU-h"


_NAME = 26  # the column of a row's value


def _table(fig: dict[str, Any], cost: bool = True) -> list[str]:
    """A figure per row, the value wrapped under itself."""
    return [
        line
        for name, value in _rows(fig)
        if cost or name != "cost"
        for line in wrap(f"{name:<{_NAME}}{value}", "  ", " " * (2 + _NAME))
    ]


def render_text(doc: dict[str, Any]) -> str:
    """The report in lines of at most 80 columns."""
    scope = f"job {doc['job']}" if doc["job"] else "every job"
    where = "from the agent" if doc["source"] == "agent" else "from the ledger file"
    lines = wrap(f"Preemption cost since {_since(doc)}, {scope} ({where})", "", "  ")
    notices = doc["notices"]
    lead = notices["lead_s"]
    lines += wrap(
        f"notices: {notices['total']} ({plural(notices['drills'], 'drill')})"
        + (f", lead {duration(lead['min'])} to {duration(lead['max'])}" if lead["min"] is not None else ""),
        "  ",
    )
    lines.append("Total")
    lines += _table(doc["total"])
    for job, fig in doc["jobs"].items():
        lines += wrap(f"Job {job}", "", "  ")
        lines += _table(fig, cost=len(doc["jobs"]) == 1)
    if not doc["jobs"]:
        lines.append("  no training job reported on this host in that time")
    return "\n".join(lines) + "\n"


# Column headings and cell values of the flushes and resumes tables, as people read them.
_HEADINGS = {
    "notice_id": "notice",
    "duration_s": "duration",
    "slack_s": "slack",
    "fallback_step": "fell back to step",
    "from_step": "from step",
    "steps_redone": "steps redone",
}


def _cell(key: str, value: Any) -> str:
    """A table cell: empty for nothing to say, yes or no, times, durations and sizes for people."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if key == "time" and isinstance(value, str):
        return when(value)
    if key.endswith("_s") and isinstance(value, (int, float)):
        return duration(value) if value >= 0 else f"-{duration(-value)}"
    if key == "bytes" and isinstance(value, (int, float)):
        return _bytes(value).replace(KEEP, " ")
    if key == "outcome":
        return str(value).replace("_", " ")
    return str(value)


def render_html(doc: dict[str, Any]) -> str:
    """A self-contained page: the totals, each job, the flushes, the resumes, and the plot when matplotlib is
    installed (inline, so the page is one file)."""
    esc = html.escape
    parts = [
        "<!doctype html><meta charset='utf-8'><title>preemptd report</title>",
        "<style>body{font-family:sans-serif}td,th{padding:2px 8px;text-align:left}</style>",
        f"<h1>Preemption cost since {esc(_since(doc).replace(KEEP, ' '))}</h1>",
    ]
    for title, fig in [("Total", doc["total"]), *((f"Job {job}", fig) for job, fig in doc["jobs"].items())]:
        parts.append(f"<h2>{esc(title)}</h2><table>")
        parts += [f"<tr><th>{esc(k)}</th><td>{esc(v.replace(KEEP, ' '))}</td></tr>" for k, v in _rows(fig)]
        parts.append("</table>")
    for title, key in (("Flushes", "flushes"), ("Resumes", "resumes")):
        rows = doc[key]
        if rows:
            heads = list(rows[0])
            parts.append(
                f"<h2>{title}</h2><table><tr>"
                + "".join(f"<th>{esc(_HEADINGS.get(h, h))}</th>" for h in heads)
                + "</tr>"
            )
            parts += [
                "<tr>" + "".join(f"<td>{esc(_cell(h, r[h]))}</td>" for h in heads) + "</tr>" for r in rows
            ]
            parts.append("</table>")
    try:
        from agent.ledger.plot import plot_data_uri

        parts.append(
            f"<h2>Where the GPU-hours went</h2><img alt='GPU-hours by job' src='{plot_data_uri(doc)}'>"
        )
    except RuntimeError as exc:  # PlotUnavailable
        parts.append(f"<p>{esc(str(exc))}</p>")
    return "\n".join(parts) + "\n"
