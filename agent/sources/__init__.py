"""Notice sources: the contract in :mod:`agent.sources.base`, and which sources a configuration runs."""

from __future__ import annotations

from agent.config import Config
from agent.sources.base import Source
from agent.sources.detect import cloud_sources


def build_sources(config: Config) -> list[Source]:
    """The sources to run for ``config``; ``cloud = "none"`` runs no cloud source."""
    sources: list[Source] = []
    sources.extend(cloud_sources(config))
    if config.gpu.enabled:
        from agent.sources.nvml import NvmlSource

        sources.append(NvmlSource(config.gpu))
    if config.host.enabled:
        from agent.sources.host import HostSource

        sources.append(HostSource(config.host, config.state_dir))
    return sources
