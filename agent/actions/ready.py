"""The ``ready`` step: clients that declared themselves participants (``client.participant`` in a report: a
``participant``/``registered`` report when their watcher connects, or any checkpoint report) report their
emergency checkpoint finished; once all that were alive at the notice have, or a grace runs out
(never later than a margin before the deadline), the agent publishes ``ready`` for the notice. On Azure the
event is then acknowledged to the platform (``StartRequests``), at ready, at once, or never.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import psutil

from agent.actions.common import OwnedTasks, Recent, applies, log
from agent.config import ReadyConfig
from agent.core.notice import Event, EventType, Notice, format_time, utcnow
from agent.core.reports import Report
from agent.core.tasks import TaskSet

Publish = Callable[[str, Mapping[str, Any]], Any]
# A participant: the uid that registered it (SO_PEERCRED) and its name. Names live in their owner's
# namespace, so nobody can take a name before its owner's job starts (squatting).
Owned = tuple[int | None, str]


def participant_key(report: Report) -> str:
    """The name a report gives: ``job#rank`` for a distributed job, else ``name@pid``."""
    client = report.client
    if "job" in client and "rank" in client:
        return f"{client['job']}#{client['rank']}"
    pid = report.peer_pid or client.get("pid")
    name = client.get("name") or "client"
    return f"{name}@{pid}" if pid else str(name)


# How many participant names status lists; the rest are counted.
STATUS_SAMPLE = 20


def labels(owned: set[Owned]) -> dict[Owned, str]:
    """How participants are shown: by name, and with the uid where two uids hold the same name."""
    uids: dict[str, int] = {}
    for _, name in owned:
        uids[name] = uids.get(name, 0) + 1
    return {(uid, name): name if uids[name] == 1 else f"{name} (uid {uid})" for uid, name in owned}


@dataclass
class Participant:
    """A registration: the name ``key`` in the namespace of ``uid`` (the registering peer's, from
    SO_PEERCRED); it counts while the registering process (``pid``, started at ``started``) lives and it
    keeps reporting."""

    key: str
    pid: int | None
    last_seen: datetime
    client: Mapping[str, Any]
    uid: int | None = None
    started: float | None = None

    def alive(self, now: datetime, ttl: timedelta) -> bool:
        if now - self.last_seen > ttl:
            return False
        if self.pid is None:
            return True
        try:
            # The start time tells the registering process from a later one that got its pid.
            if self.started is None:
                return bool(psutil.pid_exists(self.pid))
            return bool(psutil.Process(self.pid).create_time() == self.started)
        except psutil.Error:
            return False


def _process_start(pid: int | None) -> float | None:
    try:
        return float(psutil.Process(pid).create_time()) if pid is not None else None
    except psutil.Error:
        return None


@dataclass
class Pending:
    notice: Notice
    expected: set[Owned]
    started: float
    cutoff_s: float
    done: dict[Owned, str] = field(default_factory=dict)
    ready_at: datetime | None = None
    data: dict[str, Any] = field(default_factory=dict)
    timer: asyncio.Task[Any] | None = None
    cleared: bool = False

    @property
    def waiting(self) -> bool:
        return self.ready_at is None and not self.cleared

    def outcome(self) -> dict[str, list[str]]:
        """The participants by name (the uid added where two hold one name): all, finished, failed,
        missing."""
        shown = labels(self.expected | set(self.done))

        def names(keys: Any) -> list[str]:
            return sorted(shown[k] for k in keys)

        return {
            "participants": names(self.expected),
            "finished": names(k for k, v in self.done.items() if v == "finished"),
            "failed": names(k for k, v in self.done.items() if v == "failed"),
            "missing": names(self.expected - set(self.done)),
        }

    def to_json(self) -> dict[str, Any]:
        outcome = self.outcome()
        doc: dict[str, Any] = {
            "kind": self.notice.kind.value,
            "state": "cleared"
            if self.cleared and self.ready_at is None
            else "ready"
            if self.ready_at
            else "waiting",
            **{key: names[:STATUS_SAMPLE] for key, names in outcome.items()},
            "counts": {
                "participants": len(self.expected),
                "finished": sum(1 for v in self.done.values() if v == "finished"),
                "failed": sum(1 for v in self.done.values() if v == "failed"),
                "missing": len(self.expected - set(self.done)),
            },
            "grace_s": round(self.cutoff_s, 3),
        }
        if self.ready_at is not None:
            doc["ready_at"] = format_time(self.ready_at)
            doc.update(
                {k: self.data[k] for k in ("reason", "notice_to_ready_s", "margin_s") if k in self.data}
            )
        return doc


