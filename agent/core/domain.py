"""This host's failure domain, from the instance identity its cloud source read: the cloud, instance type,
zone, capacity type (``spot``, ``on-demand``, …) and placement group where the cloud tells it. ``pool`` is
(cloud, instance type, zone, capacity): the capacity pool that spot interruptions hit together
(docs/ram-tier.md, "Failure domains and placement"). A field the cloud does not serve, or serves malformed,
is left empty; the domain never fails for it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# The capability under which the agent offers its domain (a callable returning a Domain or None).
DOMAIN = "domain"

FIELDS = ("cloud", "instance_type", "zone", "capacity", "group")
# A field is printable ASCII without spaces or "/" (the separator of the string form), at most 128 long.
_FIELD = re.compile(r"^[\x21-\x2e\x30-\x7e]{1,128}$")

# Each cloud's identity keys (as its source reads them) for the instance type, the zone and the group.
_KEYS: Mapping[str, tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]] = {
    "aws": (("instance_type",), ("zone",), ("placement_group",)),
    "gcp": (("machine_type",), ("zone",), ()),
    "azure": (("vm_size",), ("zone", "location"), ("placement_group_id",)),
    "alibaba": (("instance_type",), ("zone",), ()),
    "tencent": (("instance_type",), ("zone",), ()),
}
_AWS_CAPACITY = {"spot": "spot", "on-demand": "on-demand", "scheduled": "scheduled"}
_AZURE_CAPACITY = {"spot": "spot", "regular": "on-demand", "low": "low-priority"}


def _field(value: Any) -> str:
    text = value.strip() if isinstance(value, str) else ""
    return text if _FIELD.match(text) else ""


@dataclass(frozen=True)
class Domain:
    cloud: str = ""
    instance_type: str = ""
    zone: str = ""
    capacity: str = ""
    group: str = ""

    @property
    def pool(self) -> tuple[str, str, str, str]:
        return (self.cloud, self.instance_type, self.zone, self.capacity)

    @property
    def pool_name(self) -> str:
        """``aws/p4d.24xlarge/us-east-1a/spot``; ``?`` for a field not known."""
        return "/".join(part or "?" for part in self.pool)

    def __str__(self) -> str:
        return self.pool_name + (f" group {self.group}" if self.group else "")

    def to_json(self) -> dict[str, str]:
        doc = {name: getattr(self, name) for name in FIELDS}
        doc.update(pool=self.pool_name, text=str(self))
        return doc

    @classmethod
    def from_json(cls, doc: Any) -> Domain | None:
        """The domain of an agent's document (status ``agent.domain``, the RAM tier's ``domain``); None when
        it has none or it is not a domain (an older agent)."""
        if not isinstance(doc, Mapping):
            return None
        domain = cls(**{name: _field(doc.get(name)) for name in FIELDS})
        return domain if domain.cloud else None


def _capacity(cloud: str, instance: Mapping[str, Any]) -> str:
    if cloud == "aws":
        return _AWS_CAPACITY.get(_field(instance.get("life_cycle")).lower(), "")
    if cloud == "azure":
        return _AZURE_CAPACITY.get(_field(instance.get("priority")).lower(), "")
    if cloud == "gcp":
        model = _field(instance.get("provisioning_model")).upper()
        preemptible = _field(instance.get("preemptible")).upper()
        if model == "SPOT":
            return "spot"
        if preemptible == "TRUE":
            return "preemptible"
        if model == "STANDARD" or preemptible == "FALSE":
            return "on-demand"
    return ""


def _first(instance: Mapping[str, Any], keys: tuple[str, ...]) -> str:
    return next((found for found in (_field(instance.get(key)) for key in keys) if found), "")


def domain_of(cloud: str | None, instance: Mapping[str, Any]) -> Domain | None:
    """The domain of ``instance`` (an identity as the cloud's source reads it) on ``cloud``; None until a
    source has identified the instance."""
    name = _field(cloud)
    if not name or not instance:
        return None
    type_keys, zone_keys, group_keys = _KEYS.get(name, (("instance_type",), ("zone",), ()))
    return Domain(
        name,
        _first(instance, type_keys),
        _first(instance, zone_keys),
        _capacity(name, instance),
        _first(instance, group_keys),
    )
