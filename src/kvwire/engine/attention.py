"""Attention over the paged KV cache.

KV cache of one layer: ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (K then V); token ``t``
of a request lives in block ``block_ids[t // block_size]`` at offset ``t % block_size``, i.e. at flat
slot ``block_id * block_size + offset``. Queries are packed: the batch's new tokens are concatenated
``[T, heads, head_dim]``, decodes (one new token) first, then prefill chunks.

Three paths compute the same thing: :func:`reference_attention` (plain torch math, one sequence at a
time: the oracle), :func:`sdpa_attention` (torch SDPA; decodes batched over gathered blocks, a
prompt with no earlier KV attends over its own fresh K/V like a dense forward) and, on the CPU in
float32, the same with the decodes computed by a small C kernel that reads the blocks in place
(``_paged_attention.c``, decision 148: no gathered copy of the KV; :data:`NATIVE_DECODE`) and the
whole prompts by another, all of a step's in one call per layer (``_prompt_attention.c``, decision
152: q/k/v read where the fused qkv projection left them; :data:`NATIVE_PROMPT`).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import logging
from types import ModuleType
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F

from kvwire.connector.base import WorkerConnector
from kvwire.engine.config import AttentionBackend

log = logging.getLogger(__name__)

# The decode kernel: a C extension built by ``pip install`` wherever a C compiler is found (setup.py,
# optional). Without it the paged backend decodes through torch (gather + SDPA), logging a warning
# once; the values agree within float32 rounding (tests/unit/engine/test_paged_decode.py).


def _optional_kernel(name: str) -> tuple[ModuleType | None, str]:
    """A native kernel module, or None and why not (built without a C compiler: torch runs instead)."""
    try:
        return importlib.import_module(f"kvwire.engine.{name}"), ""
    except ImportError as exc:
        return None, str(exc)


_native, NATIVE_DECODE_ERROR = _optional_kernel("_paged_attention")
#: True when the native decode kernel is built (docs/decisions/148-paged-decode-attention-kernel.md)
NATIVE_DECODE = _native is not None
# The prompt kernel (decision 152), optional the same way: without it whole prompts take SDPA.
_prompt_native, NATIVE_PROMPT_ERROR = _optional_kernel("_prompt_attention")
#: True when the native prompt kernel is built (docs/decisions/152-prompt-attention-kernel.md)
NATIVE_PROMPT = _prompt_native is not None
_PROMPT_DIMS: tuple[int, ...] = tuple(_prompt_native.prompt_dims) if _prompt_native is not None else ()
# what runs instead of each kernel not built, logged once each
_FALLBACKS = {
    "decode": "decode attention gathers the KV blocks and runs torch SDPA",
    "prompt": "prompt attention runs torch SDPA once per prompt",
}
_warned: set[str] = set()  # the fallbacks logged


def resolve_backend(backend: AttentionBackend, device: torch.device, dtype: torch.dtype) -> AttentionBackend:
    """The backend a model runner uses: ``auto`` is ``paged`` on the CPU in float32 (the native
    decode and prompt kernels), ``sdpa`` elsewhere. Logs each fallback's warning once when ``paged``
    is chosen and a kernel is not built."""
    if backend is AttentionBackend.AUTO:
        cpu_fp32 = device.type == "cpu" and dtype == torch.float32
        backend = AttentionBackend.PAGED if cpu_fp32 else AttentionBackend.SDPA
    if backend is AttentionBackend.PAGED and _native is None:
        _warn_once("decode", NATIVE_DECODE_ERROR)
    if backend is AttentionBackend.PAGED and _prompt_native is None:
        _warn_once("prompt", NATIVE_PROMPT_ERROR)
    return backend


def describe_decode() -> str:
    """Which decode attention the paged backend runs, for logs and benchmark tables."""
    return "native" if _native is not None else f"torch ({NATIVE_DECODE_ERROR})"


def _warn_once(kernel: str, error: str) -> None:
    if kernel not in _warned:
        _warned.add(kernel)
        log.warning(
            "%s (the native kernel is not built: %s); reinstall kvwire where a C compiler is available",
            _FALLBACKS[kernel], error,
        )


@dataclasses.dataclass
class AttentionMetadata:
    """Where the step's tokens go and what they attend to. Built by the model runner."""

    slot_mapping: torch.Tensor  # [T] int64: flat KV slot of each new token
    block_tables: torch.Tensor  # [B, max_blocks] int64, padded with block 0
    seq_lens_t: torch.Tensor  # [B] int64 (device): KV length of each sequence after this step
    query_start_loc: list[int]  # B + 1 offsets into the packed tokens
    seq_lens: list[int]  # host copy of seq_lens_t
    num_decodes: int  # the first num_decodes sequences have exactly one new token
    block_size: int
    _decode_kv: torch.Tensor | None = dataclasses.field(default=None, init=False, repr=False)
    _decode_bias: torch.Tensor | None = dataclasses.field(default=None, init=False, repr=False)
    _decode_q: tuple[torch.Tensor, npt.NDArray[np.float32]] | None = dataclasses.field(
        default=None, init=False, repr=False
    )

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @functools.cached_property
    def decode_mask(self) -> torch.Tensor:
        """[num_decodes, 1, 1, max_blocks * block_size] bool: which gathered slots hold a decode's KV
        (built once per step, shared by every layer)."""
        nd = self.num_decodes
        slots = torch.arange(self.block_tables.shape[1] * self.block_size, device=self.block_tables.device)
        return (slots[None, :] < self.seq_lens_t[:nd, None])[:, None, None, :]

    def decode_bias(self, dtype: torch.dtype) -> torch.Tensor:
        """:attr:`decode_mask` as the additive mask SDPA turns a boolean one into (0 where visible,
        -inf elsewhere), in the queries' dtype: built once per step instead of once per layer."""
        bias = self._decode_bias
        if bias is None or bias.dtype != dtype:
            mask = self.decode_mask
            bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
            self._decode_bias = bias
        return bias

    @functools.cached_property
    def decode_blocks(self) -> torch.Tensor:
        """[num_decodes * max_blocks] int64: the KV blocks the decodes read, row by row (built once
        per step, shared by every layer)."""
        return self.block_tables[: self.num_decodes].flatten()

    def decode_kv_buffer(self, kv_cache: torch.Tensor) -> torch.Tensor:
        """[2, num_decodes * max_blocks, block_size * heads * dim]: where a layer gathers its decodes'
        K and V. One buffer per step, reused by every layer (each layer's attention has read it before
        the next layer gathers), so a step allocates it once instead of once per layer."""
        _, _, block_size, heads, dim = kv_cache.shape
        shape = (2, self.decode_blocks.shape[0], block_size * heads * dim)
        buf = self._decode_kv
        if buf is None or buf.shape != shape or buf.dtype != kv_cache.dtype or buf.device != kv_cache.device:
            buf = self._decode_kv = torch.empty(shape, dtype=kv_cache.dtype, device=kv_cache.device)
        return buf

    def decode_query(self, q: torch.Tensor) -> npt.NDArray[np.float32]:
        """The decodes' queries ``q`` ([B, Hq, D]) copied into one contiguous float32 buffer a step,
        as the native kernel reads them: every layer copies into the same buffer (the kernel has read
        it before the next layer runs) and hands the kernel the same numpy view (decision 154: one op
        a layer instead of a copy and a view)."""
        held = self._decode_q
        if held is None or held[0].shape != q.shape:
            buf = torch.empty(q.shape, dtype=torch.float32, device=q.device)
            held = self._decode_q = (buf, buf.numpy())
        held[0].copy_(q)
        return held[1]

    @functools.cached_property
    def decode_tables_np(self) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """The decodes' block tables and KV lengths as the native kernel reads them (int64 numpy
        views, built once per step, shared by every layer)."""
        nd = self.num_decodes
        return self.block_tables[:nd].contiguous().numpy(), self.seq_lens_t[:nd].contiguous().numpy()

    @functools.cached_property
    def whole_prompts_np(self) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """The first packed row and the length of every whole prompt (a sequence after the decodes
        with no earlier KV), for the native prompt kernel (built once per step)."""
        whole = [i for i, mask in enumerate(self.chunk_masks, start=self.num_decodes) if mask is None]
        starts = np.array([self.query_start_loc[i] for i in whole], dtype=np.int64)
        return starts, np.array([self.seq_lens[i] for i in whole], dtype=np.int64)

    @functools.cached_property
    def chunk_masks(self) -> list[torch.Tensor | None]:
        """Per sequence after the decodes: [Q, max_blocks * block_size] bool, which gathered slots
        each of its queries sees (causal); None for a whole prompt in one chunk, which attends over
        its own K/V (built once per step, shared by every layer)."""
        device = self.block_tables.device
        slots = torch.arange(self.block_tables.shape[1] * self.block_size, device=device)
        masks: list[torch.Tensor | None] = []
        for i in range(self.num_decodes, self.num_seqs):
            seq_len, q_len = self.seq_lens[i], self.query_start_loc[i + 1] - self.query_start_loc[i]
            q_pos = torch.arange(seq_len - q_len, seq_len, device=device)
            masks.append(None if seq_len == q_len else slots[None, :] <= q_pos[:, None])
        return masks


