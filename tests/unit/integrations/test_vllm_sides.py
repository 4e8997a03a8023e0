"""The plugin's scheduler and worker halves driven like vLLM 0.32 drives a connector, with real
transfer agents on loopback and CPU KV caches laid out as the CPU backend's (no vLLM needed)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from kvwire.protocol.kv_params import KVTransferParams, Role, TransferMode
from support.vllm_fakes import (
    BLOCK,
    LAYER_NAMES,
    CachedRequestData,
    Instance,
    KVConnectorOutput,
    NewRequestData,
    Request,
    SchedulerOutput,
)


@pytest.fixture
def pd() -> Iterator[tuple[Instance, Instance]]:
    p = Instance("kv_producer", torch.randn, deadline_s=10)
    d = Instance("kv_consumer", torch.zeros, deadline_s=10)
    yield p, d
    p.close()
    d.close()


def params(
    tid: str, role: Role, peer: Instance, mode: TransferMode = TransferMode.PUSH
) -> dict[str, object]:
    # As the router sends them: the peer's endpoints in both modes (pull: P may lease only to that D).
    peers = [peer.worker.endpoint]
    return KVTransferParams(transfer_id=tid, role=role, mode=mode, peer_endpoints=peers).to_dict()


def prefill(p: Instance, req: Request, blocks: list[int]) -> None:
    """P schedules the whole prompt in one step (blocks allocated), then the request finishes."""
    assert p.sched.get_num_new_matched_tokens(req, 0) == (0, False)
    p.sched.update_state_after_alloc(req, blocks, 0)
    n = len(req.prompt_token_ids)
    new = NewRequestData(req.request_id, req.prompt_token_ids, (blocks,), 0)
    p.step(SchedulerOutput([new], num_scheduled_tokens={req.request_id: n}))


def same_blocks(p: Instance, p_blocks: list[int], d: Instance, d_blocks: list[int]) -> bool:
    return all(
        torch.equal(p.caches[name][p_blocks], d.caches[name][d_blocks]) for name in LAYER_NAMES
    )


def test_push_end_to_end(pd: tuple[Instance, Instance]) -> None:
    p, d = pd
    prompt = list(range(10))  # 3 blocks of 4; D loads 9 tokens (recomputes the last) = 3 blocks
    req_d = Request("d-1", prompt, params("t1", Role.DECODE, p))
    assert d.sched.get_num_new_matched_tokens(req_d, 0) == (9, True)
    d.sched.update_state_after_alloc(req_d, [7, 8, 9], 9)
    d.step(SchedulerOutput())  # the receive is announced with this step's metadata

    req_p = Request("p-1", prompt, params("t1", Role.PREFILL, d), output_token_ids=[5])
    prefill(p, req_p, [1, 2, 3])
    assert p.sched.request_finished(req_p, [1, 2, 3]) == (True, None)  # held until acknowledged

    d.idle_until(lambda: "d-1" in d.seen_recving)
    p.idle_until(lambda: "p-1" in p.seen_sending)
    assert same_blocks(p, [1, 2, 3], d, [7, 8, 9])
    assert p.sched.num_outstanding == 0 and d.sched.num_outstanding == 0
    assert p.seen_recving == set() and d.seen_sending == set()


def test_pull_end_to_end(pd: tuple[Instance, Instance]) -> None:
    p, d = pd
    prompt = list(range(7))
    req_p = Request("p-2", prompt, params("t2", Role.PREFILL, d, TransferMode.PULL), output_token_ids=[3])
    prefill(p, req_p, [4, 5])
    delay, returned = p.sched.request_finished(req_p, [4, 5])
    assert delay is True and returned is not None
    back = KVTransferParams.from_dict(returned)
    assert back.peer_endpoints == [p.worker.endpoint] and back.num_prompt_tokens == 7

    req_d = Request("d-2", prompt, back.to_dict())
    assert d.sched.get_num_new_matched_tokens(req_d, 0) == (6, True)
    d.sched.update_state_after_alloc(req_d, [0, 1], 6)
    d.step(SchedulerOutput())
    d.idle_until(lambda: "d-2" in d.seen_recving)
    p.idle_until(lambda: "p-2" in p.seen_sending)
    assert same_blocks(p, [4, 5], d, [0, 1])


def test_send_acked_before_request_finished_is_hidden_from_vllm(pd: tuple[Instance, Instance]) -> None:
    """vLLM asserts that finished_sending names only requests it holds for the connector."""
    p, d = pd
    prompt = list(range(BLOCK))
    req_d = Request("d-3", prompt, params("t3", Role.DECODE, p))
    d.sched.get_num_new_matched_tokens(req_d, 0)
    d.sched.update_state_after_alloc(req_d, [2], BLOCK - 1)
    d.step(SchedulerOutput())
    req_p = Request("p-3", prompt, params("t3", Role.PREFILL, d), output_token_ids=[1])
    prefill(p, req_p, [6])
    d.idle_until(lambda: "d-3" in d.seen_recving)
    p.idle_until(lambda: p.worker.core.num_live_transfers == 0)
    assert p.seen_sending == set()  # acknowledged while still "running": hidden from vLLM
    assert p.sched.request_finished(req_p, [6]) == (False, None)  # nothing left to wait for


def test_decode_abort_while_receiving_reports_recving(pd: tuple[Instance, Instance]) -> None:
    """A request aborted in WAITING_FOR_REMOTE_KVS: vLLM frees it on finished_recving, never on
    finished_sending (which would trip its assertion)."""
    p, d = pd
    req_d = Request("d-4", list(range(9)), params("t4", Role.DECODE, p))
    d.sched.get_num_new_matched_tokens(req_d, 0)
    d.sched.update_state_after_alloc(req_d, [3, 4, 5], 8)
    d.step(SchedulerOutput())
    delay, _ = d.sched.request_finished(req_d, [3, 4, 5])  # client went away; P never sends
    assert delay is True
    d.idle_until(lambda: "d-4" in d.seen_recving)
    assert d.seen_sending == set()
    assert d.sched.num_outstanding == 0


def test_load_failure_reports_invalid_blocks() -> None:
    """P dies (here: its agent closes) before sending: at the deadline D reports the request's blocks
    through get_block_ids_with_load_errors and finishes the load, so vLLM's policy applies."""
    p = Instance("kv_producer", torch.randn, deadline_s=1.5)
    d = Instance("kv_consumer", torch.zeros, deadline_s=1.5)
    try:
        _load_failure(p, d)
    finally:
        p.close()
        d.close()


