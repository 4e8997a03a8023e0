"""vLLM's registered KV caches -> the core's per-layer block views."""

from __future__ import annotations

import pytest
import torch

from kvwire.errors import ConfigError
from kvwire.integrations.vllm_layers import block_view, head_view, kv_layers
from kvwire.transfer.memory import KVLayout, gather_blocks, head_slice, scatter_blocks


def test_contiguous_cpu_layout_shares_storage() -> None:
    cache = torch.randn(6, 2, 4, 16)  # [blocks, heads, block_size, 2 * head] (CPU backend)
    view = block_view("l0", cache)
    assert view.shape == (6, 8, 16) and view.data_ptr() == cache.data_ptr()
    ids = torch.tensor([4, 1])
    assert torch.equal(gather_blocks(view, ids, KVLayout.MLA).view(2, 2, 4, 16), cache[[4, 1]])
    scatter_blocks(view, torch.tensor([0]), torch.ones(1, 8, 16), KVLayout.MLA)
    assert torch.equal(cache[0], torch.ones(2, 4, 16))  # written through the view


def test_permuted_block_major_layout() -> None:
    """Logical [B, H, N, C] over physical [B, N, H, C] (an NHD-style layout): blocks stay contiguous."""
    physical = torch.randn(5, 4, 2, 8)  # [B, N, H, C]
    logical = physical.permute(0, 2, 1, 3)  # [B, H, N, C], not contiguous
    view = block_view("l0", logical)
    assert view.data_ptr() == physical.data_ptr()
    assert torch.equal(view[3].reshape(-1), physical[3].reshape(-1))  # whole block bytes, physical order


def test_non_block_major_layout_is_refused() -> None:
    physical = torch.randn(2, 5, 4, 8)  # [H, B, N, C]: a block's bytes are split across heads
    with pytest.raises(ConfigError, match="not block-major"):
        block_view("model.layers.0.self_attn.attn", physical.permute(1, 0, 2, 3))


def test_layers_sorted_by_number_and_shared_caches_dropped() -> None:
    caches = {f"model.layers.{i}.self_attn.attn": torch.zeros(3, 1, 2, 4) for i in (10, 2, 0)}
    caches["model.layers.11.self_attn.attn"] = caches["model.layers.10.self_attn.attn"]  # KV sharing
    layers = kv_layers(caches)
    assert layers.names == tuple(f"model.layers.{i}.self_attn.attn" for i in (0, 2, 10))
    assert layers.index_of("model.layers.10.self_attn.attn") == 2
    assert layers.index_of("model.layers.11.self_attn.attn") is None  # its KV travels with layer 10


def test_no_layers_or_bad_names_fail() -> None:
    with pytest.raises(ConfigError, match="no KV cache layers"):
        kv_layers({})
    with pytest.raises(ConfigError, match="layer number"):
        kv_layers({"attn": torch.zeros(2, 2, 2)})


def test_head_views_of_the_cpu_layout_cut_heads() -> None:
    """CPU backend [B, H, N, C]: heads right inside each block -> BLOCK_HEAD views sharing storage;
    a head range of the view is exactly those heads of the cache."""
    caches = {f"model.layers.{i}.self_attn.attn": torch.randn(6, 2, 4, 16) for i in range(2)}
    layers = kv_layers(caches, local_heads=2)
    assert layers.layout is KVLayout.BLOCK_HEAD
    view, cache = layers.views[0], caches["model.layers.0.self_attn.attn"]
    assert view.shape == (6, 2, 4, 16) and view.data_ptr() == cache.data_ptr()
    second = head_slice(view, range(1, 2), KVLayout.BLOCK_HEAD)
    assert torch.equal(gather_blocks(second, torch.tensor([5, 0]), KVLayout.BLOCK_HEAD), cache[[5, 0], 1:2])


def test_heads_elsewhere_fall_back_to_opaque_layers() -> None:
    """Logical [B, H, N, C] over physical [B, N, H, C]: heads are not right inside the block, so the
    layers stay opaque (MLA: same TP sizes only); with one head per rank any layout can be cut."""
    physical = torch.randn(5, 4, 2, 8)  # [B, N, H, C]
    logical = physical.permute(0, 2, 1, 3)
    assert head_view("l0", logical, 2) is None
    assert kv_layers({"model.layers.0.a": logical}, local_heads=2).layout is KVLayout.MLA
    one = torch.randn(5, 4, 1, 8).permute(0, 2, 1, 3)  # one head
    view = head_view("l0", one, 1)
    assert view is not None and view.shape == (5, 1, 4, 8)
    assert kv_layers({"model.layers.0.a": logical}).layout is KVLayout.MLA  # heads not told: opaque
