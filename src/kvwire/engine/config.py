"""Engine configuration: one frozen dataclass built once at the edge (CLI, ``kvwire.LLM``)."""

from __future__ import annotations

import dataclasses
import enum
import os

from kvwire.errors import ConfigError
from kvwire.protocol.kv_params import LoadFailurePolicy

# The one policy enum (kvwire.protocol.kv_params); this name is the engine's spelling of it.
KVLoadFailurePolicy = LoadFailurePolicy


class AttentionBackend(str, enum.Enum):
    """How attention reads the paged KV cache."""

    AUTO = "auto"  # PAGED on the CPU in float32, SDPA elsewhere (the reference path is for tests)
    REFERENCE = "reference"  # plain torch math per sequence: the readable oracle
    SDPA = "sdpa"  # torch scaled_dot_product_attention over gathered blocks
    PAGED = "paged"  # SDPA for prompts; decodes by a C kernel over the blocks in place (decision 148)


class Quantization(str, enum.Enum):
    """How linear weights are held (decision 118). The quantized modes are CPU, one-rank only."""

    AUTO = "auto"  # GGUF on the CPU (one rank): as the file holds them; otherwise NONE
    NONE = "none"  # dequantized to ``dtype``: the mode that matches transformers exactly
    GGUF = "gguf"  # a GGUF's Q4_0/Q4_1 tensors as int4, its Q8_0 (and other quantized) as int8
    INT8 = "int8"  # every linear weight int8 per output row (any checkpoint)
    INT4 = "int4"  # every linear weight int4 per group of 32 (GGUF Q4 codes kept as they are)


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
    quantization: Quantization = Quantization.AUTO  # see Quantization
    # Quantized modes: prompt rows multiply a bfloat16 copy of each projection (about 2x faster than
    # the packed kernels at 256 rows; 4x the int4 bytes in memory). False: every row packed.
    dense_prompt_weights: bool = True
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
    # CUDA: the share of the device's total memory this instance may hold, weights included (vLLM's
    # --gpu-memory-utilization). None: no share; the KV cache takes kv_cache_memory_fraction of what
    # is free. Instances sharing one GPU need it: `kvwire up` gives each 0.9 / (instances per GPU).
    gpu_memory_utilization: float | None = None
    cpu_kv_cache_bytes: int = 1 << 30  # CPU: most bytes the auto-sized KV cache may take
    # CPU: torch threads of this process. None: OMP_NUM_THREADS when set, else half the cores this
    # process may run on (at least 1) -- a P and a D instance share a host (decision 119).
    cpu_threads: int | None = None
    # CPU: set glibc's malloc to reuse large freed blocks instead of page-faulting fresh ones every
    # prefill step (engine/cpu_malloc.py, decision 152). Process-wide, applied by the first engine.
    cpu_malloc_tuning: bool = True
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
        if self.cpu_threads is not None:
            _positive("cpu_threads", self.cpu_threads)
        if not 0.0 < self.kv_cache_memory_fraction <= 1.0:
            raise ConfigError("kv_cache_memory_fraction must be in (0, 1]")
        if self.gpu_memory_utilization is not None and not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
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
            object.__setattr__(self, "quantization", Quantization(self.quantization))
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
        self.check_quantization()

    @property
    def quantized_explicitly(self) -> bool:
        return self.quantization not in (Quantization.AUTO, Quantization.NONE)

    def check_quantization(self) -> None:  # called by __post_init__
        if self.quantized_explicitly and (self.is_cuda or self.tensor_parallel_size > 1):
            raise ConfigError(
                f"quantization {self.quantization.value!r} runs on the CPU with tensor_parallel_size 1 "
                "(use quantization 'none')"
            )

    def resolved_cpu_threads(self) -> int:
        if self.cpu_threads is not None:
            return self.cpu_threads
        env = os.environ.get("OMP_NUM_THREADS", "")
        if env.isdigit() and int(env) > 0:
            return int(env)
        return max(1, len(os.sched_getaffinity(0)) // 2)

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda")


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")
