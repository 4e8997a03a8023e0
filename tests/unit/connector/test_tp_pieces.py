"""Per-rank pieces, the TP output merge and the P/D compatibility check (no processes)."""

from __future__ import annotations

import pytest
import torch
from prometheus_client import CollectorRegistry

from kvwire.connector.base import ConnectorOutput
from kvwire.connector.config import ConnectorConfig, EngineInfo
from kvwire.connector.metadata import AbortSpec, KvwireConnectorMetadata, PromiseSpec, RecvSpec
from kvwire.connector.metrics import connector_metrics
from kvwire.connector.pieces import (
    PieceBook,
    head_slice,
    held_pieces,
    pull_pieces,
    pull_releases,
    pullers,
    recv_pieces,
    send_pieces,
)
from kvwire.connector.scheduler import KvwireSchedulerConnector
from kvwire.connector.worker import KvwireWorkerConnector
from kvwire.engine.tp.aggregate import OutputAggregator
from kvwire.errors import ConfigError, InvalidRequestError
from kvwire.protocol.kv_params import KVCacheLayout, KVTransferParams, Role, layout_mismatch
from kvwire.transfer.enums import KVLayout
from kvwire.transfer.memory import PullSlice


def test_symmetric_plan_keeps_the_request_transfer_id() -> None:
    assert [p.transfer_id for p in send_pieces("t", 1, 2, 2, 4)] == ["t"]
    assert [p.transfer_id for p in recv_pieces("t", 0, 1, 1, 4)] == ["t"]
    split = send_pieces("t", 0, 1, 2, 4)
    assert [(p.transfer_id, p.peer_rank, p.heads) for p in split] == [
        ("t~p0d0", 0, range(0, 2)), ("t~p0d1", 1, range(2, 4))]  # fmt: skip
    assert send_pieces("t", 1, 2, 1, 1) == ()  # a replica: rank 0 sends the one head


def test_pull_pieces_merge_whole_p_layers_and_pull_splits_in_pieces() -> None:
    assert held_pieces("t", 1, 2)[0].transfer_id == "t~p1"
    merged = pull_pieces("t", 0, 2, 1, 4)  # each P rank's whole layer to D rank 0: the wire of before
    assert [(p.transfer_id, p.peer_rank, p.heads, p.source) for p in merged] == [
        ("t~p0", 0, range(0, 2), None),
        ("t~p1", 1, range(2, 4), None),
    ]
    # 1 -> 2: each D rank pulls its half of P's held layer under its own id; P serves 2 pieces
    split = [pull_pieces("t", d, 1, 2, 4)[0] for d in range(2)]
    assert [(p.transfer_id, p.heads, p.source) for p in split] == [
        ("t~d0", range(0, 2), PullSlice("t", range(0, 2), 2)),
        ("t~d1", range(0, 2), PullSlice("t", range(2, 4), 2)),
    ]
    # one KV head replicated on D: both D ranks pull P's whole layer, as two pieces
    assert [pull_pieces("t", d, 1, 2, 1)[0].source for d in range(2)] == [PullSlice("t", None, 2)] * 2
    # one KV head replicated on P (2 -> 1): D pulls P rank 0's layer whole and releases rank 1
    assert [(p.transfer_id, p.source) for p in pull_pieces("t", 0, 2, 1, 1)] == [("t~p0", None)]
    assert pull_releases("t", 0, 2, 1, 1) == ((1, "t~p1"),)
    assert pull_releases("t", 0, 1, 2, 4) == () and pull_releases("t", 1, 4, 2, 2) == ((1, "t~p1"),)
    # P knows D (the router named it): the D ranks it serves; none for a replica
    assert pullers(0, 1, ("d0", "d1"), 4) == ("d0", "d1")
    assert pullers(1, 2, ("d0",), 1) == () and pullers(0, 2, ("d0",), 1) == ("d0",)


def test_head_slice_is_a_view_of_the_heads() -> None:
    cache = torch.arange(2 * 3 * 4 * 4 * 2).view(2, 3, 4, 4, 2)
    view = head_slice(cache, range(1, 3), KVLayout.KV_FIRST)
    assert view.shape == (2, 3, 4, 2, 2) and view.data_ptr() == cache[:, :, :, 1].data_ptr()
    with pytest.raises(ConfigError):
        head_slice(torch.zeros(3, 4, 8), range(0, 1), KVLayout.MLA)


