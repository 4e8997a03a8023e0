"""Fake KV connectors for engine tests: they record every hook call, and a pair of them moves KV
between two engines in memory (P saves layers of its blocks, D scatters them into its blocks)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from kvwire.connector.base import (
    ConnectorMetadata,
    ConnectorOutput,
    ConnectorRequest,
    SchedulerConnector,
    StepInfo,
    WorkerConnector,
)
from kvwire.engine import SamplingParams
from support.engine_factories import make_engine, run_all


@dataclasses.dataclass
class StepMeta(ConnectorMetadata):
    step: StepInfo


class Calls(list[tuple[Any, ...]]):
    def names(self) -> list[str]:
        return [c[0] for c in self]


class RecordingScheduler(SchedulerConnector):
    """``matched[request_id] = (num_tokens, async)``; ``delay_free`` ids keep their blocks."""

    def __init__(self, calls: Calls) -> None:
        self.calls = calls
        self.matched: dict[str, tuple[int, bool]] = {}
        self.delay_free: set[str] = set()
        self.first_tokens: dict[str, int] = {}
        self.allocated: dict[str, list[int]] = {}

    def get_num_new_matched_tokens(
        self, request: ConnectorRequest, num_computed_tokens: int
    ) -> tuple[int, bool]:
        self.calls.append(("get_num_new_matched_tokens", request.request_id, num_computed_tokens))
        return self.matched.get(request.request_id, (0, False))

    def update_state_after_alloc(
        self, request: ConnectorRequest, block_ids: Sequence[int], num_external_tokens: int
    ) -> None:
        self.calls.append(
            ("update_state_after_alloc", request.request_id, list(block_ids), num_external_tokens)
        )
        self.allocated[request.request_id] = list(block_ids)

    def build_connector_meta(self, step: StepInfo) -> ConnectorMetadata:
        self.calls.append(("build_connector_meta", step))
        return StepMeta(step)

    def update_connector_output(self, output: ConnectorOutput) -> None:
        self.calls.append(("update_connector_output", output))

    def request_finished(
        self, request: ConnectorRequest, block_ids: Sequence[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        output = list(getattr(request, "output_token_ids", []))
        self.calls.append(("request_finished", request.request_id, list(block_ids), output))
        delay = request.request_id in self.delay_free
        return delay, ({"transfer_id": request.request_id, "first_token_id": output[:1]} if delay else None)

    def take_first_token(self, request_id: str) -> int | None:
        self.calls.append(("take_first_token", request_id))
        return self.first_tokens.get(request_id)


class RecordingWorker(WorkerConnector):
    """``outputs`` is a queue of ConnectorOutputs that get_finished hands out, one per call."""

    def __init__(self, calls: Calls) -> None:
        self.calls = calls
        self.outputs: list[ConnectorOutput] = []
        self.kv_caches: list[torch.Tensor] = []

    def register_kv_caches(self, kv_caches: Sequence[torch.Tensor]) -> None:
        self.kv_caches = list(kv_caches)

    def start_load_kv(self) -> None:
        self.calls.append(("start_load_kv",))

    def wait_for_layer_load(self, layer_index: int) -> None:
        self.calls.append(("wait_for_layer_load", layer_index))

    def save_kv_layer(self, layer_index: int, kv_layer: torch.Tensor) -> None:
        assert kv_layer.data_ptr() == self.kv_caches[layer_index].data_ptr()
        self.calls.append(("save_kv_layer", layer_index))

    def wait_for_save(self) -> None:
        self.calls.append(("wait_for_save",))

    def get_finished(self, finished_req_ids: set[str]) -> ConnectorOutput:
        self.calls.append(("get_finished", frozenset(finished_req_ids)))
        return self.outputs.pop(0) if self.outputs else ConnectorOutput()


# --- an in-memory P -> D KV transfer ----------------------------------------------------------------


class Wire:
    """What P sent: per request, each layer's prompt KV ``[2, num_tokens, H, D]`` and the first token."""

    def __init__(self) -> None:
        self.layers: dict[str, dict[int, torch.Tensor]] = {}
        self.first_token: dict[str, int] = {}


