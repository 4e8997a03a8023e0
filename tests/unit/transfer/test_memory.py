"""Paged gather/scatter round trips for all three layouts and several dtypes (CPU)."""

from __future__ import annotations

import pytest
import torch

from kvwire.transfer.memory import KVLayout, block_ids_tensor, gather_blocks, gathered_shape, scatter_blocks

SHAPES = {
    KVLayout.KV_FIRST: (2, 10, 4, 3, 8),
    KVLayout.BLOCK_FIRST: (10, 2, 4, 3, 8),
    KVLayout.MLA: (10, 4, 24),
    KVLayout.BLOCK_HEAD: (10, 3, 4, 16),
}


def _random(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=gen).to(dtype)


@pytest.mark.parametrize("layout", list(KVLayout))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_gather_then_scatter_moves_exactly_the_selected_blocks(layout: KVLayout, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    src = _random(SHAPES[layout], dtype, gen)
    dst = torch.zeros_like(src)
    src_ids = [7, 2, 5]
    dst_ids = [0, 9, 3]
    data = gather_blocks(src, block_ids_tensor(src_ids, "cpu"), layout)
    assert tuple(data.shape) == gathered_shape(src, 3, layout)
    assert data.is_contiguous()
    scatter_blocks(dst, block_ids_tensor(dst_ids, "cpu"), data, layout)
    dim = 1 if layout is KVLayout.KV_FIRST else 0
    for s, d in zip(src_ids, dst_ids, strict=True):
        assert torch.equal(src.select(dim, s), dst.select(dim, d))
    untouched = [i for i in range(10) if i not in dst_ids]
    assert torch.count_nonzero(dst.index_select(dim, torch.tensor(untouched))) == 0


def test_gather_into_out_buffer_reuses_it() -> None:
    src = torch.arange(2 * 6 * 2 * 1 * 2, dtype=torch.float32).reshape(2, 6, 2, 1, 2)
    out = torch.empty(gathered_shape(src, 2, KVLayout.KV_FIRST))
    res = gather_blocks(src, block_ids_tensor([4, 1], "cpu"), KVLayout.KV_FIRST, out=out)
    assert res.data_ptr() == out.data_ptr()
    assert torch.equal(out[:, 0], src[:, 4]) and torch.equal(out[:, 1], src[:, 1])


def test_bad_shapes_are_rejected() -> None:
    with pytest.raises(ValueError, match="kv_first"):
        gather_blocks(torch.zeros(3, 4, 2, 1, 1), block_ids_tensor([0], "cpu"), KVLayout.KV_FIRST)
    with pytest.raises(ValueError, match="does not match"):
        ids = block_ids_tensor([0], "cpu")
        scatter_blocks(torch.zeros(2, 4, 2, 1, 1), ids, torch.zeros(2, 2, 2, 1, 1), KVLayout.KV_FIRST)


def test_copy_grid_leaves_sms_to_nccl_but_at_most_a_quarter() -> None:
    from kvwire.transfer.planes.common.group_kernels import copy_grid

    assert copy_grid(132) == 100  # H200: 32 SMs free for NCCL's CTAs
    assert copy_grid(132, 4, 0) == 528
    assert copy_grid(132, 1, 10_000) == 99  # never more than a quarter free
    assert copy_grid(40) == 30  # a small GPU still copies on most of its SMs
    assert copy_grid(1) == 1
    assert copy_grid(132, 0) == 0  # unbounded: one program per tile
