"""What ``preemptd VERB --help`` says beyond the flags: a description, examples and the exit statuses, kept
in one table so that every verb (built-in or registered by an extension module) answers the same way."""

from __future__ import annotations

import argparse
import os
import sys
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, what a shell reports for a tool whose reader went away


@dataclass(frozen=True)
class VerbHelp:
    description: str
    examples: tuple[str, ...]
    exits: tuple[tuple[int, str], ...]
    # The line in `preemptd --help`'s list of verbs, for the verbs that another module registers (the CLI
    # lists them without importing that module); the built-in verbs give theirs to add_parser.
    summary: str = ""

    def epilog(self) -> str:
        lines = ["examples:", *(f"  {line}" for line in self.examples), "", "exit status:"]
        # The raw formatter keeps this layout as it is, so long meanings are wrapped here, under themselves.
        lines += [
            textwrap.fill(meaning, width=78, initial_indent=f"  {code:<3} ", subsequent_indent=" " * 6)
            for code, meaning in self.exits
        ]
        return "\n".join(lines)


USAGE = (2, "bad usage: an unknown flag or a bad value (the verb's usage is shown)")
NO_AGENT = (69, "no agent answers on the socket (EX_UNAVAILABLE)")

VERBS: Mapping[str, VerbHelp] = {
    "run": VerbHelp(
        "Run the agent: watch the cloud's metadata service, the GPUs and the host, and tell training "
        "processes on the Unix socket before the host goes away. Normally started by systemd "
        "(preemptd.socket, preemptd.service).",
        (
            "preemptd run",
            "preemptd run --cloud aws --log-format console",
            "preemptd run --set api.heartbeat_s=5 --print-config",
        ),
        (
            (0, "stopped cleanly (SIGTERM, SIGINT)"),
            (
                2,
                "bad usage or a configuration error (file, key and reason on stderr; systemd does not restart)",
            ),
            (3, "another agent already serves this socket"),
        ),
    ),
    "status": VerbHelp(
        "Show the running agent's overall state, active notices, sources, subscribers and advice.",
        ("preemptd status", "preemptd status --json | jq .notices", "preemptd status || page-the-on-call"),
        (
            (0, "overall ok"),
            (1, "overall warning or critical: a notice is active or a source is failing"),
            USAGE,
            NO_AGENT,
        ),
    ),
    "watch": VerbHelp(
        "Stream events as they happen in lines that fit 80 columns (--json: the full objects, one per line), "
        "with a live countdown to the deadline on a terminal, and each change of an elastic job's membership "
        "(job llm: shrank 3→2 in 0.47 s at step 1234), which --count does not count. Fails at once when no agent answers on the "
        "socket (--wait waits for one to appear); once connected, it resumes after a restart of the agent.",
        (
            "preemptd watch",
            "preemptd watch --json | jq .notice.deadline",
            "preemptd watch --wait --count 1",
        ),
        ((0, "--count events shown, or interrupted (Ctrl-C)"), USAGE, NO_AGENT),
    ),
    "drill": VerbHelp(
        "Inject a drill notice to rehearse a checkpoint flush end to end (root, the agent's own user or the "
        "admin group). Drills are marked as such and never acknowledged to a cloud.",
        ("preemptd drill --in 2m", "preemptd drill --kind maintenance --in 30s", "preemptd drill --clear ID"),
        (
            (0, "the drill was injected (or cleared)"),
            (1, "the agent refused it (see the message)"),
            USAGE,
            NO_AGENT,
        ),
    ),
    "version": VerbHelp(
        "Print preemptd's version and the Python it runs on.",
        ("preemptd version",),
        ((0, "always"),),
    ),
    "demo": VerbHelp(
        "Run the whole flow on this machine: the agent on a simulated EC2 metadata service that sends a "
        "spot termination notice.",
        ("preemptd demo", "preemptd demo --lead 30s", "preemptd demo --after 2s --keep"),
        (
            (0, "the demo ran to its end"),
            (1, "it could not run (the message says why)"),
            USAGE,
            (130, "interrupted"),
        ),
    ),
    "advise": VerbHelp(
        "Advise the checkpoint interval that wastes the least GPU time: live from the agent's measurements, "
        "or offline from a save time and a mean time between interruptions.",
        (
            "preemptd advise",
            "preemptd advise --save-time 4m --mtbp 6h --current 30m",
            "preemptd advise --save-time 90s --mtbp 2d --plot waste.png --json",
        ),
        ((0, "advice given"), (1, "nothing to plot or simulate, or the plot failed"), USAGE, NO_AGENT),
        summary="checkpoint interval advice: live from the agent, or offline from --save-time and --mtbp",
    ),
    "simulate": VerbHelp(
        "Serve a cloud's metadata protocol on loopback (aws, gcp, azure, alibaba, tencent), play scenarios and "
        "inject faults through the /_sim/ control API, to rehearse a preemption with your own training stack.",
        (
            "preemptd simulate aws --scenario spot-termination",
            "preemptd simulate gcp --upcoming-idle no-notifications-503",
            "preemptd simulate azure --list-scenarios",
        ),
        (
            (0, "stopped (SIGINT, SIGTERM)"),
            (1, "cannot listen on the address"),
            (2, "bad usage or unknown scenario"),
        ),
        summary="serve a simulated cloud metadata service (aws, gcp, azure, alibaba, tencent) on 127.0.0.1",
    ),
    "exec": VerbHelp(
        "Run a training command (torchrun, srun, python) in its own process group, forward signals to it and "
        "exit with its status; when it fails after one of its processes committed an emergency checkpoint "
        "for a notice, exit 75 so the scheduler requeues the job (torchrun alone would exit 1). Nothing the "
        "command started outlives exec: what is left when it ends gets SIGTERM, then SIGKILL after "
        "--stop-grace seconds, and a killed exec takes the whole tree with it. A first SIGTERM that comes "
        "during a termination notice, before the command has recorded its emergency checkpoint, is held "
        "back until it has (at most --hold-max seconds, never past the notice's deadline; --no-hold passes "
        "it at once), so torchrun's 30 s before SIGKILL start after the save.",
        (
            "preemptd exec -- torchrun --nproc-per-node 8 train.py",
            "preemptd exec --hold-max 60 -- torchrun --nproc-per-node 8 train.py",
            "preemptd exec --stop-grace 30 -- srun python train.py",
            "preemptd exec --no-group -- python train.py",
        ),
        (
            (0, "the command succeeded"),
            (
                75,
                "it stopped for a notice after a committed emergency checkpoint (or an earlier committed step "
                "when the emergency save failed): requeue it (EX_TEMPFAIL)",
            ),
            (2, "bad usage (no command)"),
            (126, "the command cannot run; 127: not found; otherwise the command's own status"),
        ),
        summary="run a training command; exit 75 when it stopped for a notice after an emergency checkpoint",
    ),
    "report": VerbHelp(
        "Report what preemption cost on this host, per job and in total, from the agent's ledger (or the "
        "ledger file when no agent answers): interruptions, flushes, GPU-hours redone and checkpointing, "
        "goodput, and with [cost] prices the realised discount and the break-even preemption rate.",
        (
            "preemptd report",
            "preemptd report --since 30d --job 4711 --json",
            "preemptd report --prices prices.toml --html report.html",
        ),
        (
            (0, "reported"),
            (1, "the ledger or the output file could not be read or written, or no plot without matplotlib"),
            USAGE,
            (69, "no agent answers and there is no ledger file to read (EX_UNAVAILABLE)"),
        ),
        summary="what preemption cost: interruptions, flushes, GPU-hours redone, discount, break-even",
    ),
}


