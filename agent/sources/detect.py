"""Which cloud this host runs on: DMI strings first (instant, no network), then one short metadata probe of
every configured endpoint when DMI does not say. ``cloud = "<name>"`` skips detection altogether.

With ``cloud = "auto"``, :func:`cloud_sources` reads DMI (a few small sysfs files) and returns that cloud's
source directly; when DMI is inconclusive (containers often hide ``/sys/class/dmi``) it returns a
:class:`DetectingSource` that probes in the background and then runs the cloud it found, so start-up never
waits on the network.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import structlog

from agent.config import Config
from agent.core.ports import AZURE_ACK
from agent.sources.alibaba import AlibabaSource
from agent.sources.aws import TOKEN_PATH, TOKEN_TTL_HEADER, AwsSource
from agent.sources.azure import AzureSource
from agent.sources.base import Sink, Source
from agent.sources.cloud_http import Backoff, CloudError, MetadataClient
from agent.sources.gcp import GcpSource, gcp_endpoint
from agent.sources.tencent import TencentSource

log = structlog.get_logger("preemptd.sources.detect")

DMI_FIELDS = (
    "sys_vendor",
    "product_name",
    "product_version",
    "bios_vendor",
    "bios_version",
    "chassis_asset_tag",
)
AZURE_ASSET_TAG = "7783-7084-3265-9085-8269-3286-77"
CLOUD_ORDER = ("aws", "gcp", "azure", "alibaba", "tencent")


def read_dmi(dmi_dir: Path) -> dict[str, str]:
    """The DMI strings that identify clouds; unreadable or missing files are left out."""
    values: dict[str, str] = {}
    for name in DMI_FIELDS:
        try:
            values[name] = (dmi_dir / name).read_text(encoding="utf-8", errors="replace").strip()[:256]
        except OSError:
            continue
    return values


def cloud_from_dmi(dmi: Mapping[str, str]) -> str | None:
    """Pure: the cloud the DMI strings name, or None."""
    vendor = dmi.get("sys_vendor", "").lower()
    product = dmi.get("product_name", "").lower()
    bios = (dmi.get("bios_vendor", "") + " " + dmi.get("bios_version", "")).lower()
    if (
        vendor == "amazon ec2"
        or "amazon" in bios
        or dmi.get("product_version", "").lower().endswith("amazon")
    ):
        return "aws"
    if product == "google compute engine" or vendor == "google":
        return "gcp"
    if dmi.get("chassis_asset_tag", "") == AZURE_ASSET_TAG:
        return "azure"
    if "alibaba cloud" in product or "alibaba cloud" in vendor:
        return "alibaba"
    if "tencent" in vendor or "tencent" in product:
        return "tencent"
    return None


def make_source(cloud: str, config: Config) -> Source:
    if cloud == "aws":
        return AwsSource(config.aws)
    if cloud == "gcp":
        return GcpSource(config.gcp)
    if cloud == "azure":
        return AzureSource(config.azure)
    if cloud == "alibaba":
        return AlibabaSource(config.alibaba)
    if cloud == "tencent":
        return TencentSource(config.tencent)
    raise ValueError(f"unknown cloud {cloud!r}")


def cloud_sources(config: Config) -> list[Source]:
    """The cloud source for ``config.cloud``: none, the named one, or the detected one."""
    if config.cloud == "none":
        return []
    if config.cloud != "auto":
        return [make_source(config.cloud, config)]
    dmi = read_dmi(config.detect.dmi_dir)
    cloud = cloud_from_dmi(dmi)
    if cloud is not None:
        log.info("cloud_detected", cloud=cloud, method="dmi", dmi=dmi)
        return [make_source(cloud, config)]
    return [DetectingSource(config, dmi)]


# --- probes --------------------------------------------------------------------------------------------


async def _probe_aws(config: Config, timeout_s: float) -> bool:
    async with MetadataClient(config.aws.endpoint, timeout_s) as client:
        reply = await client.request("PUT", TOKEN_PATH, headers={TOKEN_TTL_HEADER: "60"})
        if reply.status == 200 and reply.body.strip():
            return True
        # IMDSv1-only instances answer the PUT with 403/405 but serve the instance id.
        reply = await client.request("GET", "/latest/meta-data/instance-id")
        return reply.status == 200 and reply.body.strip().startswith(b"i-")


async def _probe_gcp(config: Config, timeout_s: float) -> bool:
    async with MetadataClient(gcp_endpoint(config.gcp.endpoint), timeout_s) as client:
        reply = await client.request(
            "GET", "/computeMetadata/v1/instance/id", headers={"Metadata-Flavor": "Google"}
        )
        return reply.status == 200 and reply.headers.get("Metadata-Flavor", "").lower() == "google"


async def _probe_azure(config: Config, timeout_s: float) -> bool:
    async with MetadataClient(config.azure.endpoint, timeout_s) as client:
        reply = await client.request(
            "GET",
            "/metadata/instance",
            headers={"Metadata": "true"},
            params={"api-version": config.azure.instance_api_version},
        )
        if reply.status != 200:
            return False
        try:
            doc = json.loads(reply.body)
        except ValueError:
            return False
        return isinstance(doc, dict) and isinstance(doc.get("compute"), dict)


async def _probe_instance_id(endpoint: str, timeout_s: float) -> bool:
    async with MetadataClient(endpoint, timeout_s) as client:
        reply = await client.request("GET", "/latest/meta-data/instance-id")
        return reply.status == 200 and 0 < len(reply.body.strip()) < 128


async def probe(cloud: str, config: Config, timeout_s: float) -> bool:
    """One cheap request (two for AWS without IMDSv2) that only ``cloud``'s metadata service answers so."""
    probes: Mapping[str, Callable[[], Any]] = {
        "aws": lambda: _probe_aws(config, timeout_s),
        "gcp": lambda: _probe_gcp(config, timeout_s),
        "azure": lambda: _probe_azure(config, timeout_s),
        "alibaba": lambda: _probe_instance_id(config.alibaba.endpoint, timeout_s),
        "tencent": lambda: _probe_instance_id(config.tencent.endpoint, timeout_s),
    }
    try:
        result: bool = await asyncio.wait_for(probes[cloud](), timeout_s * 2)
    except (CloudError, asyncio.TimeoutError):
        return False
    return result


