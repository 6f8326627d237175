"""The ``preemptd`` command: turns flags into configuration and calls the agent, or talks to a running one.

Verbs: ``run`` (the daemon), ``status``, ``watch``, ``drill``, ``version``, ``demo``, plus the verbs that
modules listed in ``_EXTENSIONS`` register (each exposes ``register(subparsers)``). Client verbs use only the
standard library client, and a verb's module is imported only when that verb runs, so they start fast and
work without the agent's dependencies loaded (tests/cli/test_imports.py).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import queue
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from agent import __version__
from agent.cli import help as cli_help
from agent.cli.render import countdown, format_event, format_status, note, track
from agent.cli.watch_jobs import JobsPoller
from agent.client.transport import AgentHTTPError, AgentUnavailable, EventStream, request_json
from agent.client.watcher import Backoff
from agent.core.durations import format_duration, parse_duration
from agent.core.errors import ConfigError
from agent.core.paths import client_socket_path
from agent.core.screen import fill, keep, when

# Modules that add verbs: each has register(subparsers) and sets a `func` default on its parser. Only the
# module of the verb being run is imported (the simulators alone would load aiohttp for `preemptd status`);
# the others are listed with their summary from cli_help.
_EXTENSIONS: dict[str, str] = {
    "advise": "agent.advisor.cli",
    "simulate": "agent.simulate.cli",
    "exec": "agent.cli.exec",
    "report": "agent.cli.report",
}

EXIT_OK = 0
EXIT_USAGE = 2
EXIT_NO_AGENT = 69  # EX_UNAVAILABLE


def _add_run(subparsers: Any) -> None:
    p = subparsers.add_parser("run", help="run the agent (the daemon)")
    p.add_argument(
        "--config", type=Path, help="TOML config file (default /etc/preemptd/config.toml if present)"
    )
    p.add_argument("--socket", type=Path, help="Unix socket to listen on")
    p.add_argument("--socket-group", help="group owning the socket (mode 0660)")
    p.add_argument("--state-dir", type=Path, help="directory for state and history")
    p.add_argument(
        "--cloud",
        type=_cloud_arg,
        metavar="CLOUD",
        help="cloud to watch: auto (detect it), none, aws, gcp, azure, alibaba, tencent or a plug-in cloud's name",
    )
    p.add_argument("--log-format", choices=("auto", "json", "console"), help="log format on stdout")
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error"))
    p.add_argument(
        "--set",
        dest="settings",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any config key, e.g. api.heartbeat_s=5 (repeatable)",
    )
    p.add_argument(
        "--print-config", action="store_true", help="print the effective configuration as JSON and exit"
    )
    p.set_defaults(func=cmd_run)


def _cloud_arg(text: str) -> str:
    # Checked here rather than with argparse's choices, which would load the configuration module (and
    # msgspec) for every verb's parser; a test keeps the help's list equal to agent.config.CLOUDS. A cloud
    # added as a plug-in (agent/sources/clouds.py) is accepted too.
    from agent.sources.clouds import clouds

    names = ("auto", "none", *clouds())
    if text not in names:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(names)}, got {text!r}")
    return text


def _run_overrides(args: argparse.Namespace) -> dict[str, Any]:
    from agent.config import parse_setting

    overrides: dict[str, Any] = {}
    for text in args.settings:
        key, value = parse_setting(text)
        overrides[key] = value
    for key in ("socket", "socket_group", "state_dir", "cloud", "log_format", "log_level"):
        value = getattr(args, key, None)
        if value is not None:
            overrides[key] = str(value) if isinstance(value, Path) else value
    return overrides


def cmd_run(args: argparse.Namespace) -> int:
    from agent.config import config_to_json, load_config
    from agent.service import plugins  # noqa: F401 - so that every plug-in's table is checked when loading
    from agent.service.daemon import run_agent
    from agent.service.logs import configure_logging

    overrides = _run_overrides(args)

    def load() -> Any:
        return load_config(args.config, overrides=overrides)

    try:
        config = load()
    except ConfigError as exc:
        print(f"preemptd: configuration error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.print_config:
        print(json.dumps(config_to_json(config), indent=2))
        return EXIT_OK
    configure_logging(config.log_format, config.log_level)
    return run_agent(config, reload_config=load)


def _socket_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--socket",
        type=Path,
        help="the agent's socket (default: $PREEMPTD_SOCKET, the system socket, or the per-user one)",
    )


def _fail_no_agent(exc: Exception, socket: Path | None) -> int:
    # AgentUnavailable names the socket; other errors (no permission, a server that is not the agent) do not.
    where = (
        ""
        if isinstance(exc, AgentUnavailable)
        else f"cannot reach the agent at {socket or client_socket_path()}: "
    )
    print(
        fill(
            f"preemptd: {where}{exc}. Is the agent running? (preemptd run, or systemctl status preemptd)",
            indent="  ",
        ),
        file=sys.stderr,
    )
    return EXIT_NO_AGENT


def cmd_status(args: argparse.Namespace) -> int:
    try:
        doc = request_json("GET", "/v1/status", socket_path=args.socket)
    except (AgentUnavailable, OSError) as exc:
        return _fail_no_agent(exc, args.socket)
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        print(format_status(doc))
    return EXIT_OK if doc.get("overall") == "ok" else 1


class _Reader(threading.Thread):
    """Reads the event stream on a thread, reconnecting with Last-Event-ID, into a queue. Unless ``wait``, a
    first connection that fails ends it with ``("unavailable", error)``: a wrong socket is said at once,
    while a restart of an agent already seen is waited out."""

    def __init__(self, socket_path: Path | None, out: queue.Queue[tuple[str, Any]], wait: bool) -> None:
        super().__init__(daemon=True, name="preemptd-watch")
        self.socket_path = socket_path
        self.out = out
        self.wait = wait
        self.stop = threading.Event()

    def run(self) -> None:
        last_id: str | None = None
        backoff = Backoff(initial=0.5, maximum=5.0)
        announced = False
        connected = False
        while not self.stop.is_set():
            try:
                with EventStream(self.socket_path, last_event_id=last_id, read_timeout=60.0) as stream:
                    self.out.put(("connected", None))
                    connected, announced = True, False
                    backoff.reset()
                    for message in stream:
                        last_id = stream.decoder.last_event_id or last_id
                        self.out.put(("event", json.loads(message.data)))
                        if self.stop.is_set():
                            return
            except (OSError, AgentHTTPError, ValueError) as exc:
                if not connected and not self.wait:
                    self.out.put(("unavailable", exc))
                    return
                if not announced:
                    self.out.put(("disconnected", str(exc)))
                    announced = True
            self.stop.wait(backoff.next())


def _show(what: str, payload: Any, out: TextIO, as_json: bool, shown: bool) -> int:
    """Write one item of watch's queue; 1 when it counts for --count (a stream event; a membership line does
    not)."""
    if what in ("event", "membership"):
        out.write((json.dumps(payload) if as_json else format_event(payload)) + "\n")
    elif what == "disconnected" and not as_json:
        out.write(note(f"waiting for the agent: {payload}") + "\n")
    elif what == "connected" and not as_json and shown:
        out.write(note("reconnected") + "\n")
    return 1 if what == "event" else 0


def cmd_watch(args: argparse.Namespace, out: TextIO | None = None) -> int:
    stream_out = out or sys.stdout
    events: queue.Queue[tuple[str, Any]] = queue.Queue()
    jobs = JobsPoller(args.socket, events)
    jobs.poll()
    reader = _Reader(args.socket, events, wait=args.wait)
    reader.start()
    jobs.start()
    active: dict[str, dict[str, Any]] = {}
    live = stream_out.isatty() and not args.json
    shown = 0
    try:
        while True:
            try:
                what, payload = events.get(timeout=1.0 if live else None)
            except queue.Empty:
                what, payload = "tick", None
            if what == "unavailable":
                return _fail_no_agent(payload, args.socket)
            if live:
                stream_out.write("\r\033[K")
            shown += _show(what, payload, stream_out, args.json, shown > 0)
            if what == "event":
                track(active, payload)
            if live and active:
                stream_out.write(countdown(active))
            stream_out.flush()
            if args.count and shown >= args.count:
                return EXIT_OK
    except KeyboardInterrupt:
        return EXIT_OK
    finally:
        reader.stop.set()
        jobs.stop.set()
        if live:
            stream_out.write("\n")


def cmd_drill(args: argparse.Namespace) -> int:
    try:
        if args.clear:
            doc = request_json("DELETE", f"/v1/drills/{args.clear}", socket_path=args.socket)
            print(f"cleared drill {doc['notice']['id']}")
            return EXIT_OK
        body: dict[str, Any] = {"kind": args.kind, "in_s": args.lead}
        if args.severity:
            body["severity"] = args.severity
        if args.reason:
            body["reason"] = args.reason
        doc = request_json("POST", "/v1/drills", body, socket_path=args.socket)
    except AgentHTTPError as exc:
        print(fill(f"preemptd: drill refused: {exc}", indent="  "), file=sys.stderr)
        return 1
    except (AgentUnavailable, OSError) as exc:
        return _fail_no_agent(exc, args.socket)
    notice = doc["notice"]
    if args.json:
        print(json.dumps(notice))
    else:
        deadline = f"deadline {keep(when(notice['deadline']))}" if notice.get("deadline") else "no deadline"
        print(
            fill(
                f"drill {notice['id']}: {notice['kind']} with {deadline} ({format_duration(args.lead)} from now)",
                indent="  ",
            )
        )
    return EXIT_OK


def _duration_arg(text: str) -> float:
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def cmd_version(args: argparse.Namespace) -> int:
    print(f"preemptd {__version__} (Python {sys.version.split()[0]})")
    return EXIT_OK


def cmd_demo(args: argparse.Namespace) -> int:
    from agent.cli.demo import run_demo

    return run_demo(args)


def _add_status(subparsers: Any) -> None:
    p = subparsers.add_parser("status", help="show the agent's status")
    _socket_arg(p)
    p.add_argument("--json", action="store_true", help="print the raw status document")
    p.set_defaults(func=cmd_status)


def _add_watch(subparsers: Any) -> None:
    p = subparsers.add_parser("watch", help="stream notices as they happen, with a live countdown")
    _socket_arg(p)
    p.add_argument("--json", action="store_true", help="one JSON event per line (NDJSON)")
    p.add_argument("--count", type=int, default=0, help="exit after this many events")
    p.add_argument(
        "--wait",
        action="store_true",
        help="wait for the agent to appear instead of failing when none answers on the socket",
    )
    p.set_defaults(func=cmd_watch)


def _add_drill(subparsers: Any) -> None:
    p = subparsers.add_parser("drill", help="inject a drill notice to rehearse a checkpoint flush (admin)")
    _socket_arg(p)
    p.add_argument(
        "--kind",
        default="termination",
        choices=("termination", "rebalance", "maintenance", "gpu_fault", "gpu_degraded", "host_degraded"),
        metavar="KIND",  # the list of choices would make the usage line wider than 80 columns
        help="termination (default), rebalance, maintenance, gpu_fault, gpu_degraded or host_degraded",
    )
    p.add_argument(
        "--in",
        dest="lead",
        type=_duration_arg,
        default=120.0,
        metavar="DURATION",
        help="lead time before the deadline (default 2m)",
    )
    p.add_argument("--severity", choices=("info", "warning", "critical"))
    p.add_argument("--reason")
    p.add_argument("--clear", metavar="ID", help="clear an active drill instead")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_drill)


def _add_version(subparsers: Any) -> None:
    p = subparsers.add_parser("version", help="print the version")
    p.set_defaults(func=cmd_version)


def _add_demo(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "demo", help="run the agent on a simulated cloud that sends a spot termination notice"
    )
    p.add_argument("--socket", type=Path, help="socket for the demo agent (default: the per-user socket)")
    p.add_argument(
        "--after",
        type=_duration_arg,
        default=5.0,
        metavar="DURATION",
        help="when the notice arrives (default 5s)",
    )
    p.add_argument(
        "--lead",
        type=_duration_arg,
        default=20.0,
        metavar="DURATION",
        help="notice lead time (default 20s; AWS gives 2m)",
    )
    p.add_argument("--keep", action="store_true", help="keep running after the notice's deadline")
    p.add_argument(
        "--job",
        type=Path,
        metavar="SCRIPT",
        help="the training script (default: examples/fault_tolerant_training.py where PyTorch is "
        "installed, examples/stdlib_training.py where it is not; it takes the examples' options and prints "
        "their JSON progress lines)",
    )
    p.set_defaults(func=cmd_demo)


def build_parser(verb: str | None = None) -> argparse.ArgumentParser:
    """The whole command line; with ``verb`` (the verb about to run, or "" for none), the extension verbs
    other than ``verb`` are listed by name and summary without importing their modules."""
    parser = argparse.ArgumentParser(
        prog="preemptd", description="Warn GPU training jobs before their host goes away."
    )
    parser.add_argument("--version", action="version", version=f"preemptd {__version__}")
    subparsers = parser.add_subparsers(dest="verb", metavar="VERB")
    _add_run(subparsers)
    _add_status(subparsers)
    _add_watch(subparsers)
    _add_drill(subparsers)
    _add_version(subparsers)
    _add_demo(subparsers)

    for name, module_name in _EXTENSIONS.items():
        if verb is None or verb == name:
            importlib.import_module(module_name).register(subparsers)
        else:
            subparsers.add_parser(name, help=cli_help.VERBS[name].summary)
    cli_help.apply(subparsers)
    return parser


def _verb_in(argv: Sequence[str]) -> str:
    """The verb on a command line ("" for none): the first word that is not a flag, since the top-level
    flags (--help, --version) take no value."""
    return next((word for word in argv if not word.startswith("-")), "")


def main(argv: Sequence[str] | None = None) -> int:
    args_in = list(sys.argv[1:] if argv is None else argv)
    if args_in[:1] == ["exec"]:  # wraps a job for its whole life: import only what it needs
        from agent.cli.exec import main as exec_main

        return exec_main(args_in[1:])
    parser = build_parser(_verb_in(args_in))
    args = cli_help.parse(parser, args_in)
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_USAGE
    if os.environ.get("PREEMPTD_SOCKET") == "":
        os.environ.pop("PREEMPTD_SOCKET")
    try:
        result: int = args.func(args)
        sys.stdout.flush()
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # the reader went away (`preemptd status --json | head`)
        return cli_help.reader_gone()
    return result


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
