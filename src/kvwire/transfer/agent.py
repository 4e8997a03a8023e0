"""TransferAgent: per-process KV transfer endpoint (stub; being implemented)."""

from __future__ import annotations

from collections.abc import Sequence
from types import TracebackType
from typing import Any

import torch

from kvwire.transfer.config import TransferConfig
from kvwire.transfer.stats import TransferStats
from kvwire.transfer.types import LayerSink, LayerSpec, TransferEvents


class TransferAgent:
    """See the team brief for the API; the implementation replaces these stubs."""

    def __init__(self, config: TransferConfig) -> None:
        self.config = config
        raise NotImplementedError("TransferAgent is being implemented")

    @property
    def endpoint(self) -> str:
        raise NotImplementedError

    @property
    def instance_id(self) -> str:
        raise NotImplementedError

    def start_send(
        self,
        transfer_id: str,
        peer_endpoint: str | None,
        layers: Sequence[LayerSpec],
        *,
        deadline_s: float | None = None,
        with_trailer: bool = False,
    ) -> None:
        raise NotImplementedError

    def send_layer(
        self, transfer_id: str, layer_index: int, tensor: torch.Tensor, ready_event: Any | None = None
    ) -> None:
        raise NotImplementedError

    def send_trailer(self, transfer_id: str, payload: bytes) -> None:
        raise NotImplementedError

    def expect(
        self,
        transfer_id: str,
        *,
        num_layers: int,
        sink: LayerSink | None = None,
        deadline_s: float | None = None,
        pull_from: str | None = None,
    ) -> None:
        raise NotImplementedError

    def take_layers(self, transfer_id: str) -> dict[int, torch.Tensor]:
        raise NotImplementedError

    def take_trailer(self, transfer_id: str) -> bytes | None:
        raise NotImplementedError

    def abort(self, transfer_id: str, reason: str = "aborted") -> None:
        raise NotImplementedError

    def poll(self) -> TransferEvents:
        raise NotImplementedError

    def stats(self) -> TransferStats:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> TransferAgent:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
