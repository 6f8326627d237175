"""The bridges' fixtures: the session's Slurm cluster, left clean after each test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.slurm_cluster import SlurmCluster


@pytest.fixture
def cluster(slurm: SlurmCluster) -> Iterator[SlurmCluster]:
    """The module's cluster, with no job left and the node back in service after each test."""
    yield slurm
    slurm.cancel_all()
    slurm.wait_node(lambda n: not n["states"] & {"DRAIN", "DRAINED", "DRAINING", "ALLOCATED", "MIXED"})
