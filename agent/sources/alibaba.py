"""Alibaba Cloud ECS: the spot instance termination time (about five minutes of notice), optionally through
the hardened metadata mode's token."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from datetime import datetime

from agent.config import AlibabaConfig
from agent.core.errors import NoticeError
from agent.core.notice import parse_time
from agent.sources.cloud_http import CloudError, ParseError, status_error
from agent.sources.cloud_spot import TerminationTimeSource, probe_instance_id
from agent.sources.clouds import CloudSpec, Lead

TERMINATION_PATH = "/latest/meta-data/instance/spot/termination-time"
TOKEN_PATH = "/latest/api/token"
TOKEN_TTL_HEADER = "X-aliyun-ecs-metadata-token-ttl-seconds"
TOKEN_HEADER = "X-aliyun-ecs-metadata-token"


def parse_alibaba_time(body: bytes) -> datetime:
    """``2015-01-05T18:02:00Z`` (UTC, RFC 3339)."""
    try:
        return parse_time(body.decode("utf-8").strip())
    except (UnicodeDecodeError, NoticeError) as exc:
        raise ParseError(f"spot/termination-time: {body[:60]!r} is not an RFC 3339 time") from exc


class AlibabaSource(TerminationTimeSource):
    name = "alibaba"
    cloud = "alibaba"
    termination_path = TERMINATION_PATH
    identity_paths = {
        "instance_id": "/latest/meta-data/instance-id",
        "instance_type": "/latest/meta-data/instance/instance-type",
        "zone": "/latest/meta-data/zone-id",
    }

    def __init__(self, config: AlibabaConfig) -> None:
        super().__init__(config.endpoint, config.poll_interval_s, config.timeout_s, config.backoff_max_s)
        self.config = config
        self._token: str | None = None
        self._token_expires = 0.0
        # One fetch at a time: the identity read runs beside the termination poll and shares its token.
        self._token_lock = asyncio.Lock()

    def parse_time(self, body: bytes) -> datetime:
        return parse_alibaba_time(body)

    async def request_headers(self) -> Mapping[str, str] | None:
        if not self.config.token:
            return None
        async with self._token_lock:
            if self._token is None or time.monotonic() >= self._token_expires:
                ttl = max(1, min(21600, self.config.token_ttl_s))
                reply = await self._client.request("PUT", TOKEN_PATH, headers={TOKEN_TTL_HEADER: str(ttl)})
                if reply.status != 200:
                    raise status_error("PUT", self.endpoint + TOKEN_PATH, reply)
                token = reply.text().strip()
                if not token or not token.isprintable():
                    raise ParseError(f"PUT {TOKEN_PATH}: unusable token {reply.body[:40]!r}")
                self._token = token
                self._token_expires = time.monotonic() + ttl - min(60.0, ttl / 4)
            return {TOKEN_HEADER: self._token}

    async def read(self, path: str) -> bytes | None:
        try:
            return await super().read(path)
        except CloudError as exc:
            if exc.status in (401, 403):
                # A rejected token (expired early, metadata service restarted) is fetched again next time.
                self._token = None
            raise


def names_alibaba(dmi: Mapping[str, str]) -> bool:
    """Pure: whether the DMI strings name Alibaba Cloud ECS."""
    return (
        "alibaba cloud" in dmi.get("product_name", "").lower()
        or "alibaba cloud" in dmi.get("sys_vendor", "").lower()
    )


async def probe(config: AlibabaConfig, timeout_s: float) -> bool:
    return await probe_instance_id(config.endpoint, timeout_s)


CLOUD = CloudSpec(
    "alibaba",
    AlibabaConfig,
    names_alibaba,
    probe,
    AlibabaSource,
    simulator="agent.simulate.spot:AlibabaSimulator",
    rank=40,
    leads=lambda _table: (
        Lead("termination", 300.0, "alibaba: spot termination-time, about 5 minutes", fixed=True),
    ),
    about="Alibaba Cloud ECS: instance metadata",
)
