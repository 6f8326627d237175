"""Pure: the effective notice window (docs/window.md). Per notice kind, the cloud's lead and each limit found on
this host (a launcher that kills its workers soon after SIGTERM, a pod's grace period, Slurm's KillWait), the
shortest of them (the one that binds) and whether the predicted emergency flush fits in it; the status
section, its terminal lines and the metric values. The gathering is :mod:`agent.window.component`'s; the
limits parts offer come through :mod:`agent.window.limits`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from agent.core.notice import Kind, Notice, format_time
from agent.core.reports import Report
from agent.core.screen import WIDTH, duration, keep, wrap
from agent.window.limits import Limit

if TYPE_CHECKING:  # the status screens import this module; the cloud registry is the daemon's
    from agent.sources.clouds import Lead as CloudLead

# torchrun (torch.distributed.elastic) SIGKILLs its workers this long after it receives SIGTERM (the
# ``timeout=30`` of LocalElasticAgent._shutdown; not configurable).
TORCHRUN_KILL_S = 30.0
# ``preemptd exec``'s default ``--hold-max`` (agent.cli.exec_hold.HOLD_MAX_S; exec imports nothing of this).
EXEC_HOLD_MAX_S = 90.0

# The kinds a cloud gives notice of, in the order shown.
KINDS = (Kind.TERMINATION.value, Kind.MAINTENANCE.value, Kind.REBALANCE.value)

HINT_PEER = 'the peer tier (ShardedStore(tier="peer")) moves the emergency step into other hosts\' RAM, a shorter flush'


@dataclass(frozen=True)
class Lead:
    """The cloud's notice for one kind: ``seconds`` None when the cloud gives no figure (``deadline`` False:
    an advisory notice with no deadline, AWS's rebalance recommendation); ``notice``: the id of the active
    notice whose own lead it is (:func:`notice_leads`), None for the cloud's usual figure."""

    kind: str
    seconds: float | None
    source: str
    deadline: bool = True
    lengthen: str = ""
    notice: str | None = None


def cloud_leads(cloud: str | None, said: Sequence[CloudLead] = ()) -> list[Lead]:
    """The notice each kind gets on ``cloud``, as its spec says (``said``: ``CloudSpec.leads`` of its table,
    shared/reference/clouds.md); without one, no known notice."""
    t, m, _ = KINDS
    if said:
        return [Lead(c.kind, c.seconds, c.source, c.deadline, _lengthen(c)) for c in said]
    where = cloud or "unknown"
    return [
        Lead(t, None, f"cloud {where}: no known notice"),
        Lead(m, None, f"cloud {where}: no known notice"),
    ]


def _lengthen(lead: CloudLead) -> str:
    if lead.fixed:
        return f"the cloud's notice is fixed; {HINT_PEER}"
    return f"{lead.lengthen}; {HINT_PEER}" if lead.lengthen else ""


def notice_leads(leads: Sequence[Lead], notices: Iterable[Notice]) -> list[Lead]:
    """``leads`` with each kind that has an active notice with a deadline given that notice's own lead (its
    deadline less the time it was detected; the shortest when there are several): the notice says how long
    the job gets, where the cloud's usual figure only says what to expect (a drill, a simulated or an early
    AWS notice of 20 s is 20 s, not the 2 minutes AWS usually gives)."""
    shortest: dict[str, tuple[float, Notice]] = {}
    for notice in notices:
        if notice.deadline is None or notice.cleared_at is not None:
            continue
        seconds = round(max(0.0, (notice.deadline - notice.detected_at).total_seconds()), 3)
        kind = notice.kind.value
        if kind not in shortest or seconds < shortest[kind][0]:
            shortest[kind] = (seconds, notice)
    found = []
    for lead in leads:
        if lead.kind not in shortest:
            found.append(lead)
            continue
        seconds, notice = shortest.pop(lead.kind)
        source = (
            f"the active {lead.kind} notice {notice.id} from {notice.source}: its deadline {seconds:g} s after "
            "it was detected"
        )
        found.append(Lead(lead.kind, seconds, source, lengthen=lead.lengthen, notice=notice.id))
    return found


# ----- the predicted flush -----------------------------------------------------------------------------------

