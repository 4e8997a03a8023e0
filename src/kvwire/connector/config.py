"""Configuration of the P/D connector: built once at the edge (CLI, vLLM plugin) and passed down."""

from __future__ import annotations

import dataclasses

from kvwire.errors import ConfigError
from kvwire.protocol.kv_params import LoadFailurePolicy, Role, TransferMode
from kvwire.transfer.config import TransferConfig
from kvwire.transfer.enums import KVLayout


@dataclasses.dataclass(frozen=True)
class EngineInfo:
    """What the connector needs to know about its host engine (one per worker rank)."""

    block_size: int
    device: str = "cpu"
    rank: int = 0
    kv_layout: KVLayout = KVLayout.KV_FIRST  # of the KV cache tensors given to the worker
    # Tensor parallelism (connector/pieces.py): ranks of this instance, and the model's KV heads
    # over all ranks (None: the cache's heads times tp_size, i.e. no replication; ignored for MLA).
    tp_size: int = 1
    num_kv_heads: int | None = None

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ConfigError(f"block_size must be > 0, got {self.block_size}")
        if self.rank < 0:
            raise ConfigError(f"rank must be >= 0, got {self.rank}")
        if self.tp_size < 1 or self.rank >= self.tp_size:
            raise ConfigError(f"rank {self.rank} is not in a tensor-parallel group of {self.tp_size}")


@dataclasses.dataclass(frozen=True)
class ConnectorConfig:
    """P/D connector settings.

    ``deadline_s`` bounds a push transfer and ``lease_s`` bounds how long P keeps blocks for a pull;
    the router's ``kv_transfer_params.deadline_s`` may shorten either, never lengthen it.
    ``mode`` is the instance's default (the router's per-request ``mode`` wins).
    ``use_first_token``: P sends its sampled token with the KV and D continues from token 2 (the
    built-in engine); off for hosts that recompute the last prompt token (vLLM).
    ``transfer`` is a ``kvwire.transfer.TransferConfig`` (``None``: the agent's defaults on loopback).
    """

    role: Role = Role.BOTH
    mode: TransferMode = TransferMode.PUSH
    deadline_s: float = 30.0
    lease_s: float = 30.0
    kv_load_failure_policy: LoadFailurePolicy = LoadFailurePolicy.RECOMPUTE
    use_first_token: bool = True
    transfer: TransferConfig | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.role, Role):
            raise ConfigError(f"role must be a Role, got {self.role!r}")
        if not isinstance(self.mode, TransferMode):
            raise ConfigError(f"mode must be a TransferMode, got {self.mode!r}")
        if not isinstance(self.kv_load_failure_policy, LoadFailurePolicy):
            raise ConfigError(
                f"kv_load_failure_policy must be a LoadFailurePolicy, got {self.kv_load_failure_policy!r}"
            )
        if self.deadline_s <= 0:
            raise ConfigError(f"deadline_s must be > 0, got {self.deadline_s}")
        if self.lease_s <= 0:
            raise ConfigError(f"lease_s must be > 0, got {self.lease_s}")

    @property
    def agent_deadline_s(self) -> float:
        """The transfer agent's default deadline: long enough for a push and for a pull lease."""
        return max(self.deadline_s, self.lease_s)
