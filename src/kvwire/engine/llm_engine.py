"""LLMEngine: the serving loop, and the request it serves. ``step()`` = schedule -> plan to the
connector -> run -> postprocess (tokens appended, stop conditions checked, then the scheduler moves
its counters and ends what stopped) -> report from the connector (decision 131: the scheduler half
gets one plan and gives one report a step; the worker half runs the forward inside its one
``run_step``).

Read in order: :class:`Request` (its tokens, blocks and state), :class:`LLMEngine` (``add_request``,
``step``), :func:`check_stop` (when a request stops).

Threading: ``step``, ``stats`` and ``close`` belong to one engine thread. ``add_request`` and
``abort_request`` may be called from any thread: they validate at once (raising InvalidRequestError)
and queue the change, which the next ``step`` applies first.

A lost tensor-parallel rank (:class:`~kvwire.errors.RankLost` from ``step`` or ``check_ranks``) ends
the engine: every request is ended with the error, every block freed, every connector and the other
ranks closed (peers see their transfers aborted at once); every later call raises the same error.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch

from kvwire.connector.base import (
    NoOpSchedulerConnector,
    NoOpWorkerConnector,
    SchedulerConnector,
    WorkerConnector,
)
from kvwire.engine.config import EngineConfig
from kvwire.engine.cpu_malloc import tune_malloc
from kvwire.engine.loader import load_model
from kvwire.engine.model_runner import ModelRunner, SamplingParams, num_kv_blocks_for
from kvwire.engine.outputs import EngineStats, RequestOutput
from kvwire.engine.scheduler import FINISH_REASONS, BlockManager, RequestStatus, Scheduler
from kvwire.engine.tokenizer import IncrementalDetokenizer
from kvwire.engine.tp.runner import TPLeader, TPRunner
from kvwire.engine.tp.step_messages import WorkerConnectorFactory
from kvwire.errors import InvalidRequestError, RankLost
from kvwire.protocol.kv_blocks import KvEventLog
from kvwire.protocol.kv_params import KVParams, KVTransferParams

log = logging.getLogger(__name__)


class Request:
    """A request inside the engine: its tokens, its KV blocks, its state (the scheduler's
    :class:`~kvwire.engine.scheduler.RequestStatus`). Satisfies
    ``kvwire.connector.base.ConnectorRequest`` (plus ``output_token_ids`` and
    ``num_computed_tokens``, which connectors may read, as in vLLM)."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        detokenizer: IncrementalDetokenizer,
        kv_transfer_params: KVParams | None = None,
        generator: torch.Generator | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids: Sequence[int] = tuple(prompt_token_ids)
        self.params = params
        self.kv_transfer_params = kv_transfer_params
        self.generator = generator  # per-request seed; None = the engine's generator
        self.detokenizer = detokenizer
        self.output_token_ids: list[int] = []
        # Kept up to date by append_token (plain fields: the scheduler and the model runner read them
        # for every request every step). all_token_ids: prompt + output; do not modify it elsewhere.
        self.all_token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.num_tokens = len(self.all_token_ids)
        self.status = RequestStatus.WAITING
        self.block_ids: list[int] = []
        self.block_hashes: list[int] = []  # prefix-cache hashes of full blocks (memo, see BlockManager)
        self.num_computed_tokens = 0  # tokens of all_token_ids whose KV is in block_ids
        self.num_cached_tokens = 0  # prompt tokens taken from the prefix cache or a remote instance
        self.asked_connector = False  # the connector is asked until the request gets its blocks, then never
        self.num_external_tokens = 0  # tokens a connector loads asynchronously (WAITING_FOR_REMOTE_KV)
        self.error: str | None = None
        self.stop_text_len: int | None = None  # output text cut here by a stop string

    def append_token(self, token: int) -> None:
        self.output_token_ids.append(token)
        self.all_token_ids.append(token)
        self.num_tokens += 1

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.name}, prompt={self.num_prompt_tokens}, "
            f"out={len(self.output_token_ids)}, computed={self.num_computed_tokens})"
        )


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        scheduler_connector: SchedulerConnector | None = None,
        worker_connector: WorkerConnector | None = None,
        worker_connector_factory: WorkerConnectorFactory | None = None,
    ) -> None:
        """``worker_connector`` is rank 0's; with ``tensor_parallel_size > 1`` the other ranks build
        theirs in their own processes with ``worker_connector_factory(rank)`` (picklable)."""
        self.config = config
        self._tp = TPLeader(config, worker_connector_factory) if config.tensor_parallel_size > 1 else None
        try:
            self._init(config, scheduler_connector, worker_connector)
        except BaseException:
            if self._tp is not None:
                self._tp.close()
            raise

    def _init(
        self,
        config: EngineConfig,
        scheduler_connector: SchedulerConnector | None,
        worker_connector: WorkerConnector | None,
    ) -> None:
        if not config.is_cuda:
            torch.set_num_threads(config.resolved_cpu_threads())
            if config.cpu_malloc_tuning:
                tune_malloc()
        loaded = load_model(config)
        if self._tp is not None:
            self._tp.shard(loaded.model, config.device)
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.model_name = config.model
        self.num_kv_layers = loaded.model.config.num_layers
        self.device = torch.device(config.device)
        self.dtype = loaded.dtype
        self.quantization = loaded.quantization  # the mode in effect (auto resolved)
        num_blocks = config.num_kv_blocks or num_kv_blocks_for(
            config, self.model, self.dtype, loaded.max_model_len
        )
        # One request must always fit in the cache, or preemption could never make room for it.
        self.max_model_len = min(loaded.max_model_len, num_blocks * config.block_size)
        if self.max_model_len < loaded.max_model_len:
            log.warning("max_model_len lowered to %d: the KV cache holds no more", self.max_model_len)
        self.scheduler_connector = scheduler_connector or NoOpSchedulerConnector()
        self.worker_connector = worker_connector or NoOpWorkerConnector()
        # KV events: the prefix-cache hashes this engine holds, drained by the discovery client.
        self.kv_events = KvEventLog(config.block_size)
        self.blocks = BlockManager(
            num_blocks, config.block_size, config.enable_prefix_caching, events=self.kv_events
        )
        self.scheduler = Scheduler(config, self.blocks, self.scheduler_connector)
        self.runner: ModelRunner | TPRunner = ModelRunner(
            config, self.model, num_blocks, self.worker_connector, self.device, self.dtype, self.max_model_len
        )
        if self._tp is not None:
            endpoints = self._tp.start_runners(num_blocks, self.max_model_len)
            self.runner = TPRunner(self.runner, self._tp)
            own = getattr(self.worker_connector, "kv_endpoint", None)
            if own is not None and hasattr(self.scheduler_connector, "kv_endpoints"):
                self.scheduler_connector.kv_endpoints = (own, *endpoints)  # one per rank
        self._requests: dict[str, Request] = {}  # live (not finished) requests, engine thread
        self._inbox: deque[tuple[str, Request | str]] = deque()  # ("add", req) | ("abort", id)
        self._lock = threading.Lock()
        self._pending_ids: set[str] = set()  # ids added and not yet finished (any thread)
        self._num_prompt_tokens = self._num_generation_tokens = self._num_steps = 0
        self.lost: RankLost | None = None  # set once a tensor-parallel rank is lost (the engine is over)
        log.info(
            "engine ready: model=%s device=%s dtype=%s kv_blocks=%d x %d tokens, max_model_len=%d, tp=%d",
            *(config.model, config.device, self.dtype, num_blocks, config.block_size, self.max_model_len),
            config.tensor_parallel_size,
        )

    # --- requests (any thread) ------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        kv_transfer_params: KVParams | None = None,
    ) -> None:
        """Queue a request. Raises InvalidRequestError for a bad id, prompt or params, RankLost once
        a rank is lost."""
        if self.lost is not None:
            raise self.lost
        self._validate(request_id, prompt_token_ids, params, kv_transfer_params)
        generator = None if params.seed is None else self.runner.sampler.new_generator(params.seed)
        req = Request(
            request_id,
            prompt_token_ids,
            params,
            IncrementalDetokenizer(self.tokenizer, _prior_output(prompt_token_ids, params)),
            kv_transfer_params,
            generator,
        )
        with self._lock:
            if request_id in self._pending_ids:
                raise InvalidRequestError(f"request id {request_id!r} is already in use")
            self._pending_ids.add(request_id)
            self._inbox.append(("add", req))

    def abort_request(self, request_id: str) -> None:
        """End a request in any state (its final output has finish_reason "abort"). Unknown or
        finished ids are ignored."""
        with self._lock:
            self._inbox.append(("abort", request_id))

    def has_unfinished_requests(self) -> bool:
        """True while requests are live or finished requests' blocks wait for a send to complete
        (``step`` must keep being called to learn of it)."""
        with self._lock:
            pending = bool(self._pending_ids or self._inbox)
        return pending or bool(self.scheduler.delayed_free)

    def _validate(
        self, request_id: str, prompt: list[int], params: SamplingParams, kv_params: KVParams | None
    ) -> None:
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequestError("request_id must be a non-empty string")
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError("params must be a SamplingParams")
        if not isinstance(prompt, list) or not prompt:
            raise InvalidRequestError("the prompt must be a non-empty list of token ids")
        vocab = self.model.config.vocab_size
        if not _token_ids_below(prompt, vocab):
            raise InvalidRequestError(f"prompt token ids must be integers in [0, {vocab})")
        if len(prompt) >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {len(prompt)} tokens; this model accepts at most {self.max_model_len - 1}"
            )
        if kv_params is not None and not isinstance(kv_params, (dict, KVTransferParams)):
            raise InvalidRequestError("kv_transfer_params must be a dict or KVTransferParams")

    # --- the loop (engine thread) -------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One scheduling step and one forward pass. Never blocks on the network. Raises RankLost
        (every request ended, see the module docstring) when a tensor-parallel rank is gone."""
        if self.lost is not None:
            raise self.lost
        outputs: dict[str, RequestOutput] = {}
        self._apply_inbox(outputs)
        step = self.scheduler.schedule()
        metadata = self.scheduler_connector.plan_step(step.plan)
        try:
            result = self.runner.execute(step.scheduled, metadata, step.plan.finished_request_ids)
        except RankLost as exc:
            self._end_after_rank_lost(exc)
            raise
        self._num_prompt_tokens += step.num_new_prompt_tokens
        stopped: list[tuple[Request, RequestStatus]] = []
        for item in step.scheduled:
            token = result.sampled.get(item.request.request_id)
            if token is not None and (status := self._append_token(item.request, token, outputs)):
                stopped.append((item.request, status))
        # the scheduler moves its counters, caches the newly full blocks, ends the stopped requests
        for req, status, params in self.scheduler.postprocess(step.scheduled, stopped):
            self._ended(req, status, params, outputs)
        # after the step's requests that ended were told (request_finished): a send acknowledged
        # in this very step then frees blocks already held for it
        report = self.scheduler_connector.report_step(result.connector_output)
        self._drop_foreign_tokens(report.first_tokens)
        update = self.scheduler.apply_report(report, self._requests)
        for req, token in update.first_tokens:
            if status := self._append_token(req, token, outputs):
                self._finish(req, status, outputs)
        for req, reason in update.failed:
            self._finish(req, RequestStatus.FINISHED_ERROR, outputs, error=f"remote KV load failed: {reason}")
        self._num_steps += 1
        return list(outputs.values())

    def _apply_inbox(self, outputs: dict[str, RequestOutput]) -> None:
        with self._lock:
            changes, self._inbox = list(self._inbox), deque()
        for _kind, item in changes:
            if isinstance(item, Request):
                self._requests[item.request_id] = item
                self.scheduler.waiting.append(item)
            elif item in self._requests:
                self._finish(self._requests[item], RequestStatus.FINISHED_ABORTED, outputs)

    def _drop_foreign_tokens(self, first_tokens: dict[str, int]) -> None:
        """P's first tokens are peer data (push: its trailer; pull: ``kv_transfer_params``): one outside
        this model's vocabulary would fail the next forward, and with it every request in flight. It
        is dropped (logged): that request recomputes its last prompt token, as when none came."""
        vocab = self.model.config.vocab_size
        for request_id, token in list(first_tokens.items()):
            if not 0 <= token < vocab:
                del first_tokens[request_id]
                log.warning("request %s: P's first token %d is outside the vocabulary [0, %d); "
                            "recomputing it", request_id, token, vocab)

    def _append_token(
        self, req: Request, token: int, outputs: dict[str, RequestOutput]
    ) -> RequestStatus | None:
        """A new output token: detokenize, check stop conditions, report. Returns the status that
        ends the request (the caller ends it), None when it goes on."""
        req.append_token(token)
        self._num_generation_tokens += 1
        status, new_text = check_stop(req, token, self.tokenizer.eos_token_ids, self.max_model_len)
        self._output(req, outputs, [token], new_text)
        return status

    def _finish(
        self, req: Request, status: RequestStatus, outputs: dict[str, RequestOutput], error: str | None = None
    ) -> None:
        """End a request in any state now (abort, error, a first token from P that stops it)."""
        req.error = error
        self._ended(req, status, self.scheduler.finish(req, status), outputs)

    def _ended(
        self, req: Request, status: RequestStatus, params: dict[str, Any] | None,
        outputs: dict[str, RequestOutput],
    ) -> None:
        """The scheduler ended ``req`` (``params``: the connector's kv_transfer_params for the client)."""
        del self._requests[req.request_id]
        with self._lock:
            self._pending_ids.discard(req.request_id)
        out = self._output(req, outputs, [], "")
        out.finished, out.finish_reason, out.error, out.kv_transfer_params = (
            True,
            FINISH_REASONS.get(status),
            req.error,
            params,
        )

    def _output(
        self, req: Request, outputs: dict[str, RequestOutput], new_ids: list[int], new_text: str
    ) -> RequestOutput:
        out = outputs.get(req.request_id)
        if out is None:
            out = outputs[req.request_id] = RequestOutput(
                req.request_id, [], [], "", "", False, num_prompt_tokens=req.num_prompt_tokens
            )
        out.new_token_ids += new_ids
        out.new_text += new_text
        out.token_ids = list(req.output_token_ids)
        out.text = req.detokenizer.output_text
        out.num_cached_tokens = req.num_cached_tokens
        return out

    def check_ranks(self) -> None:
        """Engine thread, between steps (the server calls it while idle): raise RankLost, ending the
        engine, when a tensor-parallel rank's process is gone. No-op with one rank."""
        if self.lost is not None:
            raise self.lost
        if self._tp is not None:
            try:
                self._tp.workers.check()
            except RankLost as exc:
                self._end_after_rank_lost(exc)
                raise

    def _end_after_rank_lost(self, exc: RankLost) -> None:
        """No partial service without a rank (decision 085): stop the other ranks and close rank 0's
        connector first (their agents abort every transfer, so peers free at once instead of at a
        deadline), then end every request with the error and free every block."""
        self.lost = exc
        log.error("engine lost a tensor-parallel rank: %s; ending %d request(s)", exc, len(self._requests))
        if self._tp is not None:
            self._tp.close()
            self._tp = None
        self.worker_connector.close()
        outputs: dict[str, RequestOutput] = {}
        for req in list(self._requests.values()):
            self._finish(req, RequestStatus.FINISHED_ERROR, outputs, error=str(exc))
        self.scheduler.release_all_delayed()
        self.scheduler_connector.close()
        with self._lock:
            self._inbox.clear()
            self._pending_ids.clear()

    # --- introspection / lifetime -----------------------------------------------------------------------

    def stats(self) -> EngineStats:
        s = self.scheduler
        return EngineStats(
            num_running=len(s.running),
            num_waiting=len(s.waiting),
            num_waiting_for_remote_kv=len(s.waiting_for_remote),
            kv_blocks_in_use=self.blocks.num_used_blocks,
            kv_blocks_total=self.blocks.num_blocks,
            num_preemptions=s.num_preemptions,
            num_kv_load_failures=s.num_kv_load_failures,
            num_kv_load_recomputes=s.num_kv_load_recomputes,
            num_delayed_free_requests=len(s.delayed_free),
            num_prefix_cache_hit_tokens=s.num_prefix_cache_hit_tokens,
            num_prompt_tokens=self._num_prompt_tokens,
            num_generation_tokens=self._num_generation_tokens,
            num_steps=self._num_steps,
        )

    def close(self) -> None:
        """Close both connectors (the engine owns them). Idempotent."""
        self.scheduler_connector.close()
        self.worker_connector.close()
        if self._tp is not None:
            self._tp.close()
            self._tp = None

    def __enter__(self) -> LLMEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _token_ids_below(prompt: list[int], vocab: int) -> bool:
    """Whether every item is an int (not a bool) in ``[0, vocab)``: the items' types as a set and
    the ids' min and max (C speed, no Python loop per token); the per-item check only when some item
    is not exactly an int (an int subclass passes, as before)."""
    if prompt and set(map(type, prompt)) == {int}:
        return min(prompt) >= 0 and max(prompt) < vocab
    return all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in prompt)