class PrefillWorker(RecordingWorker):
    """Saves every layer of each request whose prompt this step completes."""

    def __init__(self, calls: Calls, wire: Wire, block_size: int) -> None:
        super().__init__(calls)
        self.wire, self.block_size = wire, block_size

    def save_kv_layer(self, layer_index: int, kv_layer: torch.Tensor) -> None:
        super().save_kv_layer(layer_index, kv_layer)
        assert isinstance(self._metadata, StepMeta)
        for chunk in self._metadata.step.scheduled:
            end = chunk.num_computed_tokens + chunk.num_scheduled_tokens
            if end == chunk.num_prompt_tokens:
                kv = kv_layer[:, list(chunk.block_ids)].flatten(1, 2)[:, : chunk.num_prompt_tokens]
                self.wire.layers.setdefault(chunk.request_id, {})[layer_index] = kv.clone()


class DecodeScheduler(RecordingScheduler):
    """Claims the whole prompt as remote (async or not); hands out P's first token when asked to."""

    def __init__(self, calls: Calls, wire: Wire, load_async: bool, use_first_token: bool) -> None:
        super().__init__(calls)
        self.wire, self.load_async, self.use_first_token = wire, load_async, use_first_token

    def get_num_new_matched_tokens(
        self, request: ConnectorRequest, num_computed_tokens: int
    ) -> tuple[int, bool]:
        super().get_num_new_matched_tokens(request, num_computed_tokens)
        return len(request.prompt_token_ids) - num_computed_tokens, self.load_async

    def take_first_token(self, request_id: str) -> int | None:
        super().take_first_token(request_id)
        return self.wire.first_token.get(request_id) if self.use_first_token else None


class DecodeWorker(RecordingWorker):
    """Scatters P's KV into the blocks D allocated: at once (sync) or in a later get_finished (async)."""

    def __init__(self, calls: Calls, wire: Wire, scheduler: DecodeScheduler, block_size: int) -> None:
        super().__init__(calls)
        self.wire, self.scheduler, self.block_size = wire, scheduler, block_size
        self.loaded: set[str] = set()

    def _scatter(self, request_id: str) -> None:
        blocks = self.scheduler.allocated[request_id]
        for layer_index, kv in self.wire.layers[request_id].items():
            slots = [
                blocks[t // self.block_size] * self.block_size + t % self.block_size
                for t in range(kv.shape[1])
            ]
            flat = self.kv_caches[layer_index].flatten(1, 2)  # [2, NB * BS, H, D] view
            flat[:, slots] = kv
        self.loaded.add(request_id)

    def start_load_kv(self) -> None:
        super().start_load_kv()
        if not self.scheduler.load_async:
            for request_id in set(self.scheduler.allocated) - self.loaded:
                self._scatter(request_id)

    def get_finished(self, finished_req_ids: set[str]) -> ConnectorOutput:
        super().get_finished(finished_req_ids)
        if not self.scheduler.load_async:
            return ConnectorOutput()
        ready = {r for r in set(self.scheduler.allocated) - self.loaded if r in self.wire.layers}
        for request_id in ready:
            self._scatter(request_id)
        return ConnectorOutput(finished_recving=frozenset(ready))


def prefill(wire: Wire, prompts: list[list[int]]) -> None:
    """Run ``prompts`` through a prefill engine (max_tokens=1) whose connector fills ``wire``."""
    calls = Calls()
    sched = RecordingScheduler(calls)
    engine = make_engine(
        scheduler_connector=sched, worker_connector=PrefillWorker(calls, wire, 16), max_num_batched_tokens=32
    )  # chunked: P saves when the last chunk is done
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=1, ignore_eos=True))
    for request_id, out in run_all(engine).items():
        wire.first_token[request_id] = out.token_ids[0]
    assert set(wire.layers) == {f"r{i}" for i in range(len(prompts))}
    assert all(len(layers) == engine.num_kv_layers for layers in wire.layers.values())
