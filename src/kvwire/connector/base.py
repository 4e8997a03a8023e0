"""The KV-connector hook contract between an inference engine and kvwire (vLLM V1 semantics).

An engine hosts two halves that talk only through per-step :class:`ConnectorMetadata`:

* :class:`SchedulerConnector` lives with the scheduler (engine-core thread/process). It decides how many
  prompt tokens come from a remote instance, learns which blocks were allocated for them, builds the
  per-step metadata for the workers, and says whether a finished request's blocks must stay allocated
  until an asynchronous send completes.
* :class:`WorkerConnector` lives with each model worker (one per GPU / TP rank). It starts loads before
  the forward pass, waits for a layer's load inside attention, saves each layer's KV right after
  attention wrote it, and reports finished sends/receives.

Two ways in. ``kvwire.integrations.vllm`` calls the vLLM-shaped hooks one by one, where vLLM's V1
engine calls the methods of ``KVConnectorBase_V1``. The built-in engine (``kvwire.engine``) makes one
exchange per step with each half (decision 131): the scheduler half takes a :class:`StepPlan` and
gives back a :class:`StepReport`; the worker half runs the step's forward inside ``run_step``. Both
are written here once, over the vLLM-shaped hooks, so every connector serves both hosts. The default
is :class:`NoOpSchedulerConnector` / :class:`NoOpWorkerConnector`.

Calls in one step of the built-in engine (engine thread)::

    admission (once a request): get_num_new_matched_tokens(request, num_local_tokens)
    scheduler: plan_step(plan)          -> metadata   # update_state_after_alloc per allocation,
                                                      # then build_connector_meta
    worker:    run_step(metadata, finished_ids, forward) -> (forward's result, ConnectorOutput)
               # bind_connector_metadata; start_load_kv; forward (each layer: wait_for_layer_load,
               # attention writes KV, save_kv_layer); wait_for_save; get_finished; clear metadata
    request end (once a request): request_finished(request, block_ids)
    scheduler: report_step(output)      -> report     # update_connector_output, P's first tokens
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

import torch

from kvwire.protocol.kv_params import KVParams

T = TypeVar("T")


class ConnectorRequest(Protocol):
    """What the connector reads from an engine's request. vLLM's ``Request`` satisfies it."""

    request_id: str
    prompt_token_ids: Sequence[int]
    kv_transfer_params: KVParams | None


@dataclasses.dataclass(frozen=True)
class ScheduledChunk:
    """One request's share of an engine step, as the scheduler planned it."""

    request_id: str
    block_ids: tuple[int, ...]  # every KV block of the request after this step's allocation
    num_computed_tokens: int  # tokens whose KV existed before this step
    num_scheduled_tokens: int  # tokens whose KV this step computes
    num_prompt_tokens: int


@dataclasses.dataclass(frozen=True)
class StepInfo:
    """Engine-agnostic view of one scheduler step, given to ``build_connector_meta``."""

    scheduled: tuple[ScheduledChunk, ...]
    # Requests that finished or were aborted since the previous step (their transfers are cancelled
    # unless request_finished asked to keep the blocks).
    finished_request_ids: frozenset[str] = frozenset()


class ConnectorMetadata:
    """Per-step message from the scheduler half to the worker halves (subclassed by each connector)."""


@dataclasses.dataclass(frozen=True)
class ConnectorOutput:
    """What the workers report back after a step (the union over workers)."""

    finished_sending: frozenset[str] = frozenset()  # request ids whose blocks may now be freed
    finished_recving: frozenset[str] = frozenset()  # request ids whose remote KV is fully loaded
    # Request id -> reason, for transfers that failed (deadline, abort, peer lost ...).
    failed: dict[str, str] = dataclasses.field(default_factory=dict)
    # Blocks whose load failed: the engine recomputes (or fails) the requests that own them.
    invalid_block_ids: frozenset[int] = frozenset()
    # D, push mode: request id -> the first token P sampled, delivered with the KV (requests in
    # ``finished_recving`` only). The scheduler connector keeps it for ``take_first_token``.
    first_token_ids: dict[str, int] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Allocation:
    """A request admitted for the first time this step (the connector was asked about its remote
    tokens): its blocks and how many of its tokens come from a remote instance, the arguments of
    ``update_state_after_alloc``."""

    request: ConnectorRequest
    block_ids: tuple[int, ...]  # every KV block of the request after admission
    num_external_tokens: int


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """The built-in engine's one message to the scheduler half in a step, built after scheduling."""

    scheduled: tuple[ScheduledChunk, ...]  # what this step computes, in schedule order
    # Requests that finished or were aborted since the previous step (preempted ones are not here:
    # they come back through admission).
    finished_request_ids: frozenset[str] = frozenset()
    allocated: tuple[Allocation, ...] = ()  # admissions this step, in admission order


@dataclasses.dataclass(frozen=True)
class StepReport:
    """The scheduler half's one answer after a step: the workers' report, applied to its own state."""

    output: ConnectorOutput
    # Requests whose remote KV is loaded, with the first token P sampled (push: the trailer; pull:
    # kv_transfer_params). Absent: none came, the engine recomputes the last prompt token.
    first_tokens: dict[str, int] = dataclasses.field(default_factory=dict)


