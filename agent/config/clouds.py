"""The tables of the clouds built into the agent (``[aws]``, ``[gcp]``, ``[azure]``, ``[alibaba]``,
``[tencent]``): each cloud's source (agent/sources/<cloud>.py) names its table in its spec. A cloud added
later declares its table next to its source instead (agent/sources/clouds.py, "How to add a cloud" in
docs/internals.md); these stay here so that ``config.aws`` is typed and loads without the sources."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from agent.config.loader import Url
from agent.config.types import (
    AtLeastOne,
    HttpUrl,
    Seconds,
    SecondsUpToADay,
    SecondsUpToAMinute,
    SecondsUpToAnHour,
)


@dataclass(frozen=True)
class AwsConfig:
    """EC2 instance metadata (IMDSv2)."""

    endpoint: HttpUrl = "http://169.254.169.254"
    # spot/instance-action: the two-minute interruption notice (hibernation: none), read every second.
    poll_interval_s: Seconds = 1.0
    # The other paths announce what they announce ahead (docs/clouds.md, "How often each path is read"):
    # a rebalance recommendation and an Auto Scaling termination minutes ahead, scheduled maintenance days.
    rebalance_interval_s: SecondsUpToAMinute = 10.0
    lifecycle_interval_s: SecondsUpToAMinute = 10.0
    maintenance_interval_s: SecondsUpToAnHour = 60.0
    timeout_s: Seconds = 1.0
    token_ttl_s: AtLeastOne = 21600
    # IMDSv1 (no token) only when asked for: it is what SSRF attacks use, and many fleets disable it.
    imdsv1_fallback: bool = False
    backoff_max_s: Seconds = 5.0


@dataclass(frozen=True)
class GcpConfig:
    """Google Compute Engine metadata server; changes arrive through hanging GETs."""

    # Empty: $GCE_METADATA_HOST (as in Google's own clients), else http://metadata.google.internal.
    endpoint: Annotated[str, Url(empty=True)] = ""
    wait_timeout_s: AtLeastOne = 60
    timeout_s: Seconds = 2.0
    backoff_max_s: Seconds = 5.0
    # Seconds between ACPI soft-off and hard power-off of a preempted VM.
    preempt_notice_s: SecondsUpToADay = 30.0
    # How early maintenance-event flips before the host maintenance starts.
    maintenance_notice_s: SecondsUpToADay = 60.0


AzureAcknowledge = Literal["never", "immediate"]


@dataclass(frozen=True)
class AzureConfig:
    """Azure IMDS Scheduled Events."""

    endpoint: HttpUrl = "http://169.254.169.254"
    poll_interval_s: Seconds = 1.0
    timeout_s: Seconds = 1.0
    api_version: str = "2020-07-01"
    instance_api_version: str = "2021-02-01"
    # This VM's name as listed in events' Resources; empty: read compute.name from instance metadata.
    vm_name: str = ""
    # When to send StartRequests for an event that concerns this VM. "never": only when a component calls
    # AzureSource.acknowledge(); "immediate": as soon as the event is seen (shortens the notice window).
    acknowledge: AzureAcknowledge = "never"
    backoff_max_s: Seconds = 5.0
    # Microsoft: the first Scheduled Events call after boot (which enables the service) can take up to two
    # minutes; so may the first after a server error. Those calls get this long instead of timeout_s.
    first_call_timeout_s: Seconds = 120.0


@dataclass(frozen=True)
class AlibabaConfig:
    """Alibaba Cloud ECS metadata."""

    endpoint: HttpUrl = "http://100.100.100.200"
    poll_interval_s: Seconds = 1.0
    timeout_s: Seconds = 1.0
    # The hardened mode: fetch a token first (required when the instance enforces it).
    token: bool = False
    token_ttl_s: AtLeastOne = 21600
    backoff_max_s: Seconds = 5.0


@dataclass(frozen=True)
class TencentConfig:
    """Tencent Cloud CVM metadata."""

    endpoint: HttpUrl = "http://metadata.tencentyun.com"
    poll_interval_s: Seconds = 1.0
    timeout_s: Seconds = 1.0
    backoff_max_s: Seconds = 5.0


# Detection order (DMI, then the metadata probes): the first cloud that answers wins.
BUILTIN_CLOUDS: dict[str, type] = {
    "aws": AwsConfig,
    "gcp": GcpConfig,
    "azure": AzureConfig,
    "alibaba": AlibabaConfig,
    "tencent": TencentConfig,
}
