"""Pieces every action shares: which events a rule applies to, the event document, outcome counts, a bounded
record."""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Generic, Protocol, TypeVar

import structlog

from agent.core.notice import Event, EventType, Notice, Severity, format_time, utcnow
from agent.core.tasks import TaskSet

log = structlog.get_logger("preemptd.actions")

# Config trigger names for the event types that carry one notice.
TRIGGERS: Mapping[EventType, str] = {
    EventType.NOTICE: "notice",
    EventType.UPDATE: "update",
    EventType.CLEARED: "cleared",
    EventType.READY: "ready",
}


def applies(notice: Notice | None, kinds: Iterable[str], min_severity: str, drills: bool) -> bool:
    """Whether a rule with these filters applies to ``notice`` (an empty ``kinds`` means every kind)."""
    if notice is None:
        return False
    wanted = tuple(kinds)
    if wanted and notice.kind.value not in wanted:
        return False
    if notice.severity.rank < Severity(min_severity).rank:
        return False
    return drills or not notice.drill


def trigger_of(event: Event) -> str | None:
    return TRIGGERS.get(event.type)


class TriggeredRule(Protocol):
    """A configured action that runs on some events (a hook, a webhook)."""

    @property
    def on(self) -> Sequence[str]: ...

    @property
    def kinds(self) -> Sequence[str]: ...

    @property
    def min_severity(self) -> str: ...

    @property
    def drills(self) -> bool: ...


R = TypeVar("R", bound=TriggeredRule)


def wanting(rules: Iterable[R], event: Event, notice: Notice | None) -> Iterator[tuple[R, str]]:
    """The rules that want this event (its trigger in ``on``, the notice passing their filters), each with
    the trigger's name."""
    trigger = trigger_of(event)
    if trigger is None:
        return
    for rule in rules:
        if trigger in rule.on and applies(notice, rule.kinds, rule.min_severity, rule.drills):
            yield rule, trigger


C = TypeVar("C")


def checked_each(items: Iterable[C], check: Callable[[C, str], None], key: str) -> tuple[C, ...]:
    """``items`` after ``check(item, "<key>[<index>]")`` passed for each (it raises ConfigError)."""
    kept = tuple(items)
    for index, item in enumerate(kept):
        check(item, f"{key}[{index}]")
    return kept


class OwnedTasks:
    """The reactor lifecycle of an action whose work is the tasks it spawned: nothing to start, stopping
    lets them finish for the timeout and then cancels them."""

    _tasks: TaskSet

    async def start(self) -> None:
        pass

    async def stop(self, timeout: float) -> None:
        await self._tasks.close(timeout)

    async def drain(self) -> None:
        """Wait until every action started so far has finished (tests)."""
        await self._tasks.drain()


class RuleActions(OwnedTasks, Generic[R]):
    """An action that runs once for every configured rule that wants an event (hooks, webhooks): the
    trigger loop lives here, the action itself in :meth:`act`, which must only spawn owned tasks."""

    name: str
    rules: tuple[R, ...]
    outcomes: Outcomes

    def handle(
        self, event: Event, notice: Notice | None = None, doc: Mapping[str, Any] | None = None
    ) -> None:
        """Act for every rule that wants this event; ``doc`` (default: the event JSON) is what it is given."""
        notice = notice or event.notice
        for rule, trigger in wanting(self.rules, event, notice):
            doc = doc if doc is not None else event_document(event, notice)
            self.act(rule, trigger, notice, doc)

    def act(self, rule: R, trigger: str, notice: Notice | None, doc: Mapping[str, Any]) -> None:
        raise NotImplementedError

    def status(self) -> dict[str, Any]:
        return {
            self.name: len(self.rules),
            "running": len(self._tasks),
            "outcomes": dict(self.outcomes.counts),
        }


def event_document(event: Event, notice: Notice | None) -> dict[str, Any]:
    """The event JSON that hooks get on stdin and webhooks POST, with the notice even where the event
    itself names it by id only."""
    doc = event.to_json()
    if "notice" not in doc and notice is not None:
        doc["notice"] = notice.to_json(event.time)
    return doc


class Outcomes:
    """Counts a reactor's finished actions by outcome (``preemptd_actions_total``), forwarding each to an
    optional extra counter."""

    def __init__(self, also: Callable[[str], None] | None = None) -> None:
        self.counts: collections.Counter[str] = collections.Counter()
        self._also = also

    def __call__(self, outcome: str) -> None:
        self.counts[outcome] += 1
        if self._also is not None:
            self._also(outcome)


class Recent:
    """The last ``size`` records of one kind of action, newest last, for ``/v1/status``."""

    def __init__(self, size: int) -> None:
        self._items: collections.deque[dict[str, Any]] = collections.deque(maxlen=max(1, size))

    def add(self, record: dict[str, Any]) -> None:
        self._items.append(record)

    def to_json(self) -> list[dict[str, Any]]:
        return list(self._items)


def record_outcome(
    recent: Recent,
    count: Callable[[str], None],
    context: Mapping[str, Any],
    outcome: str,
    started: float,
    event_ok: str,
    event_prefix: str,
    **fields: Any,
) -> None:
    """Keep one finished action (hook run, webhook delivery) in ``recent``, count it and log it: ``event_ok``
    for success, ``event_prefix + outcome`` as a warning otherwise. Fields that are None are left out."""
    record = {
        "at": format_time(utcnow()),
        **context,
        "outcome": outcome,
        "duration_s": round(time.monotonic() - started, 3),
        **{k: v for k, v in fields.items() if v is not None},
    }
    recent.add(record)
    count(outcome)
    logged = {k: v for k, v in record.items() if k != "at"}
    if outcome == "ok":
        log.info(event_ok, **logged)
    else:
        log.warning(event_prefix + outcome, **logged)