def _load_failure(p: Instance, d: Instance) -> None:
    req_d = Request("d-5", list(range(9)), params("t5", Role.DECODE, p))
    d.sched.get_num_new_matched_tokens(req_d, 0)
    d.sched.update_state_after_alloc(req_d, [3, 4, 5], 8)
    d.step(SchedulerOutput())
    p.worker.close()
    outs: list[KVConnectorOutput] = []

    def failed() -> bool:
        outs.append(d.step(SchedulerOutput(), forward=False))
        return "d-5" in d.seen_recving

    d.idle_until(failed, timeout_s=10)
    assert set().union(*(o.invalid_block_ids for o in outs)) == {3, 4}  # 8 loaded tokens = 2 blocks


def test_chunked_prefill_sends_with_last_chunk(pd: tuple[Instance, Instance]) -> None:
    p, d = pd
    prompt = list(range(11))
    req_d = Request("d-6", prompt, params("t6", Role.DECODE, p))
    d.sched.get_num_new_matched_tokens(req_d, 0)
    d.sched.update_state_after_alloc(req_d, [9, 10, 11], 10)
    d.step(SchedulerOutput())
    req_p = Request("p-6", prompt, params("t6", Role.PREFILL, d), output_token_ids=[2])
    p.sched.get_num_new_matched_tokens(req_p, 0)
    p.sched.update_state_after_alloc(req_p, [0, 1], 0)
    first = SchedulerOutput([NewRequestData("p-6", prompt, ([0, 1],), 0)], num_scheduled_tokens={"p-6": 8})
    p.step(first)
    assert p.worker.core.num_live_transfers == 0  # nothing announced before the last chunk
    cached = CachedRequestData(["p-6"], set(), [([2],)], [8])
    p.step(SchedulerOutput(scheduled_cached_reqs=cached, num_scheduled_tokens={"p-6": 3}))
    assert p.sched.request_finished(req_p, [0, 1, 2])[0] is True
    d.idle_until(lambda: "d-6" in d.seen_recving)
    p.idle_until(lambda: "p-6" in p.seen_sending)
    assert same_blocks(p, [0, 1, 2], d, [9, 10, 11])


