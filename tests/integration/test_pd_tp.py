"""P/D between built-in engines of different tensor-parallel sizes (real rank processes, real
transfer agents on loopback): decode output equals a colocated TP=1 engine token for token, in push
and pull, with KV heads split, merged and replicated; nothing stays allocated or tracked on any rank;
a killed D or P rank ends that engine (everything released) and the request per policy, without a hang."""

from __future__ import annotations

import functools
import os
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry

from kvwire.connector.config import ConnectorConfig, EngineInfo, LoadFailurePolicy
from kvwire.connector.factory import RankConnectorFactory, build_connectors
from kvwire.engine import SamplingParams
from kvwire.engine.config import EngineConfig
from kvwire.engine.llm_engine import LLMEngine
from kvwire.engine.tp.runner import TPRunner, model_config_of
from kvwire.errors import RankLost
from kvwire.protocol.kv_params import KVTransferParams, Role, TransferMode

BLOCK = 8
MAX_TOKENS = 6
LENGTHS = [3, BLOCK, 2 * BLOCK + 5, 41]
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
FIRST = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def prompts() -> list[list[int]]:
    return [[(7 * j + 13 * i) % 250 + 1 for j in range(n)] for i, n in enumerate(LENGTHS)]


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def one_kv_head(tmp_path_factory: pytest.TempPathFactory) -> str:
    """An HF Llama with one KV head (replicated on every rank of TP=2), byte-level vocabulary."""
    import transformers

    path = tmp_path_factory.mktemp("llama-1kv")
    torch.manual_seed(20261201)
    config = transformers.LlamaConfig(
        vocab_size=264, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, head_dim=32, max_position_embeddings=256, initializer_range=0.1,
        bos_token_id=0, eos_token_id=1,
    )  # fmt: skip
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    _byte_tokenizer(path)
    return str(path)


def _byte_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {f"<{i}>": i for i in range(264)}
    fast = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<0>")),
                                   eos_token="<1>")  # fmt: skip
    fast.save_pretrained(path)


def engine(model: str, tp: int, role: Role | None = None, deadline_s: float = 20.0) -> LLMEngine:
    config = EngineConfig(model=model, dtype="float32", block_size=BLOCK, max_model_len=128, num_kv_blocks=64,
                          tensor_parallel_size=tp)  # fmt: skip
    if role is None:
        return LLMEngine(config)
    cc = ConnectorConfig(role=role, deadline_s=deadline_s, lease_s=deadline_s,
                         kv_load_failure_policy=LoadFailurePolicy.RECOMPUTE)  # fmt: skip
    info = EngineInfo(block_size=BLOCK, tp_size=tp, num_kv_heads=model_config_of(config).num_kv_heads)
    sched, worker = build_connectors(cc, info, registry=CollectorRegistry())
    return LLMEngine(config, sched, worker, worker_connector_factory=RankConnectorFactory(cc, info))