async def probe_all(config: Config, timeout_s: float) -> str | None:
    """Probe every cloud's configured endpoint at once; the first in :data:`CLOUD_ORDER` that answers wins."""
    results = await asyncio.gather(*(probe(cloud, config, timeout_s) for cloud in CLOUD_ORDER))
    for cloud, found in zip(CLOUD_ORDER, results, strict=True):
        if found:
            return cloud
    return None


class DetectingSource(Source):
    """Runs where DMI did not name a cloud: probes the metadata endpoints once, then runs the cloud source it
    found under this source's name, or disables itself saying how to choose a cloud by hand."""

    name = "cloud"

    def __init__(self, config: Config, dmi: Mapping[str, str]) -> None:
        self.config = config
        self.dmi = dict(dmi)
        self.detected: str | None = None
        self.inner: Source | None = None

    def capabilities(self) -> Mapping[str, Callable[..., Any]]:
        # Only once probing found Azure: before that, or on another cloud, nothing can be acknowledged.
        return {AZURE_ACK: self.acknowledge} if isinstance(self.inner, AzureSource) else {}

    def status(self) -> Mapping[str, Any]:
        doc: dict[str, Any] = {"detected": self.detected, "method": "probe", "dmi": self.dmi}
        if self.inner is not None:
            doc.update(self.inner.status())
        return doc

    async def acknowledge(self, event_id: str) -> None:
        """Azure's ``StartRequests`` through the detected source (see :meth:`AzureSource.acknowledge`)."""
        if not isinstance(self.inner, AzureSource):
            raise CloudError(
                f"cannot acknowledge {event_id!r}: the detected cloud is {self.detected!r}, not Azure"
            )
        await self.inner.acknowledge(event_id)

    async def run(self, sink: Sink) -> None:
        timeout_s = self.config.detect.probe_timeout_s
        give_up = time.monotonic() + self.config.detect.probe_retry_s
        backoff = Backoff(1.0, 15.0)
        self.detected = await probe_all(self.config, timeout_s)
        while self.detected is None and time.monotonic() < give_up:
            await asyncio.sleep(min(backoff.next_delay(), max(0.0, give_up - time.monotonic())))
            self.detected = await probe_all(self.config, timeout_s)
        if self.detected is None:
            vendor = self.dmi.get("sys_vendor") or "unreadable"
            sink.disable(
                f"no cloud detected: DMI sys_vendor is {vendor!r} and no metadata service answered "
                f"(probed for {self.config.detect.probe_retry_s:g} s, {timeout_s:g} s per try); "
                'set cloud = "aws" (or gcp, azure, alibaba, tencent) to choose one, or cloud = "none"'
            )
            return
        log.info("cloud_detected", cloud=self.detected, method="probe")
        self.inner = make_source(self.detected, self.config)
        await self.inner.run(sink)
