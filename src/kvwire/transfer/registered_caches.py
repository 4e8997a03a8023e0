"""A worker's registered paged KV caches, and the fastest way each data plane moves their blocks.

The connector registers its KV caches once (:meth:`kvwire.transfer.TransferAgent.register_kv_caches`)
and then hands the agent *block ids*, never gathered copies. The agent picks, per plane:

* a plane with ``supports_spans`` (TCP): the blocks' byte spans inside the cache — the socket reads
  from / writes into the blocks themselves, no gather or scatter copy (:meth:`PagedKV.spans`);
* a plane with device producers/consumers (NCCL): the plane gathers each message's layers from the
  cache into a per-transfer slab right before sending it (one launch per message,
  :class:`~kvwire.transfer.planes.common.group_kernels.SlabGather`), and the receiver's stream scatters each
  layer into its blocks behind the receive, gated so a cancelled receive never writes
  (:meth:`PagedKV.consumer`); no host synchronization per layer;
* otherwise: one gather copy per layer on the sender and one scatter on arrival (the sink path).

Geometry: P sends the whole prompt's blocks. D may hold a prefix already (``skip_blocks``) or load
fewer blocks; a :class:`BlockTarget` says which of the payload's blocks land where. Only a target
that takes the payload exactly (``skip_blocks == 0`` and as many blocks as P sent) can receive in
place; any other lands through the copy path (:meth:`PagedKV.write`), which narrows the payload.

Threads: built on the agent's caller thread; :meth:`write` and the consumers run on transfer threads
(they only read the registered tensors, which never change after registration).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import threading
from collections.abc import Sequence

import torch

from kvwire.errors import ConfigError
from kvwire.transfer.block_copy import (
    BLOCK_DIM,
    block_spans,
    gather_blocks,
    gathered_shape,
    head_slice,
    scatter_blocks,
)
from kvwire.transfer.enums import KVLayout
from kvwire.transfer.types import GATE_MAGIC, ByteSpans, DeviceConsumer, LayerSpec, RecvItem

_SLABS_PER_SHAPE = 4  # idle send slabs kept per shape (a serving instance reuses a few buckets)


@dataclasses.dataclass(frozen=True)
class BlockTarget:
    """Where an incoming transfer lands: ``block_ids`` of every registered layer, in token order.
    The payload's first ``skip_blocks`` blocks are already present (not written); payload blocks
    past ``skip_blocks + len(block_ids)`` are dropped."""

    block_ids: tuple[int, ...]
    skip_blocks: int = 0
    # Only these KV heads of each block (a tensor-parallel peer owns a head range); None: all.
    heads: range | None = None

    def __post_init__(self) -> None:
        if self.skip_blocks < 0:
            raise ValueError("BlockTarget.skip_blocks must be >= 0")


class PagedKV:
    """The registered caches (one tensor per KV-bearing layer, all in ``layout``)."""

    def __init__(self, layers: Sequence[torch.Tensor], layout: KVLayout) -> None:
        if not layers:
            raise ConfigError("register_kv_caches needs at least one KV layer")
        self.layers = list(layers)
        self.layout = layout
        self.device = self.layers[0].device
        for layer in self.layers:
            gathered_shape(layer, 1, layout)  # validates the layout's rank
        self.contiguous = all(layer.is_contiguous() for layer in self.layers)
        self._group: object | None = None  # group_kernels.PagedLayers, built on first device use
        self._group_lock = threading.Lock()
        self._slabs: dict[tuple[tuple[int, ...], torch.dtype], collections.deque[torch.Tensor]] = {}
        self._slab_lock = threading.Lock()
        self._views: dict[tuple[int, int], PagedKV] = {}  # head range -> the caches restricted to it

    def heads(self, heads: range | None) -> PagedKV:
        """The caches restricted to KV ``heads`` (itself for None): views that are not contiguous,
        so transfers of a head range take the copy path. Built once per range."""
        if heads is None:
            return self
        key = (heads.start, heads.stop)
        with self._group_lock:
            view = self._views.get(key)
            if view is None:
                view = PagedKV([head_slice(layer, heads, self.layout) for layer in self.layers], self.layout)
                self._views[key] = view
            return view

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def num_blocks(self, layer_index: int) -> int:
        return int(self.layers[layer_index].shape[BLOCK_DIM[self.layout]])

    def spec(self, layer_index: int, num_blocks: int) -> LayerSpec:
        """The payload of ``num_blocks`` blocks of one layer (what the sender announces)."""
        layer = self.layers[layer_index]
        return LayerSpec(gathered_shape(layer, num_blocks, self.layout), layer.dtype)

    def block_bytes(self, layer_index: int) -> int:
        layer = self.layers[layer_index]
        return layer.numel() * layer.element_size() // max(self.num_blocks(layer_index), 1)

    # --- host paths -----------------------------------------------------------------------------

    def spans(self, layer_index: int, block_ids: Sequence[int]) -> ByteSpans:
        """The blocks' bytes in place (planes with ``supports_spans``; contiguous caches only)."""
        return block_spans(self.layers[layer_index], block_ids, self.layout)

    def gather(self, layer_index: int, block_ids: torch.Tensor) -> torch.Tensor:
        """One layer's blocks as a new contiguous payload (the copy path)."""
        return gather_blocks(self.layers[layer_index], block_ids, self.layout)

    def takes_exactly(self, target: BlockTarget, layer_index: int, num_bytes: int) -> bool:
        """True when a payload of ``num_bytes`` lands in ``target``'s blocks with nothing skipped or
        dropped (the in-place paths need that)."""
        if target.skip_blocks:
            return False
        return num_bytes == len(target.block_ids) * self.block_bytes(layer_index)

    def write(self, layer_index: int, target: BlockTarget, data: torch.Tensor) -> None:
        """Scatter an arrived payload (any device) into ``target``, skipping the blocks D already holds
        and dropping blocks past its own (the copy path; raises ValueError on a shape mismatch)."""
        layer = self.layers[layer_index]
        dim = BLOCK_DIM[self.layout]
        block_shape = list(gathered_shape(layer, 1, self.layout))
        if data.dtype != layer.dtype or data.numel() % max(math.prod(block_shape), 1):
            raise ValueError(f"payload {tuple(data.shape)} {data.dtype} does not fit {layer.dtype} blocks")
        if data.dim() != layer.dim():  # a flat buffer: shape it as whole blocks
            block_shape[dim] = data.numel() // math.prod(block_shape)
            data = data.view(block_shape)
        sent = int(data.shape[dim])
        end = min(sent, target.skip_blocks + len(target.block_ids))
        count = max(end - target.skip_blocks, 0)
        if count == 0:
            return
        ids = torch.tensor(target.block_ids[:count], dtype=torch.int64)
        scatter_blocks(layer, ids, data.narrow(dim, target.skip_blocks, count), self.layout)

    # --- device paths (GPU planes) --------------------------------------------------------------

    def group(self) -> object:
        """The layers as one :class:`~kvwire.transfer.planes.common.group_kernels.PagedLayers`
        (built once)."""
        with self._group_lock:
            if self._group is None:
                from kvwire.transfer.planes.common.group_kernels import PagedLayers

                self._group = PagedLayers(self.layers, self.layout)
            return self._group

    def take_slab(self, num_blocks: int, allocate: object) -> torch.Tensor:
        """A send slab ``[L, *payload shape]`` for a transfer of ``num_blocks`` blocks: an idle one of
        that shape (same address from one transfer to the next, so a plane can replay captured sends)
        or a new one from ``allocate(shape, dtype)``. Give it back with :meth:`give_slab`."""
        shape = (self.num_layers, *self.spec(0, num_blocks).shape)
        dtype = self.layers[0].dtype
        with self._slab_lock:
            idle = self._slabs.get((shape, dtype))
            if idle:
                return idle.popleft()
        assert callable(allocate)
        slab: torch.Tensor = allocate(shape, dtype)
        return slab

    def give_slab(self, slab: torch.Tensor) -> None:
        with self._slab_lock:
            idle = self._slabs.setdefault((tuple(slab.shape), slab.dtype), collections.deque())
            if len(idle) < _SLABS_PER_SHAPE:
                idle.append(slab)

    def uniform(self) -> bool:
        """Every layer has the same shape and dtype (a slab of back-to-back layers needs that)."""
        first = self.layers[0]
        return all(layer.shape == first.shape and layer.dtype == first.dtype for layer in self.layers)

    def consumer(self, target: BlockTarget) -> DeviceConsumer:
        """A device consumer that scatters each received layer (``item.dest``) into ``target``'s
        blocks on the plane's stream, gated (see :data:`~kvwire.transfer.types.DeviceConsumer`).
        Only for targets that take the payload exactly."""
        group = self.group()
        ids = torch.tensor(target.block_ids, dtype=torch.int64)
        if self.device.type == "cuda":
            ids = ids.pin_memory().to(self.device, non_blocking=True)
        host_gate = self.device.type != "cuda"

        def consume(items: Sequence[RecvItem], gate: torch.Tensor) -> None:
            if host_gate and not _gate_open(gate):  # a CPU plane: the gate is checked here
                return
            for item in items:
                index = item.layer_index
                spec = self.spec(index, len(target.block_ids))
                data = item.dest.view(spec.dtype).view(spec.shape)
                group.scatter(  # type: ignore[attr-defined]
                    ids, data.unsqueeze(0), index, index + 1, gate=None if host_gate else gate
                )

        return consume

    def device_paths(self) -> bool:
        """The device producer/consumer paths apply: uniform layers and, on a GPU, gated scatters."""
        if not self.uniform():
            return False
        if self.device.type != "cuda":
            return True
        return bool(self.group().gated_scatter)  # type: ignore[attr-defined]


def _gate_open(gate: torch.Tensor) -> bool:
    magic, real, armed = (int(v) for v in gate[:3].tolist())
    return magic == GATE_MAGIC and real == 1 and armed == 1