def apply(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Give every registered verb its description, examples and exit statuses."""
    for name, parser in subparsers.choices.items():
        describe(name, parser)


def describe(name: str, parser: argparse.ArgumentParser) -> None:
    """Give one verb's parser (also one built outside the CLI, as ``preemptd exec`` does) its help."""
    verb = VERBS.get(name)
    if verb is None:
        return
    # The raw formatter keeps the epilog's layout, so the description is wrapped here for 80 columns.
    parser.description = textwrap.fill(verb.description, width=78)
    parser.epilog = verb.epilog()
    parser.formatter_class = argparse.RawDescriptionHelpFormatter


def verb_parser(parser: argparse.ArgumentParser, verb: str | None) -> argparse.ArgumentParser:
    """The sub-parser of ``verb``, or ``parser`` itself when there is none."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and verb in action.choices:
            found: argparse.ArgumentParser = action.choices[verb]
            return found
    return parser


def parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse the command line; an unknown flag is reported with the usage of the verb it follows (argparse
    would blame the top-level parser)."""
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        verb_parser(parser, getattr(args, "verb", None)).error(f"unrecognized arguments: {' '.join(unknown)}")
    return args


def reader_gone() -> int:
    """Stop quietly once stdout's reader has gone, as cat would: point stdout at /dev/null so that the
    interpreter's final flush does not raise again."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return EXIT_BROKEN_PIPE
