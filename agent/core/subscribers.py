"""The hub: fans every event out to every subscriber without letting one slow client hold up the rest.

Each event is encoded once (SSE frame bytes) and put on each subscriber's bounded queue. A subscriber whose
queue is full has stopped reading: it is disconnected (its ``on_kick`` callback aborts the connection) and
the others are never delayed. A stream that waits with nothing queued may offer ``direct``: publishing then
hands it the frame synchronously, which spares a task wake-up per subscriber (the fan-out's main cost), and
falls back to the queue whenever it declines. A ring buffer of recent frames lets a reconnecting client resume exactly after
its ``Last-Event-ID``; a client that fell further behind gets a fresh snapshot. Memory is bounded by
``ring_size`` plus ``queue_size`` frames per subscriber, and by ``max_subscribers``.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from agent.core import sse
from agent.core.notice import Event, EventType, Notice

HEARTBEAT = sse.comment("heartbeat")
# Put on a queue to tell its handler to finish the stream (agent shutdown).
CLOSE = b""


class HubFull(Exception):
    """The subscriber limit is reached."""


# json.dumps with these options builds an encoder on every call; one is kept (the same output).
_JSON = json.JSONEncoder(separators=(",", ":"), sort_keys=True)


def encode_event(event: Event, now: datetime | None = None) -> bytes:
    """The SSE frame of one event: ``id`` is the sequence number, ``event`` the type, ``data`` the JSON."""
    payload = _JSON.encode(event.to_json(now))
    return sse.encode(event.type.value, payload, event_id=event.seq)


@dataclass(eq=False)
class Subscriber:
    """One connected event stream."""

    id: int
    queue: asyncio.Queue[bytes]
    peer: Mapping[str, Any] = field(default_factory=dict)
    on_kick: Callable[[str], None] | None = None
    closed_reason: str | None = None
    delivered: int = 0
    # Set by the stream only while it waits on an empty queue: writes a frame at once, or returns False
    # (the connection cannot take it now) and the frame is queued as usual.
    direct: Callable[[bytes], bool] | None = None

    def kick(self, reason: str) -> None:
        if self.closed_reason is not None:
            return
        self.closed_reason = reason
        if self.on_kick is not None:
            self.on_kick(reason)


@dataclass(frozen=True)
class Resume:
    """What a new subscriber gets first: a snapshot, or the frames it missed."""

    snapshot: bool
    frames: tuple[bytes, ...]


class Hub:
    def __init__(
        self,
        queue_size: int = 256,
        ring_size: int = 1024,
        max_subscribers: int = 4096,
        start_seq: int = 0,
        log: Any = None,
    ) -> None:
        self.queue_size = queue_size
        self.max_subscribers = max_subscribers
        self.seq = start_seq
        self._ring: deque[tuple[int, bytes]] = deque(maxlen=ring_size)
        self._subs: dict[int, Subscriber] = {}
        self._ids = itertools.count(1)
        self._log = log  # told of every subscriber dropped (the agent's logger)
        self.kicked_total = 0
        self.published_total: dict[str, int] = {}

    @property
    def subscribers(self) -> Iterable[Subscriber]:
        return self._subs.values()

    def __len__(self) -> int:
        return len(self._subs)

    def publish(
        self,
        event_type: EventType,
        now: datetime,
        notice: Notice | None = None,
        data: Mapping[str, Any] | None = None,
    ) -> Event:
        """Number, encode and fan out one event; never awaits, never blocks on a subscriber."""
        self.seq += 1
        event = Event(seq=self.seq, type=event_type, time=now, notice=notice, data=dict(data or {}))
        frame = encode_event(event, now)
        self._ring.append((event.seq, frame))
        self.published_total[event_type.value] = self.published_total.get(event_type.value, 0) + 1
        overflowed: list[Subscriber] = []
        for sub in self._subs.values():
            direct = sub.direct
            if direct is not None and sub.queue.empty() and direct(frame):
                continue
            try:
                sub.queue.put_nowait(frame)
            except asyncio.QueueFull:
                overflowed.append(sub)
        for sub in overflowed:
            self._drop(sub, "queue full: client stopped reading")
        return event

    def snapshot_frame(self, notices: tuple[Notice, ...], now: datetime) -> bytes:
        """A snapshot carries the current sequence number, so resuming from it misses nothing."""
        return encode_event(Event(seq=self.seq, type=EventType.SNAPSHOT, time=now, notices=notices), now)

    def resume_from(self, last_event_id: str | None) -> Resume:
        """Decide what a (re)connecting client needs: the exact frames after ``last_event_id`` when the ring
        still holds them, else a snapshot."""
        if last_event_id is None:
            return Resume(snapshot=True, frames=())
        try:
            last = int(last_event_id.strip())
        except ValueError:
            return Resume(snapshot=True, frames=())
        if last == self.seq:
            return Resume(snapshot=False, frames=())
        if last > self.seq or last < 0 or not self._ring or self._ring[0][0] > last + 1:
            return Resume(snapshot=True, frames=())
        return Resume(snapshot=False, frames=tuple(frame for seq, frame in self._ring if seq > last))

    def subscribe(self, peer: Mapping[str, Any] | None = None) -> Subscriber:
        if len(self._subs) >= self.max_subscribers:
            raise HubFull(f"{len(self._subs)} subscribers connected, the limit is {self.max_subscribers}")
        sub = Subscriber(id=next(self._ids), queue=asyncio.Queue(self.queue_size), peer=dict(peer or {}))
        self._subs[sub.id] = sub
        return sub

    def unsubscribe(self, sub: Subscriber) -> None:
        self._subs.pop(sub.id, None)

    def heartbeat(self) -> None:
        """Queue a heartbeat for every subscriber with nothing queued (idle streams only)."""
        for sub in list(self._subs.values()):
            if sub.queue.empty():
                sub.queue.put_nowait(HEARTBEAT)

    async def heartbeats(self, interval_s: Callable[[], float]) -> None:
        """Send :meth:`heartbeat` every ``interval_s()`` seconds (read each time: a reload may change it)."""
        while True:
            await asyncio.sleep(interval_s())
            self.heartbeat()

    def close_all(self) -> None:
        """Ask every stream to finish (shutdown); one that cannot take the request is kicked."""
        for sub in list(self._subs.values()):
            try:
                sub.queue.put_nowait(CLOSE)
            except asyncio.QueueFull:
                self._drop(sub, "agent shutting down")

    def _drop(self, sub: Subscriber, reason: str) -> None:
        self._subs.pop(sub.id, None)
        self.kicked_total += 1
        if self._log is not None:
            self._log.warning(
                "subscriber_disconnected_slow",
                subscriber=sub.id,
                peer=dict(sub.peer),
                queued=sub.queue.qsize(),
            )
        sub.kick(reason)