@dataclasses.dataclass
class ForwardContext:
    """Per-forward state the attention layers need. ``attn is None`` = dense causal attention over
    one sequence, no cache, no connector (the baseline forward of the benchmark)."""

    attn: AttentionMetadata | None
    kv_caches: list[torch.Tensor]
    connector: WorkerConnector | None
    backend: AttentionBackend = AttentionBackend.SDPA


def attention(
    layer_index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: ForwardContext
) -> torch.Tensor:
    """q: [T, Hq, D], k/v: [T, Hkv, D] for the step's new tokens -> [T, Hq, D].

    Calls the worker connector around the KV write exactly as vLLM's V1 attention does: wait for
    this layer's remote KV, write the new K/V into the cache, hand the layer to the connector."""
    meta = ctx.attn
    if meta is None:
        return _sdpa(q, k, v, causal=True)
    kv_cache = ctx.kv_caches[layer_index]
    if ctx.connector is not None:
        ctx.connector.wait_for_layer_load(layer_index)
    write_kv(kv_cache, k, v, meta.slot_mapping)
    if ctx.connector is not None:
        ctx.connector.save_kv_layer(layer_index, kv_cache)
    if ctx.backend is AttentionBackend.REFERENCE:
        return reference_attention(q, kv_cache, meta)
    return sdpa_attention(q, k, v, kv_cache, meta, paged=ctx.backend is AttentionBackend.PAGED)


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter the new K/V ([T, Hkv, D]) into their slots of ``kv_cache``."""
    _, num_blocks, block_size, heads, dim = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, heads, dim)
    if k.dtype != kv_cache.dtype or v.dtype != kv_cache.dtype:  # a cast to the same dtype: no dispatch
        k, v = k.to(kv_cache.dtype), v.to(kv_cache.dtype)
    flat[0].index_copy_(0, slot_mapping, k)
    flat[1].index_copy_(0, slot_mapping, v)


def gather_kv(kv_cache: torch.Tensor, block_table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[2, NB, BS, H, D] and [..., max_blocks] -> K, V of shape [..., max_blocks * BS, H, D]."""
    k = kv_cache[0][block_table]  # [..., MB, BS, H, D]
    v = kv_cache[1][block_table]
    return k.flatten(-4, -3), v.flatten(-4, -3)


