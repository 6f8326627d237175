"""What every cloud source shares: a metadata HTTP client with explicit timeouts and a body-size cap, backoff
with jitter, and the bookkeeping that lets a source read several endpoints without an error clearing a notice.

Protocol parsing lives in each cloud's module as pure functions; this module only moves bytes.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Coroutine, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
from multidict import CIMultiDictProxy

from agent.core.errors import PreemptdError
from agent.core.notice import Observation
from agent.sources.base import Sink

DEFAULT_MAX_BODY_BYTES = 256 * 1024


class CloudError(PreemptdError):
    """A metadata service answered badly or not at all; the message says which URL and what went wrong."""

    def __init__(
        self,
        message: str,
        status: int | None = None,
        retry_after_s: float | None = None,
        timed_out: bool = False,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after_s = retry_after_s
        self.timed_out = timed_out


class ParseError(CloudError):
    """A metadata payload does not have the shape the cloud documents."""


@dataclass(frozen=True)
class Reply:
    status: int
    headers: CIMultiDictProxy[str]
    body: bytes

    def text(self) -> str:
        try:
            return self.body.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ParseError(f"body is not UTF-8 text: {self.body[:40]!r}") from exc


class MetadataClient:
    """HTTP to one metadata endpoint. Every request has a timeout, proxies are bypassed (metadata must never
    go through a proxy), and a body larger than ``max_body_bytes`` is an error rather than a memory hazard."""

    def __init__(
        self,
        base_url: str,
        timeout_s: float,
        headers: Mapping[str, str] | None = None,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.max_body_bytes = max_body_bytes
        self._headers = dict(headers or {})
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> MetadataClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _ensure_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                trust_env=False,
                headers=self._headers,
                connector=aiohttp.TCPConnector(limit=8, force_close=False),
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def request(
        self,
        method: str,
        path: str,
        *,
        headers: Mapping[str, str] | None = None,
        params: Mapping[str, str] | None = None,
        json_body: Any = None,
        timeout_s: float | None = None,
    ) -> Reply:
        """One request; transport failures, timeouts and oversized bodies raise :class:`CloudError`.
        HTTP error statuses are returned, not raised: what a 404 means depends on the endpoint."""
        url = self.base_url + path
        limit = self.timeout_s if timeout_s is None else timeout_s
        session = self._ensure_session()
        try:
            async with session.request(
                method,
                url,
                headers=headers,
                params=params,
                json=json_body,
                allow_redirects=False,
                timeout=aiohttp.ClientTimeout(total=limit),
            ) as response:
                body = await self._read_capped(response, url)
                return Reply(response.status, response.headers, body)
        except asyncio.TimeoutError as exc:
            raise CloudError(f"{method} {url}: no answer within {limit:g} s", timed_out=True) from exc
        except aiohttp.ClientError as exc:
            raise CloudError(f"{method} {url}: {type(exc).__name__}: {exc}") from exc
        except OSError as exc:
            raise CloudError(f"{method} {url}: {exc.strerror or exc}") from exc

    async def _read_capped(self, response: aiohttp.ClientResponse, url: str) -> bytes:
        declared = response.content_length
        if declared is not None and declared > self.max_body_bytes:
            raise CloudError(
                f"{url}: response of {declared} bytes is larger than the {self.max_body_bytes}-byte limit",
                status=response.status,
            )
        chunks: list[bytes] = []
        size = 0
        while True:
            chunk = await response.content.read(65536)
            if not chunk:
                break
            size += len(chunk)
            if size > self.max_body_bytes:
                raise CloudError(
                    f"{url}: response is larger than the {self.max_body_bytes}-byte limit",
                    status=response.status,
                )
            chunks.append(chunk)
        return b"".join(chunks)


def status_error(method: str, url: str, reply: Reply) -> CloudError:
    """An unexpected HTTP status as an error that says what the server answered."""
    snippet = reply.body[:120].decode("utf-8", errors="replace").strip()
    retry_after: float | None = None
    raw_retry = reply.headers.get("Retry-After")
    if raw_retry:
        try:
            retry_after = max(0.0, float(raw_retry))
        except ValueError:
            retry_after = None
    message = f"{method} {url}: HTTP {reply.status}"
    if snippet:
        message += f": {snippet}"
    return CloudError(message, status=reply.status, retry_after_s=retry_after)


class Backoff:
    """Exponential backoff with jitter: each delay is drawn from [½, 1] of the current step, so many hosts
    hitting a recovering service do not retry in lockstep."""

    def __init__(self, base_s: float, max_s: float, rng: Callable[[], float] = random.random) -> None:
        self.base_s = base_s
        self.max_s = max(max_s, base_s)
        self._rng = rng
        self.failures = 0

    def next_delay(self, floor_s: float | None = None) -> float:
        step = min(self.max_s, self.base_s * 2.0 ** min(self.failures, 32))
        self.failures += 1
        delay = step * (0.5 + 0.5 * self._rng())
        return max(delay, floor_s or 0.0)

    def reset(self) -> None:
        self.failures = 0


class Cadence:
    """When each endpoint (``part``) of a polling source is next read. Every part has its own interval, and
    the loop wakes only on the ticks of the fastest part (the anchor) and for retries: a slower part is read
    on the anchor tick nearest its time (within half a tick), riding along with it instead of waking the
    loop itself. Fixed-rate: a part's next read is one interval after its last due time, not after the read
    ended (at once if that time has passed), so an interval is the worst-case delay whatever a read took.
    Pure: the caller passes the monotonic clock.
    """

    def __init__(self, intervals: Mapping[str, float], now: float) -> None:
        self.intervals = dict(intervals)
        self.anchor = min(self.intervals, key=self.intervals.__getitem__)
        self.slack_s = self.intervals[self.anchor] / 2
        self._next = dict.fromkeys(self.intervals, now)
        self._retrying: set[str] = set()

    def due(self, now: float) -> list[str]:
        """The parts to read at ``now``, in the order they were given."""
        return [part for part, at in self._next.items() if at <= now + self.slack_s]

    def read(self, part: str, now: float) -> None:
        """``part`` was read successfully at ``now``."""
        self._retrying.discard(part)
        self._next[part] = max(self._next[part] + self.intervals[part], now)

    def retry(self, part: str, at: float) -> None:
        """``part`` failed: read it again at ``at`` (its backoff), whatever its interval."""
        self._retrying.add(part)
        self._next[part] = at

    def next_at(self) -> float:
        """When the loop should wake next: the anchor's next tick, or an earlier retry."""
        return min(self._next[part] for part in {self.anchor, *self._retrying})


