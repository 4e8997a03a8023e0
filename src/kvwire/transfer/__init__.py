"""kvwire.transfer: moves a request's KV cache, layer by layer, between two processes.

One :class:`TransferAgent` per process (per GPU worker): ZMQ control plane + a data plane
(:class:`Backend` TCP for CPU tensors, NCCL for GPUs; see :mod:`kvwire.transfer.base`).
Paged gather/scatter helpers live in :mod:`kvwire.transfer.paged`.
"""

from kvwire.transfer.agent import TransferAgent
from kvwire.transfer.config import TransferConfig
from kvwire.transfer.stats import TransferStats
from kvwire.transfer.types import Backend, FailReason, LayerSink, LayerSpec, TransferEvents

__all__ = [
    "Backend",
    "FailReason",
    "LayerSink",
    "LayerSpec",
    "TransferAgent",
    "TransferConfig",
    "TransferEvents",
    "TransferStats",
]
