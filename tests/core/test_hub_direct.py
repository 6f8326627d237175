"""The hub's direct path: a stream waiting on an empty queue takes frames synchronously; the queue is used
whenever it declines or already holds something, so order and the slow-subscriber rule are unchanged."""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

from agent.core.notice import EventType, Kind
from agent.core.subscribers import Hub
from tests.support import SSEClient, running_agent

T0 = datetime(2026, 12, 2, tzinfo=timezone.utc)


def _seq(frame: bytes) -> int:
    return int(frame.split(b"\n", 1)[0].removeprefix(b"id: "))


async def test_a_waiting_stream_takes_the_frame_directly_and_nothing_is_queued() -> None:
    hub = Hub()
    sub = hub.subscribe()
    taken: list[bytes] = []
    sub.direct = lambda frame: taken.append(frame) is None
    hub.publish(EventType.READY, T0)
    assert ([1], 0) == ([_seq(f) for f in taken], sub.queue.qsize())


async def test_a_declined_frame_is_queued_and_later_frames_queue_behind_it() -> None:
    hub = Hub()
    sub = hub.subscribe()
    offered: list[int] = []

    def decline_first(frame: bytes) -> bool:
        offered.append(_seq(frame))
        return len(offered) > 1  # would accept from now on, but must not be asked while frames wait

    sub.direct = decline_first
    for _ in range(3):
        hub.publish(EventType.READY, T0)
    assert ([1], [1, 2, 3]) == (offered, [_seq(sub.queue.get_nowait()) for _ in range(3)])


async def test_a_stream_that_keeps_declining_is_kicked_when_its_queue_is_full() -> None:
    kicked: list[str] = []
    hub = Hub(queue_size=2)
    sub = hub.subscribe()
    sub.on_kick = kicked.append
    sub.direct = lambda frame: False
    for _ in range(3):
        hub.publish(EventType.READY, T0)
    assert (["queue full: client stopped reading"], 0) == (kicked, len(hub))


async def test_a_stream_resumed_with_nothing_missed_gets_the_next_notice(base: Path) -> None:
    """Nothing is written before the first live frame here, so that one goes through aiohttp (headers
    first); direct writes only follow it."""
    async with running_agent(base) as agent:
        client = await SSEClient.connect(agent.config.socket, last_event_id=str(agent.hub.seq))
        try:
            for in_s in (60, 90):
                notice = agent.drills.drill(Kind.TERMINATION, in_s, None, "drill", {})
                event = await client.next()
                assert ("notice", notice.id) == (event["type"], event["notice"]["id"])
        finally:
            await client.close()
