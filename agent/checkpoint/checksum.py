"""CRC32, the checksum of every checkpoint file (manifests' sidecars, tier.json, the evacuation's transfers and
streams, the drain): python-zlib-ng's ``crc32`` when it is installed (the ``torch`` extra installs it), else the
standard library's. The same polynomial and values: zlib-ng computes it with SIMD, several times faster
(bench/RESULTS.md, "CRC32"), which matters inside the window, where every byte of a shard is summed once or
more. Standard library only when zlib-ng is absent."""

from __future__ import annotations

try:
    from zlib_ng.zlib_ng import crc32
except (
    ImportError
):  # pragma: no cover - the test extra installs zlib-ng; the fallback is tested in a subprocess
    from zlib import crc32

FAST = crc32.__module__ != "zlib"

__all__ = ["FAST", "crc32"]
