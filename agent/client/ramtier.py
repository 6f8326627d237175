"""The RAM tier's client where docs/client.md and the README name it; it lives in :mod:`agent.client.peer.ramtier`."""

from agent.client.peer.ramtier import (
    TIER_FILE,
    NoJobId,
    RamTier,
    RamTierError,
    Reservation,
    file_entry,
    job_id,
    read_tier_file,
    resolve_job_id,
    write_tier_file,
)

__all__ = [
    "TIER_FILE",
    "NoJobId",
    "RamTier",
    "RamTierError",
    "Reservation",
    "file_entry",
    "job_id",
    "read_tier_file",
    "resolve_job_id",
    "write_tier_file",
]
