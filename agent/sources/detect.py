"""Which cloud this host runs on: DMI strings first (instant, no network), then one short metadata probe of
every configured endpoint when DMI does not say. ``cloud = "<name>"`` skips detection altogether. Each cloud's
DMI match, probe and source come from its spec in the cloud registry (agent/sources/clouds.py), in its
detection order.

With ``cloud = "auto"``, :func:`cloud_sources` reads DMI (a few small sysfs files) and returns that cloud's
source directly; when DMI is inconclusive (containers often hide ``/sys/class/dmi``) it returns a
:class:`DetectingSource` that probes in the background and then runs the cloud it found, so start-up never
waits on the network.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import structlog

from agent.config import Config
from agent.core.ports import AZURE_ACK
from agent.sources import clouds
from agent.sources.azure import AZURE_ASSET_TAG
from agent.sources.base import Sink, Source
from agent.sources.cloud_http import Backoff, CloudError

log = structlog.get_logger("preemptd.sources.detect")

DMI_FIELDS = (
    "sys_vendor",
    "product_name",
    "product_version",
    "bios_vendor",
    "bios_version",
    "chassis_asset_tag",
)
__all__ = ["AZURE_ASSET_TAG", "DetectingSource", "cloud_from_dmi", "cloud_sources", "probe", "probe_all"]


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
    """The first cloud (in detection order) whose spec says the DMI strings name it, or None."""
    return next((name for name, spec in clouds.clouds().items() if spec.dmi(dmi)), None)


def make_source(cloud: str, config: Config) -> Source:
    return clouds.get(cloud).source(config)


def cloud_sources(config: Config) -> list[Source]:
    """The cloud source for ``config.cloud``: none, the named one, or the detected one."""
    if config.cloud == "none":
        return []
    if config.cloud != "auto":
        return [make_source(config.cloud, config)]
    dmi = read_dmi(config.detect.dmi_dir)
    cloud = cloud_from_dmi(dmi)
    if cloud is not None:
        log.info("cloud_detected", cloud=cloud, about=clouds.get(cloud).about, method="dmi", dmi=dmi)
        return [make_source(cloud, config)]
    return [DetectingSource(config, dmi)]


async def probe(cloud: str, config: Config, timeout_s: float) -> bool:
    """One cheap request (two for AWS without IMDSv2) that only ``cloud``'s metadata service answers so."""
    spec = clouds.get(cloud)
    try:
        result: bool = await asyncio.wait_for(spec.probe(spec.table(config), timeout_s), timeout_s * 2)
    except (CloudError, asyncio.TimeoutError):
        return False
    return result


async def probe_all(config: Config, timeout_s: float) -> str | None:
    """Probe every cloud's configured endpoint at once; the first in detection order that answers wins."""
    names = list(clouds.clouds())
    results = await asyncio.gather(*(probe(cloud, config, timeout_s) for cloud in names))
    for cloud, found in zip(names, results, strict=True):
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
        # What the detected cloud's source offers (Azure: AZURE_ACK); nothing while probing.
        return self.inner.capabilities() if self.inner is not None else {}

    def status(self) -> Mapping[str, Any]:
        doc: dict[str, Any] = {"detected": self.detected, "method": "probe", "dmi": self.dmi}
        if self.inner is not None:
            doc.update(self.inner.status())
        return doc

    async def acknowledge(self, event_id: str) -> None:
        """Azure's ``StartRequests`` through the detected source (see :meth:`AzureSource.acknowledge`)."""
        acknowledge = self.inner.capabilities().get(AZURE_ACK) if self.inner is not None else None
        if acknowledge is None:
            raise CloudError(
                f"cannot acknowledge {event_id!r}: the detected cloud is {self.detected!r}, not Azure"
            )
        await acknowledge(event_id)

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
            first, *rest = clouds.clouds()
            sink.disable(
                f"no cloud detected: DMI sys_vendor is {vendor!r} and no metadata service answered "
                f"(probed for {self.config.detect.probe_retry_s:g} s, {timeout_s:g} s per try); "
                f'set cloud = "{first}" (or {", ".join(rest)}) to choose one, or cloud = "none"'
            )
            return
        log.info("cloud_detected", cloud=self.detected, about=clouds.get(self.detected).about, method="probe")
        self.inner = make_source(self.detected, self.config)
        await self.inner.run(sink)
