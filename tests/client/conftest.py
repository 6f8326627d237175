"""The client's fixtures: a gloo group of one in this process."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture
def group_of_one() -> Iterator[None]:
    dist = pytest.importorskip("torch.distributed")  # a skip, as every torch test here, without torch

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()