def test_kv_both_serves_either_role() -> None:
    """A kv_both instance is P for one request and D for another, at the same time."""
    a = Instance("kv_both", torch.randn, deadline_s=10)
    b = Instance("kv_both", torch.randn, deadline_s=10)
    try:
        prompt = list(range(6))
        # a -> b on t7 while b -> a on t8
        plan = ((a, b, "t7", [0, 1], [2, 3]), (b, a, "t8", [4, 5], [6, 7]))
        for src, dst, tid, src_blocks, dst_blocks in plan:
            req_d = Request(f"d-{tid}", prompt, params(tid, Role.DECODE, src))
            assert dst.sched.get_num_new_matched_tokens(req_d, 0) == (5, True)
            dst.sched.update_state_after_alloc(req_d, dst_blocks, 5)
            dst.step(SchedulerOutput())
            req_p = Request(f"p-{tid}", prompt, params(tid, Role.PREFILL, dst), output_token_ids=[1])
            prefill(src, req_p, src_blocks)
            assert src.sched.request_finished(req_p, src_blocks)[0] is True
        for inst in (a, b):
            inst.idle_until(lambda inst=inst: len(inst.seen_recving) == 1 and len(inst.seen_sending) == 1)
        assert same_blocks(a, [0, 1], b, [2, 3]) and same_blocks(b, [4, 5], a, [6, 7])
    finally:
        a.close()
        b.close()


def test_with_a_secret_only_router_signed_params_move_kv() -> None:
    """The plugin verifies kv_transfer_params like `kvwire serve` does; a refused request runs
    locally (no transfer, no connection), is counted and is judged once."""
    from prometheus_client import REGISTRY

    from kvwire.protocol.kv_signing import ParamsSigner

    secret = "plugin-test-secret-0123456789abcdef"  # 32+ bytes (decision 124)
    p = Instance("kv_producer", torch.randn, deadline_s=10, secret=secret)
    d = Instance("kv_consumer", torch.zeros, deadline_s=10, secret=secret)
    try:
        def refused() -> float:
            value = REGISTRY.get_sample_value("kvwire_pd_kv_params_refused_total", {"reason": "unsigned"})
            return value or 0.0

        before = refused()
        forged = Request("d-forged", list(range(10)), params("t-forged", Role.DECODE, p))
        assert d.sched.get_num_new_matched_tokens(forged, 0) == (0, False)
        assert d.sched.get_num_new_matched_tokens(forged, 0) == (0, False)  # e.g. after preemption
        assert refused() == before + 1
        assert d.sched.request_finished(forged, []) == (False, None)

        signer = ParamsSigner(secret)

        def signed(tid: str, role: Role, peer: Instance) -> dict[str, object]:
            return signer.sign(KVTransferParams.from_dict(params(tid, role, peer))).to_dict()

        prompt = list(range(10))
        req_d = Request("d-1", prompt, signed("t1", Role.DECODE, p))
        assert d.sched.get_num_new_matched_tokens(req_d, 0) == (9, True)
        d.sched.update_state_after_alloc(req_d, [7, 8, 9], 9)
        d.step(SchedulerOutput())
        req_p = Request("p-1", prompt, signed("t1", Role.PREFILL, d), output_token_ids=[5])
        prefill(p, req_p, [1, 2, 3])
        assert p.sched.request_finished(req_p, [1, 2, 3]) == (True, None)
        d.idle_until(lambda: "d-1" in d.seen_recving)
        assert same_blocks(p, [1, 2, 3], d, [7, 8, 9])
    finally:
        p.close()
        d.close()