def run(
    engines: list[LLMEngine], results: dict[str, Any], until: Any = None, timeout_s: float = 60.0
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if until() if until else not any(e.has_unfinished_requests() for e in engines):
            return
        for e in engines:
            for out in e.step():
                if out.finished:
                    results[out.request_id] = out
        time.sleep(0.001)
    raise AssertionError("engines did not finish before the deadline")


@functools.lru_cache(maxsize=4)
def reference(model: str) -> list[list[int]]:
    e = engine(model, 1)
    results: dict[str, Any] = {}
    for i, p in enumerate(prompts()):
        e.add_request(f"r{i}", p, GREEDY)
    run([e], results)
    e.close()
    return [results[f"r{i}"].token_ids for i in range(len(prompts()))]


def endpoints(e: LLMEngine) -> list[str]:
    return list(e.scheduler_connector.kv_endpoints)  # type: ignore[attr-defined]


def assert_all_freed(engines: list[LLMEngine], results: dict[str, Any]) -> None:
    run(engines, results, timeout_s=20.0)
    for e in engines:
        stats = e.stats()
        assert stats.kv_blocks_in_use == 0 and stats.num_delayed_free_requests == 0, stats
        assert e.scheduler_connector.num_tracked_requests == 0  # type: ignore[attr-defined]
        assert e.worker_connector.num_live_transfers == 0  # type: ignore[attr-defined]
        if isinstance(e.runner, TPRunner):
            live = [s["num_live_transfers"] for s in e.runner.worker_stats()]
            assert live == [0] * (e.runner.leader.size - 1)


def rank_bytes(e: LLMEngine, name: str) -> int:
    """KV payload bytes over every rank of ``e`` (``bytes_sent`` or ``bytes_received``)."""
    total = int(getattr(e.worker_connector, name))
    if isinstance(e.runner, TPRunner):
        total += sum(s[name] for s in e.runner.worker_stats())
    return total


def d_kv_bytes(d: LLMEngine) -> int:
    """The KV D holds for the prompts, over all its ranks (replicated heads count on each rank)."""
    cfg = model_config_of(d.config)
    tp = d.config.tensor_parallel_size
    heads = max(1, cfg.num_kv_heads // tp) * tp
    blocks = sum(-(-n // BLOCK) for n in LENGTHS)
    return cfg.num_layers * 2 * blocks * BLOCK * heads * cfg.head_dim * 4


def pd_generate(p: LLMEngine, d: LLMEngine, mode: TransferMode, named: bool = False) -> dict[str, Any]:
    """``named`` (pull): P is told D's endpoints, as the router does (only D's ranks may pull)."""
    results: dict[str, Any] = {}
    for i, prompt in enumerate(prompts()):
        tid = uuid.uuid4().hex
        if mode is TransferMode.PUSH:
            p.add_request(f"p{i}", prompt, FIRST, KVTransferParams(
                transfer_id=tid, role=Role.PREFILL, peer_endpoints=endpoints(d)).to_dict())  # fmt: skip
            d.add_request(f"r{i}", prompt, GREEDY, KVTransferParams(
                transfer_id=tid, role=Role.DECODE, peer_endpoints=endpoints(p)).to_dict())  # fmt: skip
        else:
            p.add_request(f"p{i}", prompt, FIRST, KVTransferParams(
                transfer_id=tid, mode=mode, role=Role.PREFILL, peer_endpoints=endpoints(d) if named else [],
            ).to_dict())  # fmt: skip
    if mode is TransferMode.PULL:
        run([p, d], results, until=lambda: all(f"p{i}" in results for i in range(len(prompts()))))
        for i, prompt in enumerate(prompts()):
            d.add_request(f"r{i}", prompt, GREEDY, results[f"p{i}"].kv_transfer_params)
    run([p, d], results)
    return results


PULL_NAMED = "pull, D named"
CASES = [  # (model, P TP, D TP, mode)
    pytest.param("tiny", 1, 2, TransferMode.PUSH, id="tiny-1to2-push"),
    pytest.param("tiny", 2, 1, TransferMode.PUSH, id="tiny-2to1-push"),
    pytest.param("tiny", 2, 2, TransferMode.PUSH, id="tiny-2to2-push"),
    pytest.param("tiny", 2, 1, TransferMode.PULL, id="tiny-2to1-pull"),
    pytest.param("tiny", 1, 2, TransferMode.PULL, id="tiny-1to2-pull"),  # P's layer pulled in pieces
    pytest.param("tiny", 2, 2, TransferMode.PULL, id="tiny-2to2-pull"),  # rank r pulls rank r's layer
    pytest.param("one_kv_head", 1, 2, PULL_NAMED, id="replicated-1to2-pull"),  # whole, twice
    pytest.param("one_kv_head", 2, 1, TransferMode.PULL, id="replicated-2to1-pull"),  # rank 1 released
    pytest.param("one_kv_head", 1, 2, TransferMode.PUSH, id="replicated-1to2-push"),
    pytest.param("one_kv_head", 2, 1, TransferMode.PUSH, id="replicated-2to1-push"),
]


@pytest.mark.parametrize(("model", "p_tp", "d_tp", "mode"), CASES)
def test_decode_equals_colocated_tp1(request: pytest.FixtureRequest, model: str, p_tp: int, d_tp: int,
                                     mode: TransferMode | str) -> None:  # fmt: skip
    if model == "one_kv_head":
        model = request.getfixturevalue("one_kv_head")
    expected = reference(model)
    p = engine(model, p_tp, Role.PREFILL)
    d = engine(model, d_tp, Role.DECODE)
    try:
        assert len(endpoints(p)) == p_tp and len(endpoints(d)) == d_tp
        named = mode == PULL_NAMED
        start = time.monotonic()
        results = pd_generate(p, d, TransferMode.PULL if named else TransferMode(mode), named)
        for i in range(len(prompts())):
            out = results[f"r{i}"]
            assert out.error is None and out.token_ids == expected[i], (i, out)
        assert d.stats().num_kv_load_failures == 0 and d.stats().num_kv_load_recomputes == 0
        assert d.stats().num_prompt_tokens < sum(LENGTHS)  # the KV came from P
        # Every D rank got exactly its heads: the bytes moved are D's KV size, not a multiple of it.
        assert rank_bytes(p, "bytes_sent") == rank_bytes(d, "bytes_received") == d_kv_bytes(d)
        assert_all_freed([p, d], results)
        # P's leases (20 s) start after ``start``: freed sooner means acknowledged (or released)
        assert time.monotonic() - start < 19.0
    finally:
        p.close()
        d.close()


def assert_over(e: LLMEngine) -> None:
    """An engine that lost a rank: everything released, every later call refused with RankLost."""
    stats = e.stats()
    assert stats.kv_blocks_in_use == 0 and stats.num_delayed_free_requests == 0, stats
    assert e.scheduler_connector.num_tracked_requests == 0  # type: ignore[attr-defined]
    assert e.worker_connector.num_live_transfers == 0  # type: ignore[attr-defined]
    assert not e.has_unfinished_requests()
    with pytest.raises(RankLost):
        e.step()
    with pytest.raises(RankLost):
        e.add_request("late", [1, 2, 3], GREEDY)


def step_until_lost(e: LLMEngine, others: list[LLMEngine], timeout_s: float) -> RankLost:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for other in others:
            other.step()
        try:
            e.step()
        except RankLost as exc:
            return exc
        time.sleep(0.001)
    raise AssertionError(f"the lost rank was not noticed within {timeout_s} s")


def _decode_expects(p: LLMEngine, d: LLMEngine) -> str:
    """D takes a request for prompt 3 whose KV comes from P, and steps once so that every D rank
    expects it; the transfer id."""
    tid = uuid.uuid4().hex
    d.add_request("r0", prompts()[3], GREEDY, KVTransferParams(
        transfer_id=tid, role=Role.DECODE, peer_endpoints=endpoints(p)).to_dict())  # fmt: skip
    d.step()
    return tid


def _prefill_sends(p: LLMEngine, d: LLMEngine, tid: str) -> None:
    """P takes the same prompt, to send its KV to D as ``tid``."""
    p.add_request("p0", prompts()[3], FIRST, KVTransferParams(
        transfer_id=tid, role=Role.PREFILL, peer_endpoints=endpoints(d)).to_dict())  # fmt: skip


def test_a_killed_decode_rank_ends_the_engine_and_frees_everywhere() -> None:
    """D (TP 2) loses rank 1 while P sends it the KV: D's engine ends (RankLost naming the rank),
    holding nothing; P's piece to the dead rank fails at its lease (nothing renews it), which ends
    the request's other piece, and P frees its blocks."""
    p = engine("tiny", 1, Role.PREFILL, deadline_s=4.0)
    d = engine("tiny", 2, Role.DECODE, deadline_s=4.0)
    try:
        assert isinstance(d.runner, TPRunner)
        tid = _decode_expects(p, d)  # on both ranks
        assert d.stats().kv_blocks_in_use > 0
        _prefill_sends(p, d, tid)
        os.kill(d.runner.leader.workers.pids[0], signal.SIGKILL)
        start = time.monotonic()
        run([p], {}, until=lambda: p.stats().num_delayed_free_requests == 1)  # prefilled, sending
        lost = step_until_lost(d, [p], timeout_s=10.0)
        assert "rank 1 of 2" in str(lost), lost
        assert_over(d)
        results: dict[str, Any] = {}
        run([p], results, timeout_s=10.0)
        assert time.monotonic() - start < 4.0 + 6.0  # the lease, and some slack on a busy box
        assert p.stats().kv_blocks_in_use == 0 and p.stats().num_delayed_free_requests == 0
        assert p.scheduler_connector.num_tracked_requests == 0  # type: ignore[attr-defined]
        assert p.worker_connector.num_live_transfers == 0  # type: ignore[attr-defined]
    finally:
        p.close()
        d.close()


def test_p_frees_at_once_when_a_decode_rank_dies_after_its_sibling_piece_completed() -> None:
    """P (TP 1) sends pieces to D's two ranks; rank 1 is stopped, so only rank 0's piece completes;
    then rank 1 is killed. P notices by itself (D is not even stepped: nobody tells it) that the
    rank's control endpoint refuses connections, fails that piece and frees the request's blocks
    well before the 20 s KV deadline."""
    p = engine("tiny", 1, Role.PREFILL, deadline_s=20.0)
    d = engine("tiny", 2, Role.DECODE, deadline_s=20.0)
    try:
        assert isinstance(d.runner, TPRunner)
        tid = _decode_expects(p, d)  # both D ranks expect their piece
        rank1 = d.runner.leader.workers.pids[0]
        os.kill(rank1, signal.SIGSTOP)
        _prefill_sends(p, d, tid)
        pieces = p.worker_connector._sender.pieces  # type: ignore[attr-defined]
        run([p], {}, until=lambda: pieces.pieces(tid) == {f"{tid}~p0d1"})  # rank 0's piece is done
        assert p.stats().kv_blocks_in_use > 0
        os.kill(rank1, signal.SIGKILL)
        start = time.monotonic()
        run([p], {}, until=lambda: p.stats().kv_blocks_in_use == 0, timeout_s=8.0)  # < the deadline
        assert time.monotonic() - start < 8.0
        assert p.stats().num_delayed_free_requests == 0
        assert p.scheduler_connector.num_tracked_requests == 0  # type: ignore[attr-defined]
        assert p.worker_connector.num_live_transfers == 0  # type: ignore[attr-defined]
    finally:
        p.close()
        d.close()


def test_a_killed_prefill_rank_ends_p_and_d_recomputes() -> None:
    """P (TP 2) loses rank 1 before its prefill: P's engine ends holding nothing; D (TP 1, policy
    recompute) learns its pieces failed (P's agents closed) and computes the prompt itself: output
    equal to the colocated reference, blocks 0."""
    expected = reference("tiny")
    p = engine("tiny", 2, Role.PREFILL, deadline_s=30.0)
    d = engine("tiny", 1, Role.DECODE, deadline_s=30.0)
    try:
        assert isinstance(p.runner, TPRunner)
        prompt = prompts()[3]
        tid = uuid.uuid4().hex
        d.add_request("r3", prompt, GREEDY, KVTransferParams(
            transfer_id=tid, role=Role.DECODE, peer_endpoints=endpoints(p)).to_dict())  # fmt: skip
        d.step()
        os.kill(p.runner.leader.workers.pids[0], signal.SIGKILL)
        p.add_request("p3", prompt, FIRST, KVTransferParams(
            transfer_id=tid, role=Role.PREFILL, peer_endpoints=endpoints(d)).to_dict())  # fmt: skip
        start = time.monotonic()
        lost = step_until_lost(p, [d], timeout_s=10.0)
        assert "rank 1 of 2" in str(lost), lost
        assert_over(p)
        results: dict[str, Any] = {}
        run([d], results, timeout_s=20.0)
        assert time.monotonic() - start < 20.0  # before the 30 s deadline: the abort came at once
        out = results["r3"]
        assert out.error is None and out.token_ids == expected[3], out
        assert d.stats().num_kv_load_recomputes == 1
        assert_all_freed([d], results)
    finally:
        p.close()
        d.close()
