"""Worker half of the vLLM plugin: one transfer agent per worker (TP rank), driven by the core.

Lives in a vLLM worker process, called on its model-runner thread (the agent's receive sinks run on
transfer threads, inside the core). No vLLM import: the shell in :mod:`kvwire.integrations.vllm`
passes plain values. Layer names from vLLM become the core's dense KV-layer indices here; layers that
carry no KV of their own are never counted (the reference counted MoE layers and waited forever).

Supervision (decision 116): the worker process's :class:`~kvwire.supervision.HealthBoard` is
``WorkerSide.board``; the agent's threads run on it. vLLM's own health check cannot read it, so a
component that is dead is logged as an error (once) at the next ``get_finished``; the agent has then
failed every transfer in flight (reported as load errors, vLLM's ``kv_load_failure_policy`` applies)
and refuses new ones (the core fails those requests' transfers at once): nothing waits on it.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import time
from collections.abc import Callable, Mapping

import torch

from kvwire.connector.config import EngineInfo
from kvwire.connector.metadata import KvwireConnectorMetadata
from kvwire.connector.pieces import owned_heads
from kvwire.connector.worker import AgentLike, KvwireWorkerConnector
from kvwire.errors import EngineError
from kvwire.integrations.vllm_config import VllmPluginConfig
from kvwire.integrations.vllm_layers import KVLayers, kv_layers
from kvwire.supervision import HealthBoard
from kvwire.transfer import Backend, TransferAgent, TransferConfig

logger = logging.getLogger(__name__)

AgentFactory = Callable[[TransferConfig], AgentLike]


def apply_nccl_channels(config: VllmPluginConfig) -> None:
    """The seed's ``nccl_num_channels``: NCCL reads its channel count from the environment, once,
    when the first communicator is created (before this worker's agent starts one)."""
    if config.transfer.backend is Backend.NCCL and config.nccl_num_channels is not None:
        os.environ["NCCL_MIN_NCHANNELS"] = str(config.nccl_num_channels)
        os.environ["NCCL_MAX_NCHANNELS"] = str(config.nccl_num_channels)


class WorkerSide:
    """See the module docstring. ``close()`` stops the agent."""

    def __init__(
        self, config: VllmPluginConfig, engine_info: EngineInfo, agent_factory: AgentFactory | None = None
    ) -> None:
        """``agent_factory`` (tests): builds the agent; default a TransferAgent on :attr:`board`."""
        apply_nccl_channels(config)
        self.engine_info = engine_info
        self.board = HealthBoard()
        factory = agent_factory or functools.partial(TransferAgent, board=self.board)
        # this rank's copy of the agent config the plugin built (ports + rank, the worker's device)
        self.agent = factory(config.transfer.for_rank(engine_info.rank, engine_info.device))
        self._reported_dead: set[str] = set()
        self.core = KvwireWorkerConnector(config.connector, engine_info, self.agent, owns_agent=True)
        self._failure_policy = config.vllm_failure_policy.value
        self._fault_delay_send = config.fault_delay_send
        if self._fault_delay_send is not None:
            logger.warning("kvwire: fault injection configured: %s", self._fault_delay_send)
        self._layers: KVLayers | None = None
        self._invalid_block_ids: set[int] = set()
        logger.info("kvwire: rank %d transfer agent at %s", engine_info.rank, self.agent.endpoint)

    @property
    def endpoint(self) -> str:
        return self.agent.endpoint

    @property
    def instance_id(self) -> str:
        return self.agent.instance_id

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        """Register vLLM's caches with the core: as head views (``BLOCK_HEAD``: P and D may differ in
        TP size) when the backend keeps this rank's heads right inside each block, else opaque."""
        info = self.engine_info
        heads = info.num_kv_heads
        local = None if heads is None else len(owned_heads(info.rank, info.tp_size, heads))
        self._layers = kv_layers(kv_caches, local)
        self.core.register_kv_caches(self._layers.views, self._layers.layout)
        first = self._layers.views[0]
        logger.info(
            "kvwire: rank %d of %d: %d KV layers, %s %s per layer (%s)", info.rank, info.tp_size,
            len(self._layers.names), tuple(first.shape), first.dtype, self._layers.layout.value,
        )

    @property
    def layers(self) -> KVLayers:
        if self._layers is None:
            raise EngineError("KvwireConnector: KV caches were not registered")
        return self._layers

    # --- per step (model-runner thread) ---------------------------------------------------------

    def bind(self, metadata: KvwireConnectorMetadata) -> None:
        fault = self._fault_delay_send
        if fault is None or not fault.applies([send.transfer_id for send in metadata.sends]):
            self.core.bind_connector_metadata(metadata)
            return
        # Fault injection (tests only): the request was accepted -- its promise renews D's lease from
        # the agent's control thread -- but its prefill starts late, as behind a long queue on an
        # oversubscribed P. The step is held between the promises and the sends (the core handles
        # each kind in this order), so no started send looks stalled.
        self.core.bind_connector_metadata(dataclasses.replace(metadata, sends=(), trailers=()))
        logger.warning("kvwire: fault injection: holding this prefill step %.1f s", fault.seconds)
        time.sleep(fault.seconds)
        self.core.bind_connector_metadata(dataclasses.replace(metadata, promises=(), aborts=(), recvs=()))

    def clear(self) -> None:
        self.core.clear_connector_metadata()

    def save_kv_layer(self, layer_name: str) -> None:
        """The layer's blocks of every request completing its prompt this step, for the agent (handed
        over now with GPU caches; at :meth:`wait_for_save` with CPU caches, decision 141, where a
        push is also announced to the agent, decision 147)."""
        index = self.layers.index_of(layer_name)
        if index is not None:
            self.core.save_kv_layer(index, self.layers.views[index])

    def wait_for_save(self) -> None:
        self.core.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """(finished_sending, finished_recving) since the last call; failed loads' blocks are kept for
        :meth:`take_invalid_block_ids`, which vLLM calls right after, in the same step."""
        self._report_dead()
        out = self.core.get_finished(finished_req_ids)
        if out.invalid_block_ids:
            logger.warning(
                "kvwire: %d block(s) failed to load; vLLM's kv_load_failure_policy=%s applies",
                len(out.invalid_block_ids), self._failure_policy,
            )
        self._invalid_block_ids |= out.invalid_block_ids
        return set(out.finished_sending), set(out.finished_recving)

    def _report_dead(self) -> None:
        """Log each dead component once (vLLM's health check cannot see this board)."""
        for status in self.board.dead():
            if status.name not in self._reported_dead:
                self._reported_dead.add(status.name)
                logger.error("kvwire: rank %d: component %s is dead (%s); its transfers failed and new ones "
                             "are refused: restart this vLLM instance", self.engine_info.rank, status.name,
                             status.last_error)

    def take_invalid_block_ids(self) -> set[int]:
        invalid, self._invalid_block_ids = self._invalid_block_ids, set()
        return invalid

    def close(self) -> None:
        self.core.close()
        logger.info("kvwire: rank %d transfer agent closed", self.engine_info.rank)