def _prior_output(prompt: list[int], params: SamplingParams) -> list[int]:
    """The prompt's trailing tokens that are the answer's own earlier output (migration)."""
    n = min(params.prior_output_tokens, len(prompt))
    return prompt[len(prompt) - n :] if n else []


def check_stop(
    req: Request, token: int, eos_token_ids: frozenset[int], max_model_len: int
) -> tuple[RequestStatus | None, str]:
    """Called after ``token`` was appended to ``req.output_token_ids``. Returns the finish status
    (None = continue) and the text this token adds to the output (cut before a stop string; a stop
    token adds no text)."""
    p = req.params
    if token in p.stop_token_ids or (not p.ignore_eos and token in eos_token_ids):
        return RequestStatus.FINISHED_STOPPED, req.detokenizer.step(req.output_token_ids[:-1], final=True)
    length_done = len(req.output_token_ids) >= p.max_tokens or req.num_tokens >= max_model_len
    detok = req.detokenizer
    emitted = len(detok.text)
    new_text = detok.step(req.output_token_ids, final=length_done)
    if p.stop and new_text:
        window_start = max(0, emitted - max(len(s) for s in p.stop) + 1)
        hits = [i for i in (detok.text.find(s, window_start) for s in p.stop) if i >= 0]
        if hits:
            cut = min(hits)
            detok.text = detok.text[:cut]
            return RequestStatus.FINISHED_STOPPED, new_text[: max(0, cut - emitted)]
    if length_done:
        return RequestStatus.FINISHED_LENGTH, new_text
    return None, new_text