class LevelState:
    """The observations a source has read, per endpoint (``part``), published as one level-triggered set.

    A source that reads several endpoints calls :meth:`set` for each successful read and leaves a failed part
    untouched, so an error never clears what that endpoint last showed. Until every part has been read once,
    only ``observe`` is used: a notice restored from an earlier run must not be cleared (and raised again
    under a new id) because its endpoint has not answered yet.
    """

    def __init__(self, parts: Iterable[str]) -> None:
        self._parts: dict[str, tuple[Observation, ...] | None] = dict.fromkeys(parts)

    def set(self, part: str, observations: Sequence[Observation]) -> None:
        self._parts[part] = tuple(observations)

    def drop_part(self, part: str) -> None:
        """The endpoint does not exist on this host (e.g. an optional API): stop waiting for it."""
        self._parts.pop(part, None)

    @property
    def complete(self) -> bool:
        return all(value is not None for value in self._parts.values())

    def observations(self) -> list[Observation]:
        return [obs for value in self._parts.values() if value for obs in value]

    def publish(self, sink: Sink) -> None:
        if self.complete:
            sink.replace(self.observations())
        else:
            for obs in self.observations():
                sink.observe(obs)


async def run_all(coros: Sequence[Coroutine[Any, Any, None]]) -> None:
    """Run coroutines as tasks owned here: wait for all of them; the first to raise cancels the others (and
    is re-raised), and cancelling the caller cancels and awaits them all."""
    tasks = [asyncio.ensure_future(coro) for coro in coros]
    try:
        pending: set[asyncio.Future[None]] = set(tasks)
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION)
            for task in done:
                error = None if task.cancelled() else task.exception()
                if error is not None:
                    raise error
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
