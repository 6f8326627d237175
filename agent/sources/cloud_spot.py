"""A poller for clouds that publish one spot termination time at a metadata path (Alibaba, Tencent): 404
while nothing is pending, the time once the instance is to be reclaimed."""

from __future__ import annotations

import abc
import asyncio
import time
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from agent.core.notice import Kind, Observation
from agent.sources.base import Sink, Source
from agent.sources.cloud_http import Backoff, CloudError, MetadataClient, status_error
from agent.sources.cloud_identity import IdentityReader

KEY_TERMINATION = "spot/termination-time"


class TerminationTimeSource(Source):
    """Subclasses set ``name``, ``cloud``, ``termination_path``, ``identity_paths`` and :meth:`parse_time`."""

    cloud: str = ""
    termination_path: str = ""
    identity_paths: Mapping[str, str] = {}

    def __init__(self, endpoint: str, poll_interval_s: float, timeout_s: float, backoff_max_s: float) -> None:
        self.endpoint = endpoint.rstrip("/")
        self.poll_interval_s = poll_interval_s
        self.backoff_max_s = backoff_max_s
        self._client = MetadataClient(self.endpoint, timeout_s)
        self._identity = IdentityReader(self.name, self.cloud, self._read_identity, backoff_max_s)
        self._polls = 0

    @abc.abstractmethod
    def parse_time(self, body: bytes) -> datetime:
        """The termination time in the cloud's own format, as aware UTC; raises ParseError."""

    def observation(self, body: bytes) -> Observation:
        deadline = self.parse_time(body)
        return Observation(
            key=KEY_TERMINATION,
            kind=Kind.TERMINATION,
            reason=f"{self.cloud.capitalize()} spot instance will be reclaimed",
            deadline=deadline,
            detail={"termination_time": body.decode("utf-8", errors="replace").strip()[:64]},
        )

    def status(self) -> Mapping[str, Any]:
        return {
            "endpoint": self.endpoint,
            "poll_interval_s": self.poll_interval_s,
            "polls": self._polls,
            "identity": self._identity.status(),
        }

    async def request_headers(self) -> Mapping[str, str] | None:
        """Headers for every GET (a token, where the cloud wants one)."""
        return None

    async def read(self, path: str) -> bytes | None:
        """The body of a 200, None for a 404; anything else raises CloudError."""
        reply = await self._client.request("GET", path, headers=await self.request_headers())
        if reply.status == 404:
            return None
        if reply.status != 200:
            raise status_error("GET", self.endpoint + path, reply)
        return reply.body

    async def _read_identity(self) -> dict[str, str]:
        identity: dict[str, str] = {}
        for field_name, path in self.identity_paths.items():
            body = await self.read(path)
            if body is not None:
                identity[field_name] = body.decode("utf-8", errors="replace").strip()[:256]
        if not identity:
            raise CloudError(
                f"GET {self.endpoint}: none of {', '.join(self.identity_paths)} found", status=404
            )
        return identity

    async def run(self, sink: Sink) -> None:
        backoff = Backoff(self.poll_interval_s, self.backoff_max_s)
        self._identity.start(sink)  # beside the poll: its failures never slow or degrade it
        try:
            next_tick = time.monotonic()
            while True:
                try:
                    body = await self.read(self.termination_path)
                    sink.replace([self.observation(body)] if body is not None else [])
                except CloudError as exc:
                    sink.error(str(exc), endpoint=self.endpoint, status=exc.status)
                    next_tick = time.monotonic() + backoff.next_delay(exc.retry_after_s)
                else:
                    backoff.reset()
                    sink.ok(endpoint=self.endpoint)
                    next_tick = max(next_tick + self.poll_interval_s, time.monotonic())
                self._polls += 1
                await asyncio.sleep(max(0.0, next_tick - time.monotonic()))
        finally:
            await self._identity.stop()
            await self._client.close()


async def probe_instance_id(endpoint: str, timeout_s: float) -> bool:
    """Detection's probe for these clouds: an instance id at the EC2-style path, short and non-empty."""
    async with MetadataClient(endpoint, timeout_s) as client:
        reply = await client.request("GET", "/latest/meta-data/instance-id")
        return reply.status == 200 and 0 < len(reply.body.strip()) < 128