def reference_attention(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """Readable oracle: per sequence, gather its KV, causal softmax(q k^T / sqrt(D)) v in fp32."""
    out = torch.empty_like(q)
    group = q.shape[1] // kv_cache.shape[3]
    for i in range(meta.num_seqs):
        start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        seq_len = meta.seq_lens[i]
        k, v = gather_kv(kv_cache, meta.block_tables[i])
        k = k[:seq_len].float().repeat_interleave(group, dim=1)  # [L, Hq, D]
        v = v[:seq_len].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[start:end].float(), k) / q.shape[-1] ** 0.5
        q_pos = torch.arange(seq_len - (end - start), seq_len, device=q.device)
        visible = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]  # [Q, L]
        probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
    return out


def sdpa_attention(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    *,
    paged: bool = False,
) -> torch.Tensor:
    """Prompt rows by SDPA; decode rows by SDPA over gathered blocks. With ``paged`` (where the
    kernels are built and the cache is float32 on the CPU), decode rows by the native kernel over the
    blocks in place and whole prompts by the native prompt kernel, all in one call."""
    nd = meta.num_decodes
    decode = _decode_native if paged and _native_fits(kv_cache) else _decode_sdpa
    if nd == q.shape[0]:  # a decode-only step: no packed output to assemble
        return decode(q, kv_cache, meta)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if nd:
        out[:nd] = decode(q[:nd], kv_cache, meta)
    native_prompts = paged and _prompt_fits(q, k_new, v_new)
    if native_prompts and len(meta.whole_prompts_np[0]):
        _prompts_native(out, q, k_new, v_new, *meta.whole_prompts_np)
    for i, mask in enumerate(meta.chunk_masks, start=nd):
        start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
        if mask is None and native_prompts:
            continue  # computed above
        if mask is None:  # a whole prompt in one chunk: its own K/V, like a dense forward
            out[start:end] = _sdpa(q[start:end], k_new[start:end], v_new[start:end], causal=True)
            continue
        k, v = gather_kv(kv_cache, meta.block_tables[i])
        out[start:end] = _sdpa(q[start:end], k, v, mask=mask)
    return out


