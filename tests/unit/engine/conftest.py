"""Engine tests run torch on one thread: the tiny model's matmuls are too small to gain from more, and
on a shared 2-core box extra threads only contend (measured 6x slower)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
