"""kvwire.transfer: moves a request's KV cache, layer by layer, between two processes.

One :class:`TransferAgent` per process (per GPU worker): ZMQ control plane + a data plane
(:class:`Backend` TCP for CPU tensors, NCCL for GPUs; one subpackage each under
:mod:`kvwire.transfer.planes`). Paged gather/scatter helpers live in :mod:`kvwire.transfer.memory`.

The names below are imported on first use (PEP 562), so importing a light submodule such as
``kvwire.transfer.config`` does not import the agent, ZeroMQ or the planes.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvwire.transfer.agent import TransferAgent
    from kvwire.transfer.config import TransferConfig
    from kvwire.transfer.core import TransferStats
    from kvwire.transfer.memory import LayerSink, LayerSpec, TransferEvents
from kvwire.transfer.enums import Backend, FailReason

_HOMES = {
    "TransferAgent": "kvwire.transfer.agent",
    "TransferConfig": "kvwire.transfer.config",
    "TransferStats": "kvwire.transfer.core",
    "Backend": "kvwire.transfer.enums",
    "FailReason": "kvwire.transfer.enums",
    "LayerSink": "kvwire.transfer.memory",
    "LayerSpec": "kvwire.transfer.memory",
    "TransferEvents": "kvwire.transfer.memory",
}

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


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'kvwire.transfer' has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)