# Clients remembered for their deadline-budget predictions; durations kept per sort of save.
MAX_CLIENTS = 256
RECENT = 3


@dataclass(frozen=True)
class Flush:
    """How long the emergency flush is predicted to take, and from what."""

    seconds: float | None
    source: str
    tier: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"seconds": self.seconds, "source": self.source, "tier": self.tier}


class FlushBook:
    """What the clients' reports say about the flush: the deadline budget's newest prediction
    (``flush.predicted_s``, the slowest of that process's last three saves), the largest among the processes
    of the job that reported one last; else the slowest of the last three emergency saves, else of the last
    three periodic ones (the same rule), else ``fallback_s`` (``advisor.save_time_s``)."""

    def __init__(self) -> None:
        self.predictions: dict[str, dict[str, float]] = {}  # job → process → seconds; the newest job last
        self.emergency: deque[float] = deque(maxlen=RECENT)
        self.periodic: deque[float] = deque(maxlen=RECENT)
        self.tier: str | None = None

    def add(self, report: Report) -> bool:
        """Take what ``report`` says; whether anything changed."""
        if report.kind != "checkpoint":
            return False
        changed = False
        predicted = report.flush.get("predicted_s")
        if isinstance(predicted, (int, float)):
            job = str(report.client.get("job", ""))
            who = f"{report.client.get('host', '')}/{report.client.get('rank', '')}@{report.peer_pid}"
            processes = self.predictions.pop(job, {})
            processes.pop(who, None)
            processes[who] = float(predicted)
            while len(processes) > MAX_CLIENTS:
                del processes[next(iter(processes))]
            self.predictions[job] = processes
            while len(self.predictions) > MAX_CLIENTS:
                del self.predictions[next(iter(self.predictions))]
            changed = True
        tier = report.flush.get("tier")
        if isinstance(tier, str) and report.emergency:
            changed, self.tier = changed or tier != self.tier, tier
        if report.phase == "finished" and report.duration_s is not None:
            (self.emergency if report.emergency else self.periodic).append(float(report.duration_s))
            changed = True
        return changed

    def predict(self, fallback_s: float | None = None) -> Flush:
        if self.predictions:
            job, processes = next(reversed(self.predictions.items()))
            named = f" of job {job}" if job else ""
            return Flush(max(processes.values()), f"deadline budget{named} (clients' predicted_s)", self.tier)
        if self.emergency:
            return Flush(
                max(self.emergency), f"slowest of the last {len(self.emergency)} emergency saves", self.tier
            )
        if self.periodic:
            return Flush(
                max(self.periodic), f"slowest of the last {len(self.periodic)} periodic saves", self.tier
            )
        if fallback_s is not None:
            return Flush(fallback_s, "advisor.save_time_s", self.tier)
        return Flush(None, "no checkpoint reported yet", self.tier)


# ----- the window --------------------------------------------------------------------------------------------


def _applies(limit: Limit, kind: str) -> bool:
    return not limit.kinds or kind in limit.kinds


def kind_window(lead: Lead, limits: Sequence[Limit], flush: Flush) -> dict[str, Any]:
    """One kind's window: its lead, its limits, the shortest (``binding``) and the verdict."""
    applied = [limit for limit in limits if _applies(limit, lead.kind)] if lead.deadline else []
    doc: dict[str, Any] = {
        "cloud": {"seconds": lead.seconds, "source": lead.source, "deadline": lead.deadline},
        "limits": [limit.to_json() for limit in applied],
        "effective_s": None,
        "binding": None,
        "predicted_flush_s": flush.seconds,
        "fits": None,
        "window_too_short": False,
    }
    if lead.notice is not None:
        doc["cloud"]["notice"] = lead.notice
    if not lead.deadline:
        doc["note"] = "no deadline: nothing stops the job at this notice"
        return doc
    candidates = [(lead.seconds, "cloud", lead.lengthen)] if lead.seconds is not None else []
    candidates += [
        (limit.seconds, limit.name, limit.lengthen) for limit in applied if limit.seconds is not None
    ]
    unknown = [limit.name for limit in applied if limit.seconds is None]
    if unknown:
        doc["unknown"] = unknown
    if not candidates:
        return doc
    # The cloud first among equals: a host limit as long as the cloud's notice does not shorten it.
    seconds, binding, lengthen = min(candidates, key=lambda c: c[0] if c[0] is not None else float("inf"))
    doc["effective_s"], doc["binding"] = seconds, binding
    if flush.seconds is not None and seconds is not None:
        fits = flush.seconds <= seconds
        doc["fits"], doc["window_too_short"] = fits, not fits
        if not fits:
            hints = [lengthen] if lengthen else []
            if flush.tier != "peer" and HINT_PEER not in " ".join(hints):
                hints.append(HINT_PEER)
            doc["lengthen"] = "; ".join(hints)
    return doc