def test_piece_book_finishes_a_request_with_its_last_piece() -> None:
    book = PieceBook()
    book.add("t", "r", ["t~p0d0", "t~p1d0"])
    first = book.finish("t~p0d0")
    assert first is not None and first.pending == {"t~p1d0"} and len(book) == 1
    group = book.finish("t~p1d0")
    assert group is first and group.request_id == "r" and not group.pending and len(book) == 0
    assert book.finish("t~p1d0") is None  # unknown by now


def _meta(rid: str, blocks: tuple[int, ...]) -> KvwireConnectorMetadata:
    return KvwireConnectorMetadata(recvs=(RecvSpec(rid, "t-" + rid, blocks, 5.0, (), True),))


def test_aggregator_waits_for_every_rank_and_fails_all_ranks_at_once() -> None:
    agg = OutputAggregator(2)
    agg.note_metadata(_meta("a", (1, 2)))
    agg.note_metadata(_meta("b", (3, 4)))
    out = agg.merge([ConnectorOutput(finished_recving=frozenset({"a"}), first_token_ids={"a": 7}),
                     ConnectorOutput(finished_sending=frozenset({"p"}))])  # fmt: skip
    assert not out.finished_recving and not out.finished_sending  # one rank of two each
    out = agg.merge([ConnectorOutput(finished_sending=frozenset({"p"})),
                     ConnectorOutput(finished_recving=frozenset({"a"}))])  # fmt: skip
    assert out.finished_recving == {"a"} and out.first_token_ids == {"a": 7} and out.finished_sending == {"p"}
    # Rank 1's pieces of "b" fail (recompute): reported now, rank 0's pieces aborted next step.
    out = agg.merge(
        [
            ConnectorOutput(),
            ConnectorOutput(finished_recving=frozenset({"b"}), invalid_block_ids=frozenset({3, 4})),
        ]
    )
    assert out.finished_recving == {"b"} and out.invalid_block_ids == {3, 4}
    aborts = agg.take_aborts()
    assert [(a.request_id, a.transfer_id, a.report_free) for a in aborts] == [("b", "t-b", False)]
    assert not agg.merge(
        [ConnectorOutput(finished_recving=frozenset({"b"})), ConnectorOutput()]
    ).finished_recving


LAYOUT = KVCacheLayout(
    model="tiny", num_layers=4, num_kv_heads=2, head_dim=32, block_size=16, dtype="float32"
)


def test_layout_mismatch_names_the_difference() -> None:
    import msgspec

    assert layout_mismatch(LAYOUT, msgspec.structs.replace(LAYOUT, tp_size=2)) is None
    assert "block_size" in (layout_mismatch(LAYOUT, msgspec.structs.replace(LAYOUT, block_size=8)) or "")
    assert "tensor-parallel size 3" in (
        layout_mismatch(LAYOUT, msgspec.structs.replace(LAYOUT, tp_size=3)) or ""
    )


def test_an_incompatible_pair_is_refused_at_admission() -> None:
    import msgspec

    sched = KvwireSchedulerConnector(
        ConnectorConfig(role=Role.DECODE), EngineInfo(block_size=16), ["x"]
    )
    sched.kv_layout = LAYOUT
    ok = KVTransferParams(transfer_id="t", role=Role.DECODE, peer_endpoints=["a", "b"],
                          peer_kv_layout=msgspec.structs.replace(LAYOUT, tp_size=2))  # fmt: skip
    sched.check_request_params(ok.to_dict())
    bad = msgspec.structs.replace(
        ok, peer_kv_layout=msgspec.structs.replace(LAYOUT, dtype="bfloat16", tp_size=2)
    )
    with pytest.raises(InvalidRequestError, match=r"incompatible P/D pair: .*dtype"):
        sched.check_request_params(bad.to_dict())
    wrong_count = msgspec.structs.replace(ok, peer_endpoints=["a"])
    with pytest.raises(InvalidRequestError, match="1 peer endpoints"):
        sched.check_request_params(wrong_count.to_dict())


