"""Engine configuration: one frozen dataclass built once at the edge (CLI, ``kvwire.LLM``)."""

from __future__ import annotations

import dataclasses
import enum

from kvwire.errors import ConfigError
from kvwire.kv_params import LoadFailurePolicy

# The one policy enum (kvwire.kv_params); this name is the engine's spelling of it.
KVLoadFailurePolicy = LoadFailurePolicy


class AttentionBackend(str, enum.Enum):
    """How attention reads the paged KV cache."""

    AUTO = "auto"  # SDPA on every device (the reference path is for tests)
    REFERENCE = "reference"  # plain torch math per sequence: the readable oracle
    SDPA = "sdpa"  # torch scaled_dot_product_attention over gathered blocks


_DTYPES = ("auto", "float32", "float16", "bfloat16")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs. ``None`` means "derive from the model / device"."""

    # A preset or packaged model name (kvwire.engine.models.presets), a .gguf file, an HF directory, or a
    # Hugging Face model id: ORG/NAME (safetensors), ORG/NAME-GGUF with gguf_file, or ORG/NAME-GGUF:QUANT.
    model: str = "tiny"
    revision: str | None = None  # Hugging Face branch, tag or commit of a model id (None: main)
    gguf_file: str | None = None  # the file to load from a GGUF repo (vLLM's ORG/NAME:QUANT also works)
    tokenizer: str | None = None  # a local directory or model id to take the tokenizer from
    device: str = "cpu"  # "cpu", "cuda" or "cuda:N"
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on CUDA
    block_size: int = 16  # tokens per KV block
    num_kv_blocks: int | None = None  # None: sized from memory (see model_runner.num_kv_blocks_for)
    max_model_len: int | None = None  # None: the model's limit (capped at 8192)
    max_num_batched_tokens: int = 2048  # token budget of one step (chunked prefill splits prompts)
    max_num_seqs: int = 64  # running requests per step
    enable_prefix_caching: bool = True
    kv_load_failure_policy: KVLoadFailurePolicy = KVLoadFailurePolicy.RECOMPUTE
    attention_backend: AttentionBackend = AttentionBackend.AUTO
    # Decode-only steps replay CUDA graphs (see decode_graphs.py). Used with the no-op worker
    # connector only; on the CPU it runs the same static-shape path eagerly (for tests).
    decode_graphs: bool = False
    kv_cache_memory_fraction: float = 0.8  # CUDA: share of free memory (after weights) for KV
    cpu_kv_cache_bytes: int = 1 << 30  # CPU: most bytes the auto-sized KV cache may take
    seed: int = 0  # seeds the sampler of requests without their own seed
    # Ranks (processes) the model is split over: attention heads and MLP columns (engine/tp).
    tensor_parallel_size: int = 1
    tp_timeout_s: float = 120.0  # bound on every wait for another rank (start-up: each phase)

    def __post_init__(self) -> None:
        if not self.model:
            raise ConfigError("model must name a preset or a local directory")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ConfigError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.dtype not in _DTYPES:
            raise ConfigError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        _positive("block_size", self.block_size)
        _positive("max_num_batched_tokens", self.max_num_batched_tokens)
        _positive("max_num_seqs", self.max_num_seqs)
        if self.num_kv_blocks is not None:
            _positive("num_kv_blocks", self.num_kv_blocks)
        if self.max_model_len is not None:
            _positive("max_model_len", self.max_model_len)
        if not 0.0 < self.kv_cache_memory_fraction <= 1.0:
            raise ConfigError("kv_cache_memory_fraction must be in (0, 1]")
        _positive("cpu_kv_cache_bytes", self.cpu_kv_cache_bytes)
        _positive("tensor_parallel_size", self.tensor_parallel_size)
        if not self.tp_timeout_s > 0:
            raise ConfigError("tp_timeout_s must be > 0")
        # Accept the enums' string values from CLIs (frozen: set through object.__setattr__).
        try:
            object.__setattr__(
                self, "kv_load_failure_policy", KVLoadFailurePolicy(self.kv_load_failure_policy)
            )
            object.__setattr__(self, "attention_backend", AttentionBackend(self.attention_backend))
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda")


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")
