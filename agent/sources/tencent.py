"""Tencent Cloud CVM: the spot instance termination time, published in China Standard Time (UTC+8) without a
zone marker."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime, timedelta, timezone

from agent.config import TencentConfig
from agent.core.errors import NoticeError
from agent.core.notice import parse_time
from agent.sources.cloud_http import ParseError
from agent.sources.cloud_spot import TerminationTimeSource, probe_instance_id
from agent.sources.clouds import CloudSpec, Lead

TERMINATION_PATH = "/latest/meta-data/spot/termination-time"
CHINA_STANDARD_TIME = timezone(timedelta(hours=8), "CST")


def parse_tencent_time(body: bytes) -> datetime:
    """``2018-08-18 12:05:33``: local time UTC+8, space-separated. A time with a zone (RFC 3339) is taken as
    it says."""
    try:
        text = body.decode("utf-8").strip()
    except UnicodeDecodeError as exc:
        raise ParseError(f"spot/termination-time: not text: {body[:40]!r}") from exc
    try:
        local = datetime.strptime(text, "%Y-%m-%d %H:%M:%S")
    except ValueError:
        try:
            return parse_time(text)
        except NoticeError as exc:
            raise ParseError(
                f"spot/termination-time: {text[:60]!r} is not like '2018-08-18 12:05:33'"
            ) from exc
    return local.replace(tzinfo=CHINA_STANDARD_TIME).astimezone(timezone.utc)


class TencentSource(TerminationTimeSource):
    name = "tencent"
    cloud = "tencent"
    termination_path = TERMINATION_PATH
    identity_paths = {
        "instance_id": "/latest/meta-data/instance-id",
        "instance_type": "/latest/meta-data/instance/instance-type",
        "zone": "/latest/meta-data/placement/zone",
    }

    def __init__(self, config: TencentConfig) -> None:
        super().__init__(config.endpoint, config.poll_interval_s, config.timeout_s, config.backoff_max_s)
        self.config = config

    def parse_time(self, body: bytes) -> datetime:
        return parse_tencent_time(body)


def names_tencent(dmi: Mapping[str, str]) -> bool:
    """Pure: whether the DMI strings name Tencent Cloud CVM."""
    return "tencent" in dmi.get("sys_vendor", "").lower() or "tencent" in dmi.get("product_name", "").lower()


async def probe(config: TencentConfig, timeout_s: float) -> bool:
    return await probe_instance_id(config.endpoint, timeout_s)


CLOUD = CloudSpec(
    "tencent",
    TencentConfig,
    names_tencent,
    probe,
    TencentSource,
    simulator="agent.simulate.spot:TencentSimulator",
    rank=50,
    leads=lambda _table: (
        Lead(
            "termination",
            None,
            "tencent: spot termination-time (its lead is not documented in our reference)",
        ),
    ),
    about="Tencent Cloud CVM: instance metadata",
)