def test_an_opaque_layout_refuses_different_tp_sizes_and_keeps_equal_ones() -> None:
    """vLLM registers its KV as opaque blocks (MLA layout with num_kv_heads set): a P/D pair of
    different TP sizes must be refused (P frees, nothing sent), never sent whole as if it were MLA."""
    from prometheus_client import CollectorRegistry

    from kvwire.connector.metadata import SendSpec
    from kvwire.connector.metrics import connector_metrics
    from kvwire.connector.worker import KvwireWorkerConnector
    from support.connector_fakes import FakeFabric

    agent = FakeFabric().agent("p")
    info = EngineInfo(block_size=4, kv_layout=KVLayout.MLA, tp_size=1, num_kv_heads=2)
    worker = KvwireWorkerConnector(ConnectorConfig(role=Role.PREFILL), info, agent,
                                   metrics=connector_metrics(CollectorRegistry()))  # fmt: skip
    caches = [torch.zeros(8, 4, 16)]
    worker.register_kv_caches(caches)
    two_d_ranks = SendSpec("r", "t", ("tcp://d0:1", "tcp://d1:1"), (1, 2), 5.0, False)
    worker.bind_connector_metadata(KvwireConnectorMetadata(sends=(two_d_ranks,)))
    assert agent.sends == {}
    assert worker.get_finished(set()).finished_sending == {"r"}  # P may free its blocks at once
    worker.clear_connector_metadata()
    one_d_rank = SendSpec("r2", "t2", ("tcp://d0:1",), (1, 2), 5.0, False)
    worker.bind_connector_metadata(KvwireConnectorMetadata(sends=(one_d_rank,)))
    worker.save_kv_layer(0, caches[0])
    worker.wait_for_save()  # CPU caches: the send starts with its layers (decision 147)
    assert list(agent.sends) == ["t2"]  # same sizes: the whole opaque layer, as before
    worker.close()


def test_aggregator_fail_policy_fails_once_and_aborts_the_other_ranks() -> None:
    agg = OutputAggregator(3)
    agg.note_metadata(_meta("c", (5,)))
    out = agg.merge([ConnectorOutput(finished_recving=frozenset({"c"})),
                     ConnectorOutput(failed={"c": "deadline"}), ConnectorOutput()])  # fmt: skip
    assert out.failed == {"c": "deadline"} and not out.finished_recving
    assert [a.transfer_id for a in agg.take_aborts()] == ["t-c"]
    late = agg.merge([ConnectorOutput(), ConnectorOutput(failed={"c": "aborted"}),
                      ConnectorOutput(finished_recving=frozenset({"c"}))])  # fmt: skip
    assert not late.failed and not late.finished_recving and not agg.take_aborts()


class _PromiseRecorder:
    """The agent calls a P worker connector makes for a promise and an abort."""

    endpoint = "tcp://127.0.0.1:1"
    instance_id = "p"

    def __init__(self) -> None:
        self.promised: dict[str, str] = {}
        self.aborted: list[str] = []

    def register_kv_caches(self, kv_caches: object, layout: KVLayout) -> None:
        del kv_caches, layout

    def promise(self, transfer_id: str, peer_endpoint: str, *, deadline_s: float | None = None,
                limit_s: float | None = None) -> None:  # fmt: skip
        self.promised[transfer_id] = peer_endpoint

    def abort(self, transfer_id: str, reason: str = "aborted") -> None:
        self.aborted.append(transfer_id)


def test_p_promises_each_piece_to_its_d_rank_and_abort_forgets_them() -> None:
    """P TP 1 -> D TP 2: D's two ranks expect the pieces under their own ids; P's promise must renew
    those (not the request's id, which no D rank expects), and an abort before the send must end
    them."""
    agent = _PromiseRecorder()
    info = EngineInfo(block_size=4, num_kv_heads=4)
    metrics = connector_metrics(CollectorRegistry())
    worker = KvwireWorkerConnector(ConnectorConfig(role=Role.PREFILL), info, agent, metrics=metrics)  # type: ignore[arg-type]
    worker.register_kv_caches([torch.zeros(2, 4, 4, 4, 8)])
    worker.bind_connector_metadata(KvwireConnectorMetadata(promises=(PromiseSpec("t", ("d0", "d1"), 5.0),)))
    assert agent.promised == {"t~p0d0": "d0", "t~p0d1": "d1"}
    abort = AbortSpec("r", "t", "client gone", report_free=False)
    worker.bind_connector_metadata(KvwireConnectorMetadata(aborts=(abort,)))
    assert {"t~p0d0", "t~p0d1"} <= set(agent.aborted)
