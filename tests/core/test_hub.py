"""The hub on its own: fan-out, resume by Last-Event-ID, slow subscribers, bounded memory."""

from __future__ import annotations

import asyncio
from datetime import datetime, timezone

import structlog
from structlog.testing import capture_logs

from agent.core.notice import EventType
from agent.core.subscribers import CLOSE, HEARTBEAT, Hub

T0 = datetime(2026, 12, 2, tzinfo=timezone.utc)


async def test_every_subscriber_gets_every_event_in_order() -> None:
    hub = Hub()
    subs = [hub.subscribe() for _ in range(5)]
    for _ in range(3):
        hub.publish(EventType.READY, T0)
    assert [[1, 2, 3]] * 5 == [[_seq(s.queue.get_nowait()) for _ in range(3)] for s in subs]


async def test_a_subscriber_that_stops_reading_is_kicked_and_others_keep_receiving() -> None:
    kicked: list[str] = []
    hub = Hub(queue_size=2)
    slow = hub.subscribe()
    slow.on_kick = kicked.append
    fast = hub.subscribe()
    for _ in range(3):
        hub.publish(EventType.READY, T0)
        fast.queue.get_nowait()
    assert (["queue full: client stopped reading"], 1, 1) == (kicked, len(hub), hub.kicked_total)
    hub.publish(EventType.READY, T0)
    assert 4 == _seq(fast.queue.get_nowait())


async def test_resume_replays_exactly_what_was_missed() -> None:
    hub = Hub(ring_size=10)
    for _ in range(5):
        hub.publish(EventType.READY, T0)
    resume = hub.resume_from("2")
    assert (False, [3, 4, 5]) == (resume.snapshot, [_seq(f) for f in resume.frames])


async def test_resume_when_up_to_date_sends_nothing() -> None:
    hub = Hub()
    hub.publish(EventType.READY, T0)
    resume = hub.resume_from("1")
    assert (False, ()) == (resume.snapshot, resume.frames)


async def test_resume_falls_back_to_a_snapshot_when_too_far_behind_or_unknown() -> None:
    hub = Hub(ring_size=3)
    for _ in range(10):
        hub.publish(EventType.READY, T0)
    assert [True, True, True, True, False] == [
        hub.resume_from(x).snapshot for x in ("2", "11", "garbage", None, "7")
    ]


async def test_memory_is_bounded_by_ring_and_queue_sizes() -> None:
    hub = Hub(queue_size=4, ring_size=8)
    sub = hub.subscribe()
    sub.on_kick = lambda reason: None
    for _ in range(100):
        hub.publish(EventType.READY, T0)
    assert (8, 4, 0) == (len(hub._ring), sub.queue.qsize(), len(hub))


async def test_subscriber_limit_is_enforced() -> None:
    hub = Hub(max_subscribers=1)
    hub.subscribe()
    try:
        hub.subscribe()
    except Exception as exc:
        assert "limit is 1" in str(exc)
    else:
        raise AssertionError("second subscriber accepted")


async def test_heartbeat_goes_only_to_idle_subscribers() -> None:
    hub = Hub()
    idle, busy = hub.subscribe(), hub.subscribe()
    busy.queue.put_nowait(b"x")
    hub.heartbeat()
    assert (1, 1, HEARTBEAT) == (idle.queue.qsize(), busy.queue.qsize(), idle.queue.get_nowait())


async def test_the_heartbeat_loop_reads_its_interval_each_time() -> None:
    """A reload that changes api.heartbeat_s applies from the next beat: the loop asks for the interval
    before each wait."""
    hub = Hub()
    sub = hub.subscribe()
    asked: list[int] = []

    def interval() -> float:
        asked.append(1)
        return 0.0

    beats = asyncio.create_task(hub.heartbeats(interval))
    try:
        first = await asyncio.wait_for(sub.queue.get(), 10)
        second = await asyncio.wait_for(sub.queue.get(), 10)
    finally:
        beats.cancel()
        await asyncio.gather(beats, return_exceptions=True)
    assert ((HEARTBEAT, HEARTBEAT), True) == ((first, second), len(asked) >= 2)


async def test_a_dropped_subscriber_is_logged_with_its_peer() -> None:
    with capture_logs() as logs:
        hub = Hub(queue_size=1, log=structlog.get_logger())
        slow = hub.subscribe({"pid": 42})
        hub.publish(EventType.READY, T0)
        hub.publish(EventType.READY, T0)
    assert [("subscriber_disconnected_slow", slow.id, {"pid": 42}, 1)] == [
        (e["event"], e["subscriber"], e["peer"], e["queued"]) for e in logs
    ]


async def test_close_all_asks_every_stream_to_finish() -> None:
    hub = Hub()
    sub = hub.subscribe()
    hub.close_all()
    assert CLOSE == await asyncio.wait_for(sub.queue.get(), 1)


def _seq(frame: bytes) -> int:
    return int(frame.split(b"\n", 1)[0].split(b": ")[1])