class ReadyEngine(OwnedTasks):
    """Tracks participants and, per matching notice, who has saved; publishes ``ready`` once per notice.
    A :class:`agent.core.ports.Reactor` named ``ready``."""

    name = "ready"

    def __init__(self, config: ReadyConfig, *, publish: Publish, tasks: TaskSet, history: int = 100) -> None:
        self.config = config
        self._publish = publish
        self._tasks = tasks
        self._participants: dict[Owned, Participant] = {}
        self._pending: dict[str, Pending] = {}
        self._history = max(1, history)
        # The data of the last ready event seen (for the last-ready metrics).
        self.last_ready: dict[str, Any] = {}

    # --- reactor contract ---------------------------------------------------------------------------

    def handle(self, event: Event) -> None:
        if event.type is EventType.READY:
            self.last_ready = dict(event.data)
        self.on_event(event)

    async def stop(self, timeout: float) -> None:
        # Grace timers only wait: nothing is lost by cancelling them at once.
        await self._tasks.close(0)

    def carry_over(self, previous: object) -> None:
        """After a reload: keep the participants and the notices being waited for (their timers stay with
        the previous instance's tasks and declare through the same records)."""
        if isinstance(previous, ReadyEngine):
            self._participants = previous._participants
            self._pending = previous._pending
            self.last_ready = previous.last_ready

    # --- inputs -------------------------------------------------------------------------------------

    def refusal(self, report: Report, privileged: bool) -> tuple[int, str] | None:
        """Why ``report`` must be refused, as (HTTP status, reason), or None. A registration is always in
        the registering uid's own namespace (bounded per uid and in all); a report for a name only other
        uids hold is refused, but from root and the admin group, when one uid holds it."""
        key = participant_key(report)
        registering = report.client.get("participant") is True
        others = sorted((uid for uid in self._owners(key) if uid != report.peer_uid), key=str)
        if not registering and others and not self._known((report.peer_uid, key)):
            holders = ", ".join(str(uid) for uid in others)
            if not privileged:
                return 403, (
                    f"participant {key!r} belongs to uid {holders}; uid {report.peer_uid} may not report for"
                    " it (only its owner, root and the admin group may); to take part, register your own"
                    " (client.participant: true)"
                )
            if len(others) > 1:
                return 409, (
                    f"participant {key!r} is registered by uids {holders}; only each owner may report for"
                    " its own"
                )
        if not registering or (report.peer_uid, key) in self._participants:
            return None
        cfg = self.config
        if len(self._participants) >= cfg.max_participants:
            self._prune(utcnow())
            if len(self._participants) >= cfg.max_participants:
                return 429, (
                    f"{len(self._participants)} participants are registered, the limit is "
                    f"{cfg.max_participants} (actions.ready.max_participants)"
                )
        mine = sum(1 for p in self._participants.values() if p.uid == report.peer_uid)
        if mine >= cfg.max_participants_per_uid:
            self._prune(utcnow())
            mine = sum(1 for p in self._participants.values() if p.uid == report.peer_uid)
            if mine >= cfg.max_participants_per_uid:
                return 429, (
                    f"uid {report.peer_uid} has {mine} participants registered, the limit is "
                    f"{cfg.max_participants_per_uid} (actions.ready.max_participants_per_uid)"
                )
        return None

    def _owners(self, key: str) -> set[int | None]:
        """The uids that hold the name ``key``: registered, or awaited by a notice."""
        owners = {uid for uid, name in self._participants if name == key}
        for pending in self._pending.values():
            if pending.waiting:
                owners.update(uid for uid, name in pending.expected if name == key)
        return owners

    def _known(self, owned: Owned) -> bool:
        return owned in self._participants or any(
            p.waiting and owned in p.expected for p in self._pending.values()
        )

    def _target(self, report: Report) -> Owned:
        """The participant a report is about: the peer's own, or (from root or the admin group, which
        :meth:`refusal` let through) the one other uid's that holds the name."""
        key = participant_key(report)
        mine = (report.peer_uid, key)
        if report.client.get("participant") is True or self._known(mine):
            return mine
        others = self._owners(key) - {report.peer_uid}
        return (others.pop(), key) if len(others) == 1 else mine

    def _prune(self, now: datetime) -> None:
        """Forget registrations whose process is gone or that lapsed."""
        ttl = timedelta(seconds=self.config.participant_ttl_s)
        for key, who in list(self._participants.items()):
            if not who.alive(now, ttl):
                del self._participants[key]

    def on_report(self, report: Report) -> None:
        key = self._target(report)
        if report.client.get("participant") is True:
            # The peer's pid (SO_PEERCRED) is in the agent's PID namespace; the client's own may be a
            # container's.
            pid = report.peer_pid or report.client.get("pid")
            current = self._participants.get(key)
            started = current.started if current is not None and current.pid == pid else _process_start(pid)
            self._participants[key] = Participant(
                key[1], pid, report.received_at, dict(report.client), uid=key[0], started=started
            )
        elif key in self._participants:
            self._participants[key].last_seen = report.received_at
        if report.kind == "participant":
            self._join_waiting(key)
            return
        if report.phase not in ("finished", "failed") or not report.emergency:
            return
        for pending in list(self._pending.values()):
            if pending.ready_at is not None or pending.cleared:
                continue
            if report.notice_id not in (None, pending.notice.id):
                continue
            if key not in pending.expected and key not in self._participants:
                continue  # a client that never declared itself is not waited for, nor counted
            pending.expected.add(key)
            pending.done[key] = report.phase
            log.info(
                "ready_participant_done",
                notice_id=pending.notice.id,
                participant=key[1],
                uid=key[0],
                phase=report.phase,
            )
            if pending.expected <= set(pending.done):
                self._declare(pending, "all_participants")

    def _join_waiting(self, key: Owned) -> None:
        """A process that registers while a notice is waited for (its registration raced the notice, or it
        started during it) has the notice in its snapshot and may be saving: wait for it too."""
        for pending in self._pending.values():
            if pending.waiting and key not in pending.expected:
                pending.expected.add(key)
                log.info(
                    "ready_participant_joined", notice_id=pending.notice.id, participant=key[1], uid=key[0]
                )

    def on_event(self, event: Event) -> None:
        notice = event.notice
        if notice is None or not self.config.enabled:
            return
        if event.type is EventType.CLEARED:
            pending = self._pending.get(notice.id)
            if pending is not None and pending.ready_at is None:
                pending.cleared = True
                if pending.timer is not None:
                    pending.timer.cancel("notice cleared")
            return
        if event.type not in (EventType.NOTICE, EventType.UPDATE) or notice.id in self._pending:
            return
        cfg = self.config
        if not applies(notice, cfg.kinds, cfg.min_severity, True):
            return
        self._start(notice)

    # --- lifecycle ----------------------------------------------------------------------------------

    def _start(self, notice: Notice) -> None:
        now = utcnow()
        self._prune(now)
        expected = set(self._participants)
        cutoff = self.config.grace_s
        if notice.deadline is not None:
            cutoff = min(cutoff, (notice.deadline - now).total_seconds() - self.config.deadline_margin_s)
        cutoff = max(0.0, cutoff)
        pending = Pending(notice=notice, expected=expected, started=time.monotonic(), cutoff_s=cutoff)
        self._pending[notice.id] = pending
        self._trim()
        log.info(
            "ready_waiting",
            notice_id=notice.id,
            participants=len(expected),
            sample=pending.outcome()["participants"][:STATUS_SAMPLE],
            grace_s=round(cutoff, 3),
        )
        # Even an immediate ready goes through a task: this runs inside the agent's dispatch of the notice
        # event, and every other listener must see the notice before anyone sees its ready.
        if not expected and self.config.without_participants == "immediately":
            delay, reason = 0.0, "no_participants"
        elif cutoff <= 0:
            delay, reason = 0.0, "deadline"
        else:
            delay, reason = cutoff, "grace" if expected else "no_participants"
        pending.timer = self._tasks.spawn(self._expire(pending, delay, reason), f"ready-grace:{notice.id}")

    async def _expire(self, pending: Pending, delay: float, reason: str) -> None:
        await asyncio.sleep(delay)
        if pending.ready_at is None and not pending.cleared:
            # A participant that joined during the wait makes it a grace that ran out.
            joined = reason == "no_participants" and delay > 0 and bool(pending.expected)
            self._declare(pending, "grace" if joined else reason)

    def _declare(self, pending: Pending, reason: str) -> None:
        if pending.timer is not None and pending.timer is not asyncio.current_task():
            pending.timer.cancel("ready")
        now = utcnow()
        notice = pending.notice
        pending.ready_at = now
        data: dict[str, Any] = {
            "reason": reason,
            **pending.outcome(),
            "notice_to_ready_s": round((now - notice.detected_at).total_seconds(), 3),
            "margin_s": round((notice.deadline - now).total_seconds(), 3) if notice.deadline else None,
        }
        pending.data = data
        # Logged once, as notice_ready, by the agent that publishes it.
        result = self._publish(notice.id, data)
        if inspect.isawaitable(result):
            self._tasks.spawn(_await(result), f"publish-ready:{notice.id}")

    def _trim(self) -> None:
        while len(self._pending) > self._history:
            oldest = next(iter(self._pending))
            if self._pending[oldest].ready_at is None and not self._pending[oldest].cleared:
                break
            del self._pending[oldest]

    def pending(self, notice_id: str) -> Pending | None:
        return self._pending.get(notice_id)

    def status(self) -> dict[str, Any]:
        """A summary: counts per uid, and the first few participants by name; not thousands of entries."""
        now = utcnow()
        ttl = timedelta(seconds=self.config.participant_ttl_s)
        live = sorted(
            (p for p in self._participants.values() if now - p.last_seen <= ttl), key=lambda p: p.key
        )
        by_uid: dict[str, int] = {}
        for p in live:
            by_uid[str(p.uid)] = by_uid.get(str(p.uid), 0) + 1
        return {
            "participants": [
                {"key": p.key, "pid": p.pid, "uid": p.uid, "last_seen": format_time(p.last_seen)}
                for p in live[:STATUS_SAMPLE]
            ],
            "participants_total": len(live),
            "participants_by_uid": by_uid,
            "limits": {
                "max_participants": self.config.max_participants,
                "max_participants_per_uid": self.config.max_participants_per_uid,
            },
            "notices": {notice_id: pending.to_json() for notice_id, pending in self._pending.items()},
        }