# --- P and D of different tensor-parallel sizes (decision 086) ---------------------------------------


def tp_params(
    tid: str, role: Role, peer: Instance, mode: TransferMode = TransferMode.PUSH
) -> dict[str, object]:
    return KVTransferParams(transfer_id=tid, role=role, mode=mode, peer_endpoints=peer.endpoints).to_dict()


@pytest.mark.parametrize(
    ("p_tp", "d_tp", "mode"),
    [(2, 1, TransferMode.PUSH), (2, 1, TransferMode.PULL), (1, 2, TransferMode.PUSH),
     (1, 2, TransferMode.PULL), (2, 4, TransferMode.PUSH), (2, 4, TransferMode.PULL)],
    ids=["2to1-push", "2to1-pull", "1to2-push", "1to2-pull", "2to4-push-replicated", "2to4-pull-replicated"],
)
def test_different_tp_sizes(p_tp: int, d_tp: int, mode: TransferMode) -> None:
    """vLLM's CPU cache cut by head (BLOCK_HEAD): each D rank gets exactly its heads from the P rank(s)
    holding them (2 KV heads: split, merged, replicated on D), in push and pull."""
    p = Instance("kv_producer", torch.randn, tp=p_tp, num_kv_heads=2, deadline_s=10)
    d = Instance("kv_consumer", torch.zeros, tp=d_tp, num_kv_heads=2, deadline_s=10)
    try:
        assert p.worker.layers.layout.value == "block_head"
        prompt = list(range(10))
        if mode is TransferMode.PUSH:
            req_d = Request("d-1", prompt, tp_params("t1", Role.DECODE, p))
            assert d.sched.get_num_new_matched_tokens(req_d, 0) == (9, True)
            d.sched.update_state_after_alloc(req_d, [7, 8, 9], 9)
            d.step(SchedulerOutput())
            req_p = Request("p-1", prompt, tp_params("t1", Role.PREFILL, d), output_token_ids=[5])
            prefill(p, req_p, [1, 2, 3])
            assert p.sched.request_finished(req_p, [1, 2, 3]) == (True, None)
        else:
            req_p = Request("p-1", prompt, tp_params("t1", Role.PREFILL, d, mode), output_token_ids=[5])
            prefill(p, req_p, [1, 2, 3])
            delay, returned = p.sched.request_finished(req_p, [1, 2, 3])
            assert delay is True and returned is not None
            back = KVTransferParams.from_dict(returned)
            assert back.peer_endpoints == p.endpoints
            req_d = Request("d-1", prompt, back.to_dict())
            assert d.sched.get_num_new_matched_tokens(req_d, 0) == (9, True)
            d.sched.update_state_after_alloc(req_d, [7, 8, 9], 9)
            d.step(SchedulerOutput())
        d.idle_until(lambda: "d-1" in d.seen_recving)
        p.idle_until(lambda: "p-1" in p.seen_sending)
        for name in LAYER_NAMES:
            want = torch.cat([c[name][[1, 2, 3]] for c in p.rank_caches], dim=1)  # P's 2 heads, in order
            if p_tp == 1:
                want = p.rank_caches[0][name][[1, 2, 3]]
            for r, caches in enumerate(d.rank_caches):
                head = slice(r * 2 // d_tp, r * 2 // d_tp + 1) if d_tp > 1 else slice(0, 2)
                assert torch.equal(caches[name][[7, 8, 9]], want[:, head]), (name, r)
        received = sum(int(w.core.bytes_received) for w in d.workers)
        sent = sum(int(w.core.bytes_sent) for w in p.workers)
        d_kv = len(LAYER_NAMES) * 3 * d_tp * max(1, 2 // d_tp) * BLOCK * 8 * 4
        assert sent == received == d_kv  # exactly D's KV: no rank got bytes it threw away
        assert p.sched.num_outstanding == 0 and d.sched.num_outstanding == 0
    finally:
        p.close()
        d.close()
