"""``preemptd simulate <cloud>``: serve a simulated metadata service on loopback, optionally playing a
scenario, until interrupted. Point the agent (or any cloud SDK) at the printed URL."""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
from pathlib import Path
from typing import Any

# The simulators (agent.simulate, built on aiohttp) are imported when the verb runs, not when the CLI builds
# its parser: `preemptd status` must not pay for them. So the cloud is checked when the verb runs, against
# agent.simulate.SIMULATORS (which also has the clouds installed as plug-ins); the help names the built-in ones
# (a test checks it against the registry).
BUILTIN_HELP = "aws, gcp, azure, alibaba, tencent"


def endpoint_hint(cloud: str, url: str) -> str:
    """The environment that points the agent at the simulator of ``cloud`` at ``url``."""
    return f"PREEMPTD_CLOUD={cloud} PREEMPTD_{cloud.upper()}__ENDPOINT={url}"


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "simulate",
        help=f"serve a simulated cloud metadata service ({BUILTIN_HELP}) on 127.0.0.1",
        description="Serve a cloud's metadata protocol on loopback, play scenarios and inject faults through "
        "the /_sim/ control API (see `curl URL/_sim/scenarios`).",
    )
    add_arguments(p)
    p.set_defaults(func=cmd_simulate)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "cloud",
        metavar="CLOUD",
        help=f"the cloud whose metadata service to serve: {BUILTIN_HELP}, or an installed plug-in's",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=0, help="port (default: any free port, printed)")
    p.add_argument("--scenario", help="scenario to play (see --list-scenarios)")
    p.add_argument("--after", type=float, default=5.0, help="seconds before the scenario's first step")
    p.add_argument("--list-scenarios", action="store_true", help="list the cloud's scenarios and exit")
    p.add_argument("--port-file", type=Path, help="write the bound port to this file once listening")
    p.add_argument("--imdsv1", action="store_true", help="aws: also answer requests without a token")
    p.add_argument(
        "--empty-maintenance",
        # "empty" rather than "[]": argparse mangles brackets in its usage line ("{,404}"); "[]" still works.
        type=lambda text: "empty" if text == "[]" else text,
        choices=("empty", "404"),
        help="aws: the scheduled-events answer when none is scheduled: an empty list [] (default) or 404",
    )
    p.add_argument("--vm-name", help="azure: this VM's name (default gpu-trainer-0)")
    p.add_argument("--not-before-format", choices=("rfc1123", "iso"), help="azure: NotBefore layout")
    p.add_argument(
        "--instance-metadata",
        choices=("serve", "absent", "throttled"),
        metavar="ANSWER",
        help="azure: what /metadata/instance answers: serve (the document, default), absent (404, as "
        "Microsoft's Scheduled Events mock) or throttled (429)",
    )
    p.add_argument("--no-upcoming", action="store_true", help="gcp: no upcoming-maintenance endpoint (404)")
    p.add_argument(
        "--upcoming-idle",
        choices=("empty", "no-notifications", "no-notifications-503"),
        metavar="ANSWER",  # the list of choices would make the usage line wider than 80 columns
        help="gcp: the upcoming-maintenance answer when nothing is scheduled: empty ({}), no-notifications "
        '(the "no notifications" error with 200) or no-notifications-503 (the same with 503)',
    )
    p.add_argument("--hardened", action="store_true", help="alibaba: require a metadata token")


def _options(args: argparse.Namespace) -> dict[str, Any]:
    options: dict[str, Any] = {"host": args.host, "port": args.port}
    cloud = args.cloud
    if cloud == "aws":
        options["imdsv1"] = args.imdsv1
        if args.empty_maintenance:
            options["empty_maintenance"] = "[]" if args.empty_maintenance == "empty" else "404"
    elif cloud == "azure":
        if args.vm_name:
            options["vm_name"] = args.vm_name
        if args.not_before_format:
            options["not_before_format"] = args.not_before_format
        if args.instance_metadata:
            options["instance"] = args.instance_metadata
    elif cloud == "gcp":
        options["offer_upcoming"] = not args.no_upcoming
        if args.upcoming_idle:
            options["upcoming_idle"] = args.upcoming_idle
    elif cloud == "alibaba":
        options["hardened"] = args.hardened
    return options


async def serve(args: argparse.Namespace) -> int:
    from agent.simulate import SimulatorError, simulator_for

    sim = simulator_for(args.cloud, **_options(args))
    if args.scenario and args.scenario not in sim.scenarios:
        raise SimulatorError(
            f"unknown scenario {args.scenario!r}; {args.cloud} has: {', '.join(sim.scenarios)}"
        )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    port = await sim.start()
    try:
        url = sim.url
        print(f"preemptd simulate {args.cloud}: listening on {url}", flush=True)
        print(f"  run the agent against it:  {endpoint_hint(args.cloud, url)} preemptd run", flush=True)
        if sim.client_hint:
            sdk = sim.client_hint.format(url=url, hostport=f"{args.host}:{port}")
            print(f"  the cloud's own SDKs:  {sdk}", flush=True)
        print(f"  control: curl {url}/_sim/state ; curl -X POST {url}/_sim/event -d '{{...}}'", flush=True)
        if args.port_file:
            args.port_file.write_text(f"{port}\n")
        if args.scenario:
            sim.play(args.scenario, args.after)
            print(f"  playing {args.scenario!r}: {sim.scenarios[args.scenario].description}", flush=True)
        await stop.wait()
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)
        await sim.stop()
    return 0


def cmd_simulate(args: argparse.Namespace) -> int:
    from agent.simulate import SIMULATORS, SimulatorError

    try:
        if args.list_scenarios:
            found = SIMULATORS.available()
            if args.cloud not in found:
                raise SimulatorError(f"no simulator for {args.cloud!r}; choose one of {', '.join(found)}")
            scenarios = found[args.cloud].scenarios
            print(json.dumps({name: s.description for name, s in sorted(scenarios.items())}, indent=2))
            return 0
        return asyncio.run(serve(args))
    except SimulatorError as exc:
        print(f"preemptd simulate: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(
            f"preemptd simulate: cannot listen on {args.host}:{args.port}: {exc.strerror or exc}",
            file=sys.stderr,
        )
        return 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m agent.simulate", description=__doc__)
    add_arguments(parser)
    return cmd_simulate(parser.parse_args(argv))
