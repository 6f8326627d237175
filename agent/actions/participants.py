"""Who takes part in the ``ready`` step: the participants that registered (a name in the registering uid's
namespace, counted while its process lives and keeps reporting), the rules on who may register or report
for a name and how many, and how names are shown.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import psutil

from agent.config import ReadyConfig
from agent.core.notice import format_time, utcnow
from agent.core.reports import Report

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


class Participants:
    """The registrations, by (uid, name). ``awaited()`` gives the participants each notice still waits for:
    their names are held too, so that nobody takes one over while its owner is saving."""

    def __init__(self, config: ReadyConfig, awaited: Callable[[], Iterable[set[Owned]]]) -> None:
        self.config = config
        self.registered: dict[Owned, Participant] = {}
        self._awaited = awaited

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
        if not registering or (report.peer_uid, key) in self.registered:
            return None
        cfg = self.config
        if len(self.registered) >= cfg.max_participants:
            self.prune(utcnow())
            if len(self.registered) >= cfg.max_participants:
                return 429, (
                    f"{len(self.registered)} participants are registered, the limit is "
                    f"{cfg.max_participants} (actions.ready.max_participants)"
                )
        mine = sum(1 for p in self.registered.values() if p.uid == report.peer_uid)
        if mine >= cfg.max_participants_per_uid:
            self.prune(utcnow())
            mine = sum(1 for p in self.registered.values() if p.uid == report.peer_uid)
            if mine >= cfg.max_participants_per_uid:
                return 429, (
                    f"uid {report.peer_uid} has {mine} participants registered, the limit is "
                    f"{cfg.max_participants_per_uid} (actions.ready.max_participants_per_uid)"
                )
        return None

    def _owners(self, key: str) -> set[int | None]:
        """The uids that hold the name ``key``: registered, or awaited by a notice."""
        owners = {uid for uid, name in self.registered if name == key}
        for expected in self._awaited():
            owners.update(uid for uid, name in expected if name == key)
        return owners

    def _known(self, owned: Owned) -> bool:
        return owned in self.registered or any(owned in expected for expected in self._awaited())

    def target(self, report: Report) -> Owned:
        """The participant a report is about: the peer's own, or (from root or the admin group, which
        :meth:`refusal` let through) the one other uid's that holds the name."""
        key = participant_key(report)
        mine = (report.peer_uid, key)
        if report.client.get("participant") is True or self._known(mine):
            return mine
        others = self._owners(key) - {report.peer_uid}
        return (others.pop(), key) if len(others) == 1 else mine

    def prune(self, now: datetime) -> None:
        """Forget registrations whose process is gone or that lapsed."""
        ttl = timedelta(seconds=self.config.participant_ttl_s)
        for key, who in list(self.registered.items()):
            if not who.alive(now, ttl):
                del self.registered[key]

    def record(self, report: Report) -> Owned:
        """Register the participant ``report`` declares, or note that a registered one was seen; returns the
        participant the report is about (:meth:`target`)."""
        key = self.target(report)
        if report.client.get("participant") is True:
            # The peer's pid (SO_PEERCRED) is in the agent's PID namespace; the client's own may be a
            # container's.
            pid = report.peer_pid or report.client.get("pid")
            current = self.registered.get(key)
            started = current.started if current is not None and current.pid == pid else _process_start(pid)
            self.registered[key] = Participant(
                key[1], pid, report.received_at, dict(report.client), uid=key[0], started=started
            )
        elif key in self.registered:
            self.registered[key].last_seen = report.received_at
        return key

    def status(self) -> dict[str, Any]:
        """A summary: counts per uid, and the first few participants by name; not thousands of entries."""
        now = utcnow()
        ttl = timedelta(seconds=self.config.participant_ttl_s)
        live = sorted((p for p in self.registered.values() if now - p.last_seen <= ttl), key=lambda p: p.key)
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
        }
