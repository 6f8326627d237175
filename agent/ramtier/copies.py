"""Where a step's copies are, as its ``tier.json`` says (docs/snapshots.md, docs/ram-tier.md): whether the step
is a peer snapshot, and the placement the job's ranks chose (each host whose shards were copied, the host that
holds them and the rule that chose it: another capacity pool, the ring, ...). Written by the job's client, so
checked here field by field; a malformed placement is dropped (the step's files are still good), never trusted.
Pure.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

MAX_HOSTS = 4096  # hosts named in one placement
MAX_TEXT = 512  # a host key ("name:/tier/path"), a rule


def kind_of(doc: Mapping[str, Any]) -> str:
    """``snapshot`` for a peer snapshot, else ``step`` (an evacuated or drained step)."""
    return "snapshot" if doc.get("snapshot") is True else "step"


def placement_of(doc: Mapping[str, Any]) -> dict[str, dict[str, str]]:
    """``{host: {"holder": host, "rule": rule}}`` (and ``"second"``, a snapshot's second remote holder, where
    there is one) from ``doc["placement"]``; empty when absent or malformed."""
    found = doc.get("placement")
    if not isinstance(found, Mapping) or len(found) > MAX_HOSTS:
        return {}
    placement: dict[str, dict[str, str]] = {}
    for host, entry in found.items():
        if not _text(host) or not isinstance(entry, Mapping):
            return {}
        holder, rule = entry.get("holder"), entry.get("rule")
        if not (_text(holder) and _text(rule)):
            return {}
        placement[host] = {"holder": str(holder), "rule": str(rule)}
        if "second" in entry:
            if not _text(entry["second"]):
                return {}
            placement[host]["second"] = str(entry["second"])
    return placement


def _text(value: Any) -> bool:
    return isinstance(value, str) and 0 < len(value) <= MAX_TEXT and value.isprintable()