def _native_fits(kv_cache: torch.Tensor) -> bool:
    return _native is not None and kv_cache.dtype == torch.float32 and kv_cache.device.type == "cpu"


def _prompt_fits(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the prompt kernel computes these ([T, heads, D] float32 on the CPU, D one it takes)."""
    return (
        _prompt_native is not None
        and q.shape[-1] in _PROMPT_DIMS
        and all(t.dtype == torch.float32 and t.device.type == "cpu" for t in (q, k, v))
    )


def _prompts_native(
    out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    starts: npt.NDArray[np.int64],
    lens: npt.NDArray[np.int64],
) -> None:
    """Rows ``starts[i] .. starts[i] + lens[i]`` of ``out`` ([T, Hq, D], contiguous): each whole
    prompt's causal attention over its own rows of ``k``/``v`` ([T, Hkv, D]); other rows untouched.
    q, k and v are read where they lie (views of the fused qkv projection: no copy)."""
    assert _prompt_native is not None
    tokens, heads, dim = q.shape
    (qb, qo, qr), (kb, ko, kr), (vb, vo, vr) = _rows(q), _rows(k), _rows(v)
    kv_heads, scale = k.shape[1], dim**-0.5
    _prompt_native.prompt(
        out.numpy(), qb, qo, qr, kb, ko, kr, vb, vo, vr, starts, lens, tokens, heads, kv_heads, dim, scale
    )


def _rows(t: torch.Tensor) -> tuple[npt.NDArray[Any], int, int]:
    """``t`` ([T, H, D]) as the prompt kernel reads it: its storage as a flat buffer, the offset of
    its first row, the elements between rows. A layout whose heads do not lie together is copied."""
    if t.stride(2) != 1 or t.stride(1) != t.shape[2] or t.stride(0) < t.shape[1] * t.shape[2]:
        t = t.contiguous()
    flat = torch.empty(0, dtype=t.dtype).set_(t.untyped_storage())
    return flat.numpy(), int(t.storage_offset()), int(t.stride(0))


def _decode_native(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """One query per sequence, [B, Hq, D]: the C kernel's one pass over each sequence's blocks."""
    assert _native is not None
    out = torch.empty(q.shape, dtype=torch.float32)
    tables, lens = meta.decode_tables_np
    _, blocks, block_size, kv_heads, dim = kv_cache.shape
    shape = (blocks, block_size, kv_heads, q.shape[1], dim)
    _native.decode(out.numpy(), meta.decode_query(q), kv_cache.numpy(), tables, lens, *shape, dim**-0.5)
    return out


def _decode_sdpa(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """One query per sequence, [B, Hq, D]. The query heads that share a KV head are laid out as that
    KV head's query "positions" ([B, Hkv, group, D]), so SDPA needs no GQA expansion of K/V."""
    batch, num_heads, dim = q.shape
    _, num_blocks, block_size, num_kv_heads, _ = kv_cache.shape
    # K and V of every decode in one gather of whole blocks: [2, B, L, Hkv, D]
    blocks = kv_cache.view(2, num_blocks, block_size * num_kv_heads * dim)
    kv = torch.index_select(blocks, 1, meta.decode_blocks, out=meta.decode_kv_buffer(kv_cache))
    kv = kv.view(2, batch, -1, num_kv_heads, dim)
    out = F.scaled_dot_product_attention(
        q.view(batch, num_kv_heads, num_heads // num_kv_heads, dim),
        kv[0].transpose(1, 2),
        kv[1].transpose(1, 2),
        attn_mask=meta.decode_bias(q.dtype),
    )  # [B, Hkv, group, D]
    return out.reshape(batch, num_heads, dim)


def _sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """One sequence. q: [Q, Hq, D], k/v: [L, Hkv, D] (token-major), mask: [Q, L] -> [Q, Hq, D].

    K/V heads are expanded to the query heads explicitly (cheap next to the attention itself) and
    the inputs are 4-D, so that the fused CUDA kernels (flash / memory-efficient) qualify."""
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],  # [1, Hq, Q, D]
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        attn_mask=None if mask is None else mask[None, None],
        is_causal=causal,
    )
    return out[0].transpose(0, 1)
