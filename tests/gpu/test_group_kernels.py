"""One-launch paged gather/scatter on a CUDA device: bit-exact against the per-layer torch ops."""

from __future__ import annotations

import pytest
import torch

from kvwire.transfer.memory import KVLayout, gather_blocks
from kvwire.transfer.planes.common import group_kernels

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

SHAPES = {
    KVLayout.KV_FIRST: (2, 300, 16, 8, 128),
    KVLayout.BLOCK_FIRST: (300, 2, 16, 8, 128),
    KVLayout.MLA: (300, 16, 576),
}


def _random_bits(shape: tuple[int, ...]) -> torch.Tensor:
    return torch.randint(-(2**15), 2**15, shape, dtype=torch.int16, device="cuda").view(torch.bfloat16)


# (programs per SM, SMs left free): 0 = one program per tile; else a bounded grid whose programs
# stride over many tiles: the default, 4 per SM, and the most a launch leaves free (a quarter)
GRIDS = [(0, 0), (group_kernels.PROGRAMS_PER_SM, group_kernels.FREE_SMS), (4, 0), (1, 10_000)]


@pytest.mark.parametrize("grid", GRIDS, ids=[f"p{p}-free{f}" for p, f in GRIDS])
@pytest.mark.parametrize("layout", list(SHAPES))
def test_triton_gather_scatter_bit_exact(layout: KVLayout, grid: tuple[int, int]) -> None:
    assert group_kernels.triton_available()
    programs_per_sm, free_sms = grid
    layers = [_random_bits(SHAPES[layout]) for _ in range(5)]
    ids = torch.randperm(300, device="cuda")[:37]
    out = torch.full(group_kernels.group_shape(layers, 37, layout), 7, dtype=torch.int16, device="cuda")
    src = group_kernels.PagedLayers(layers, layout, programs_per_sm, free_sms)
    src.gather(ids, out.view(torch.bfloat16))
    for index, layer in enumerate(layers):
        assert torch.equal(out[index], gather_blocks(layer, ids, layout).view(torch.int16))
    # a middle range of layers only
    part = torch.zeros_like(out[1:4])
    src.gather(ids, part.view(torch.bfloat16), 1, 4)
    assert torch.equal(part, out[1:4])
    dst = [torch.zeros(SHAPES[layout], dtype=torch.bfloat16, device="cuda") for _ in range(5)]
    dst_ids = torch.randperm(300, device="cuda")[:37]
    sink = group_kernels.PagedLayers(dst, layout, programs_per_sm, free_sms)
    sink.scatter(dst_ids, out.view(torch.bfloat16))
    for index, layer in enumerate(dst):
        assert torch.equal(gather_blocks(layer, dst_ids, layout).view(torch.int16), out[index])
        untouched = torch.ones(300, dtype=torch.bool, device="cuda")
        untouched[dst_ids] = False
        rest = layer[:, untouched] if layout is KVLayout.KV_FIRST else layer[untouched]
        assert not rest.view(torch.int16).any()


def test_non_contiguous_layers_fall_back_to_torch() -> None:
    base = _random_bits((2, 64, 16, 8, 256))
    layers = [base[..., :128], base[..., 128:]]  # strided views: not one-launch material
    ids = torch.tensor([3, 9, 1], device="cuda")
    out = group_kernels.gather_layers(layers, ids, KVLayout.KV_FIRST)
    for index, layer in enumerate(layers):
        assert torch.equal(
            out[index].view(torch.int16), gather_blocks(layer, ids, KVLayout.KV_FIRST).view(torch.int16)
        )