async def _await(result: Awaitable[Any]) -> None:
    await result


# --- Azure acknowledgement -----------------------------------------------------------------------------

EVENT_ID_KEYS = ("EventId", "event_id", "eventId")


def azure_event_id(notice: Notice) -> str | None:
    for key in EVENT_ID_KEYS:
        value = notice.detail.get(key)
        if isinstance(value, str) and value:
            return value
    return None


Acknowledge = Callable[[str], Any]


class AzureAcknowledger(OwnedTasks):
    """Sends ``StartRequests`` once per notice, through the ``azure_ack`` capability (``ack``: returns it,
    or None when no Azure source offers it now) or a source object's ``acknowledge(event_id)``. A
    :class:`agent.core.ports.Reactor` named ``azure_acknowledgement``."""

    name = "azure_acknowledgement"

    def __init__(
        self,
        mode: str,
        *,
        source: Callable[[str], Any] | None = None,
        ack: Callable[[], Acknowledge | None] | None = None,
        tasks: TaskSet,
        recent: Recent,
    ) -> None:
        self.mode = mode
        self._source = source
        self._ack = ack
        self._tasks = tasks
        self.recent = self._recent = recent
        self._done: set[str] = set()

    def status(self) -> dict[str, Any]:
        return {"mode": self.mode, "running": len(self._tasks), "acknowledged": len(self._done)}

    def carry_over(self, previous: object) -> None:
        if isinstance(previous, AzureAcknowledger):
            self._done |= previous._done

    def _acknowledger(self, source_name: str) -> Acknowledge | None:
        if self._ack is not None:
            return self._ack()
        source = self._source(source_name) if self._source is not None else None
        method = getattr(source, "acknowledge", None)
        return method if callable(method) else None

    def handle(self, event: Event, notice: Notice | None = None) -> None:
        notice = notice or event.notice
        # "cloud" is the source that found Azure by probing rather than by DMI; its notices carry EventIds.
        if notice is None or notice.source not in ("azure", "cloud") or self.mode == "never":
            return
        if notice.source == "cloud" and azure_event_id(notice) is None:
            return
        wanted = EventType.READY if self.mode == "on_ready" else EventType.NOTICE
        if event.type is not wanted or notice.id in self._done:
            return
        self._done.add(notice.id)
        self._tasks.spawn(self._acknowledge(notice), f"azure-ack:{notice.id}")

    async def _acknowledge(self, notice: Notice) -> None:
        event_id = azure_event_id(notice)
        record: dict[str, Any] = {"at": format_time(utcnow()), "notice_id": notice.id, "event_id": event_id}
        acknowledge = self._acknowledger(notice.source)
        if notice.drill:
            record["outcome"] = "skipped_drill"
        elif event_id is None:
            record.update(outcome="failed", error="the notice carries no Azure EventId")
        elif acknowledge is None:
            record.update(outcome="failed", error="no Azure source with acknowledge() is running")
        else:
            try:
                result = acknowledge(event_id)
                if inspect.isawaitable(result):
                    await result
                record["outcome"] = "sent"
            except Exception as exc:
                record.update(outcome="failed", error=f"{type(exc).__name__}: {exc}")
        self._recent.add(record)
        fields = {k: v for k, v in record.items() if k != "at"}
        if record["outcome"] == "failed":
            log.warning("azure_acknowledge_failed", **fields)
        else:
            log.info("azure_acknowledge", **fields)