def build_window(
    leads: Sequence[Lead], limits: Sequence[Limit], flush: Flush, checked_at: datetime | None
) -> dict[str, Any]:
    """The ``window`` status section."""
    kinds = {lead.kind: kind_window(lead, limits, flush) for lead in leads}
    short = [
        {
            "kind": kind,
            "binding": doc["binding"],
            "effective_s": doc["effective_s"],
            "predicted_flush_s": doc["predicted_flush_s"],
            "lengthen": doc.get("lengthen", ""),
        }
        for kind, doc in kinds.items()
        if doc["window_too_short"]
    ]
    return {
        "state": "ok" if checked_at is not None else "starting",
        "checked_at": format_time(checked_at) if checked_at is not None else None,
        "predicted_flush": flush.to_json(),
        "limits": [limit.to_json() for limit in limits],
        "kinds": kinds,
        "window_too_short": bool(short),
        "warnings": short,
    }


def verdicts(doc: Mapping[str, Any]) -> dict[str, tuple[Any, ...]]:
    """Per kind what a log line is worth repeating for: (too short, binding, effective seconds)."""
    return {
        kind: (k.get("window_too_short"), k.get("binding"), k.get("effective_s"))
        for kind, k in (doc.get("kinds") or {}).items()
    }


def metric_values(doc: Mapping[str, Any]) -> tuple[list[tuple[str, str, float]], list[tuple[str, int]]]:
    """``(kind, limit, seconds)`` for ``preemptd_window_seconds`` (the cloud's as ``cloud``, the shortest as
    ``effective``) and ``(kind, 0|1)`` for ``preemptd_window_too_short``."""
    seconds: list[tuple[str, str, float]] = []
    short: list[tuple[str, int]] = []
    for kind, k in (doc.get("kinds") or {}).items():
        cloud = k["cloud"]
        if not cloud["deadline"]:
            continue
        if cloud["seconds"] is not None:
            seconds.append((kind, "cloud", float(cloud["seconds"])))
        for limit in k["limits"]:
            if limit["seconds"] is not None:
                seconds.append((kind, limit["name"], float(limit["seconds"])))
        if k["effective_s"] is not None:
            seconds.append((kind, "effective", float(k["effective_s"])))
        short.append((kind, 1 if k["window_too_short"] else 0))
    return seconds, short


def _s(value: Any) -> str:
    """Seconds as people read them, or "unknown"."""
    return "unknown" if not isinstance(value, (int, float)) else duration(float(value))


def _flush_words(flush: Mapping[str, Any]) -> str:
    """The predicted flush and where the figure comes from, or why there is none."""
    source = flush.get("source") or "no source given"
    if flush.get("seconds") is None:
        return f"flush not predicted: {source}"
    return f"predicted flush {_s(flush['seconds'])}, {source}"


_WARNING_LINES = 6  # of a window_too_short warning with its hint: the rest is in `preemptd status --json`