class SchedulerConnector(abc.ABC):
    """Scheduler half. Called on the engine's scheduler thread only; must never block."""

    @abc.abstractmethod
    def get_num_new_matched_tokens(
        self, request: ConnectorRequest, num_computed_tokens: int
    ) -> tuple[int, bool]:
        """How many tokens beyond ``num_computed_tokens`` will come from a remote instance, and
        whether they arrive asynchronously (the request then waits in WAITING_FOR_REMOTE_KV while
        the engine keeps stepping the others)."""

    @abc.abstractmethod
    def update_state_after_alloc(
        self, request: ConnectorRequest, block_ids: Sequence[int], num_external_tokens: int
    ) -> None:
        """Blocks were allocated for the request (``num_external_tokens`` of them to be loaded)."""

    @abc.abstractmethod
    def build_connector_meta(self, step: StepInfo) -> ConnectorMetadata:
        """Build this step's metadata for the workers. Resets per-step state."""

    def update_connector_output(self, output: ConnectorOutput) -> None:
        """Workers reported finished/failed transfers for the last step."""
        del output

    def request_finished(
        self, request: ConnectorRequest, block_ids: Sequence[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """A request finished or was aborted. Returns (delay_free, kv_transfer_params): when
        ``delay_free`` is true the engine keeps the blocks until the request id shows up in
        ``finished_sending`` (or failed); the params are returned to the client (pull mode)."""
        del request, block_ids
        return False, None

    def take_first_token(self, request_id: str) -> int | None:
        """Built-in engine only: the token P sampled, delivered with the KV (push mode), once the
        request is in ``finished_recving``. ``None`` when none came (the engine then recomputes
        the last prompt token)."""
        del request_id
        return None

    # --- the built-in engine's exchange (decision 131) ---------------------------------------

    def plan_step(self, plan: StepPlan) -> ConnectorMetadata:
        """This step's plan in, the workers' metadata out: the step's allocations (in admission
        order), then the metadata built from what was scheduled."""
        for item in plan.allocated:
            self.update_state_after_alloc(item.request, item.block_ids, item.num_external_tokens)
        return self.build_connector_meta(StepInfo(plan.scheduled, plan.finished_request_ids))

    def report_step(self, output: ConnectorOutput) -> StepReport:
        """The workers' report in (after the step's requests that ended were told with
        ``request_finished``); what the engine acts on out."""
        self.update_connector_output(output)
        first_tokens: dict[str, int] = {}
        for request_id in sorted(output.finished_recving):
            token = self.take_first_token(request_id)
            if token is not None:
                first_tokens[request_id] = token
        return StepReport(output, first_tokens)

    def close(self) -> None:  # noqa: B027 - optional hook with a no-op default
        """Stop background work. Idempotent."""


class WorkerConnector(abc.ABC):
    """Worker half. Called on the model-runner thread; may hand work to transfer threads."""

    def register_kv_caches(self, kv_caches: Sequence[torch.Tensor]) -> None:
        """The paged KV cache, one tensor per KV-bearing layer, laid out
        ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` unless the host says otherwise."""
        del kv_caches

    def bind_connector_metadata(self, metadata: ConnectorMetadata) -> None:
        self._metadata: ConnectorMetadata | None = metadata

    def clear_connector_metadata(self) -> None:
        self._metadata = None

    @abc.abstractmethod
    def start_load_kv(self) -> None:
        """Before the forward pass: start (asynchronously) loading remote KV into allocated blocks."""

    @abc.abstractmethod
    def wait_for_layer_load(self, layer_index: int) -> None:
        """Inside attention, before layer ``layer_index`` reads its KV. Bounded by a deadline."""

    @abc.abstractmethod
    def save_kv_layer(self, layer_index: int, kv_layer: torch.Tensor) -> None:
        """Right after attention wrote layer ``layer_index``'s KV: hand it to the transfer engine.
        Must not block on the network."""

    @abc.abstractmethod
    def wait_for_save(self) -> None:
        """End of the forward pass: saves are handed over (not necessarily acknowledged)."""

    def get_finished(self, finished_req_ids: set[str]) -> ConnectorOutput:
        """Transfers completed (or failed) since the last call, handed over atomically.
        ``finished_req_ids`` are requests that finished on the scheduler since the last step."""
        del finished_req_ids
        return ConnectorOutput()

    def run_step(
        self,
        metadata: ConnectorMetadata,
        finished_req_ids: frozenset[str],
        forward: Callable[[WorkerConnector | None], T],
    ) -> tuple[T, ConnectorOutput]:
        """The built-in engine's one call per step (decision 131): bind ``metadata``, start loads,
        run ``forward(layer_hooks)`` (its attention layers call ``wait_for_layer_load`` /
        ``save_kv_layer`` on ``layer_hooks`` unless it is None: a connector with nothing to do per
        layer in this step passes None), finish the saves and report. The metadata is cleared even
        when ``forward`` raises."""
        self.bind_connector_metadata(metadata)
        try:
            self.start_load_kv()
            result = forward(self)
            self.wait_for_save()
            output = self.get_finished(set(finished_req_ids))
        finally:
            self.clear_connector_metadata()
        return result, output

    def close(self) -> None:  # noqa: B027 - optional hook with a no-op default
        """Stop background work. Idempotent."""


class NoOpSchedulerConnector(SchedulerConnector):
    """The default: no remote KV, nothing delayed."""

    def get_num_new_matched_tokens(
        self, request: ConnectorRequest, num_computed_tokens: int
    ) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(
        self, request: ConnectorRequest, block_ids: Sequence[int], num_external_tokens: int
    ) -> None:
        return None

    def build_connector_meta(self, step: StepInfo) -> ConnectorMetadata:
        return ConnectorMetadata()


class NoOpWorkerConnector(WorkerConnector):
    """The default: loads and saves nothing."""

    def start_load_kv(self) -> None:
        return None

    def wait_for_layer_load(self, layer_index: int) -> None:
        return None

    def save_kv_layer(self, layer_index: int, kv_layer: torch.Tensor) -> None:
        return None

    def wait_for_save(self) -> None:
        return None