def window_lines(doc: Any, width: int = WIDTH) -> list[str]:
    """The window in ``preemptd status``, in lines of at most ``width`` columns: one row per kind, and each
    warning with what would lengthen the window. A kind whose lead is the active notice's own (not the
    cloud's usual figure) names the notice's lead ``notice``."""
    if not isinstance(doc, Mapping) or doc.get("state") != "ok":
        return []
    flush = doc.get("predicted_flush") or {}
    kinds = doc.get("kinds") or {}
    if not doc.get("limits") and all(k.get("cloud", {}).get("seconds") is None for k in kinds.values()):
        return wrap(f"Window: no limit known on this host ({_flush_words(flush)})", "", "    ", width)
    lines = wrap(f"Window ({_flush_words(flush)}):", "", "    ", width)
    lead_names: dict[str, str] = {}
    for kind, k in kinds.items():
        cloud = k.get("cloud") or {}
        if not cloud.get("deadline"):
            lines.append(f"  {kind:<12} no deadline")
            continue
        lead = lead_names[kind] = "notice" if cloud.get("notice") else "cloud"
        parts = [keep(f"{lead} {_s(cloud.get('seconds'))}")] + [
            keep(f"{limit['name']} {_s(limit['seconds'])}{' held' if limit.get('state') == 'held' else ''}")
            for limit in k.get("limits") or []
        ]
        if k.get("effective_s") is None:
            row = "no limit known"
        else:
            binding = lead if k.get("binding") == "cloud" else k.get("binding") or "a limit"
            verdict = {True: "fits", False: "TOO SHORT"}.get(k.get("fits"), "no flush predicted to compare")
            row = f"{_s(k['effective_s'])} ({binding} binds): {verdict}"
        lines += wrap(f"{kind:<12} {row}  [{', '.join(parts)}]", "  ", " " * 15, width)
    for warning in doc.get("warnings") or []:
        binding = warning.get("binding")
        if binding == "cloud":
            binding = lead_names.get(warning.get("kind"), "cloud")
        text = (
            f"window_too_short: {warning.get('kind')}: the flush ({_s(warning.get('predicted_flush_s'))}) "
            f"outlasts {binding} ({_s(warning.get('effective_s'))})"
        )
        if warning.get("lengthen"):
            text += f"; lengthen it: {warning['lengthen']}"
        lines += wrap(text, "  ", "    ", width, _WARNING_LINES)
    return lines


def launcher_limits(found: Iterable[tuple[str, int, str, bool, float | None]]) -> list[Limit]:
    """The ``torchrun`` limit from ``(participant, launcher pid, launcher, under preemptd exec, exec's hold
    or None)`` findings. Under an exec that holds an early SIGTERM until the emergency checkpoint is
    recorded, torchrun's 30 s start after the save, or at the latest ``--hold-max`` after the SIGTERM: the
    limit is held, that much longer."""
    found = list(found)
    if not found:
        return []
    launchers = sorted({pid for _, pid, _, _, _ in found})
    who = sorted({name for name, *_ in found})
    shown = ", ".join(who[:5]) + (f" and {len(who) - 5} more" if len(who) > 5 else "")
    under_exec = all(wrapped for _, _, _, wrapped, _ in found)
    holds = [hold for *_, hold in found]
    held = min(h for h in holds if h is not None) if all(h is not None for h in holds) else None
    source = f"torchrun (pid {', '.join(map(str, launchers[:5]))}) launches {shown}"
    if held is not None:
        return [
            Limit(
                "torchrun",
                held + TORCHRUN_KILL_S,
                source,
                lengthen=f"raise exec's --hold-max ({held:g} s): torchrun's 30 s start at the latest that long "
                "after an early SIGTERM",
                detail=f"held: preemptd exec holds an early SIGTERM until the emergency checkpoint is recorded "
                f"(at most --hold-max {held:g} s), then torchrun's {TORCHRUN_KILL_S:g} s start",
                held=True,
            )
        ]
    return [
        Limit(
            "torchrun",
            TORCHRUN_KILL_S,
            source,
            lengthen=(
                "torchrun SIGKILLs its workers 30 s after its own SIGTERM (not configurable): start the emergency "
                "save at the notice (the client's watcher), not at SIGTERM, and send SIGTERM to the launcher only "
                "after the notice's ready (the Slurm and Kubernetes bridges wait for it)"
                + (
                    "; drop exec's --no-hold so it holds an early SIGTERM until the emergency checkpoint is "
                    "recorded"
                    if under_exec
                    else "; run it as `preemptd exec -- torchrun ...`, which holds an early SIGTERM until the "
                    "emergency checkpoint is recorded and makes its exit say preempted"
                )
            ),
            detail="under preemptd exec, with --no-hold" if under_exec else "",
        )
    ]
