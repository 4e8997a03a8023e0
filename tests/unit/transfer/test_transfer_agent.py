"""TransferAgent behaviour with two in-process agents on loopback (fast; multi-process cases live in
tests/integration/test_transfer*.py)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch

from kvwire.errors import TransferError
from kvwire.transfer import LayerSpec, TransferAgent, TransferConfig
from kvwire.transfer.memory import KVLayout, block_ids_tensor, block_spans, gather_blocks
from support.agent_helpers import _layers, _send, poll_until


@pytest.fixture(params=["auto", "tcp"])
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[TransferAgent, TransferAgent]]:
    """Two agents on the plane they negotiate by default (shared memory) or on forced TCP."""
    cfg = TransferConfig(transport=request.param)
    with TransferAgent(cfg) as a, TransferAgent(cfg) as b:
        yield a, b


CACHE_SHAPES = {
    KVLayout.KV_FIRST: (2, 12, 4, 2, 8),
    KVLayout.BLOCK_FIRST: (12, 2, 4, 2, 8),
    KVLayout.MLA: (12, 4, 16),
    KVLayout.BLOCK_HEAD: (12, 2, 4, 16),
}


@pytest.mark.parametrize("layout", list(KVLayout))
@pytest.mark.parametrize("zero_copy_plane", [True, False])
def test_paged_spans_transfer_is_bit_exact(
    pair: tuple[TransferAgent, TransferAgent], layout: KVLayout, zero_copy_plane: bool
) -> None:
    a, b = pair
    if not zero_copy_plane:  # a plane without span support: the agent gathers / scatters by copy
        for agent in pair:
            agent._core.plane.supports_spans = False  # type: ignore[misc]
    src = [torch.randn(CACHE_SHAPES[layout]).to(torch.bfloat16) for _ in range(3)]
    dst = [torch.zeros_like(t) for t in src]
    src_ids, dst_ids = [5, 6, 7, 1, 11], [0, 3, 4, 9, 2]
    payload = gather_blocks(src[0], block_ids_tensor(src_ids, "cpu"), layout)
    b.expect("pg", num_layers=3, scatter_into=lambda i: block_spans(dst[i], dst_ids, layout))
    a.start_send("pg", b.endpoint, [LayerSpec.of(payload)] * 3)
    for i in (2, 0, 1):
        a.send_layer_spans("pg", i, block_spans(src[i], src_ids, layout))
    poll_until(b, lambda ev: "pg" in ev["recvd"])
    poll_until(a, lambda ev: "pg" in ev["sent"])
    for s, d in zip(src, dst, strict=True):
        want = gather_blocks(s, block_ids_tensor(src_ids, "cpu"), layout)
        assert torch.equal(
            gather_blocks(d, block_ids_tensor(dst_ids, "cpu"), layout).view(torch.int16),
            want.view(torch.int16),
        )
    assert b.stats().budget_bytes_in_use == 0


def test_scatter_into_after_data_arrived_copies_buffered_layers(
    pair: tuple[TransferAgent, TransferAgent],
) -> None:
    a, b = pair
    src = torch.randn(2, 8, 4, 2, 8)
    dst = torch.zeros_like(src)
    ids = [1, 4, 6]
    payload = gather_blocks(src, block_ids_tensor(ids, "cpu"), KVLayout.KV_FIRST)
    _send(a, "late", b.endpoint, [payload])
    poll_until(a, lambda ev: "late" in ev["sent"])  # acknowledged while buffered, before expect
    b.expect("late", num_layers=1, scatter_into=lambda i: block_spans(dst, ids, KVLayout.KV_FIRST))
    poll_until(b, lambda ev: "late" in ev["recvd"])
    assert torch.equal(gather_blocks(dst, block_ids_tensor(ids, "cpu"), KVLayout.KV_FIRST), payload)


def test_whole_push_held_before_expect_survives_the_sender_leaving(
    pair: tuple[TransferAgent, TransferAgent],
) -> None:
    """P pushed every layer (and D acknowledged them into its receive buffers) before D's expect;
    P then went away: the data is whole, so the expect that follows completes the transfer."""
    a, b = pair
    src = torch.randn(2, 8, 4, 2, 8)
    dst = torch.zeros_like(src)
    ids = [2, 3, 7]
    payload = gather_blocks(src, block_ids_tensor(ids, "cpu"), KVLayout.KV_FIRST)
    _send(a, "whole", b.endpoint, [payload])
    poll_until(a, lambda ev: "whole" in ev["sent"])
    b._routes.on_peer_failed(a.instance_id, "peer_lost: the sender closed")  # what its plane reports
    b.expect("whole", num_layers=1, scatter_into=lambda i: block_spans(dst, ids, KVLayout.KV_FIRST))
    ev = poll_until(b, lambda ev: "whole" in ev["recvd"])
    assert "whole" not in ev["failed"]
    assert torch.equal(gather_blocks(dst, block_ids_tensor(ids, "cpu"), KVLayout.KV_FIRST), payload)
    assert b.stats().budget_bytes_in_use == 0


def test_layer_count_mismatch_fails_both_sides(pair: tuple[TransferAgent, TransferAgent]) -> None:
    a, b = pair
    b.expect("mm", num_layers=2)
    _send(a, "mm", b.endpoint, _layers(3))
    assert poll_until(b, lambda ev: "mm" in ev["failed"])["failed"]["mm"].startswith("mismatch")
    assert poll_until(a, lambda ev: "mm" in ev["failed"])["failed"]["mm"].startswith("peer_aborted: mismatch")


def test_sink_error_fails_the_transfer_not_the_agent(pair: tuple[TransferAgent, TransferAgent]) -> None:
    a, b = pair

    def bad_sink(index: int, tensor: torch.Tensor) -> None:
        raise RuntimeError("no room")

    b.expect("sink", num_layers=3, sink=bad_sink)
    _send(a, "sink", b.endpoint, _layers())
    assert "no room" in poll_until(b, lambda ev: "sink" in ev["failed"])["failed"]["sink"]
    # D acks a layer when it lands, before its sink runs: P ends the transfer failed (D's abort came
    # before the last ack) or sent (every layer had landed: on shm the three arrive in one batch);
    # either way it ends, once
    ended = poll_until(a, lambda ev: "sink" in ev["failed"] or "sink" in ev["sent"])
    assert ("sink" in ended["failed"]) != ("sink" in ended["sent"])
    b.expect("fine", num_layers=3)  # the agent keeps working
    _send(a, "fine", b.endpoint, _layers())
    poll_until(b, lambda ev: "fine" in ev["recvd"])
    assert len(b.take_layers("fine")) == 3
    with pytest.raises(TransferError):
        b.take_layers("fine")  # once


def test_api_misuse_raises_typed_errors(pair: tuple[TransferAgent, TransferAgent]) -> None:
    a, b = pair
    layers = _layers()
    a.start_send("x", b.endpoint, [LayerSpec.of(t) for t in layers])
    with pytest.raises(TransferError):
        a.start_send("x", b.endpoint, [LayerSpec.of(t) for t in layers])
    with pytest.raises(TransferError, match="announced"):
        a.send_layer("x", 0, torch.zeros(3))
    with pytest.raises(TransferError, match="out of range"):
        a.send_layer("x", 5, layers[0])
    with pytest.raises(TransferError, match="unknown transfer"):
        a.send_layer("never-started", 0, layers[0])
    with pytest.raises(TransferError, match="trailer"):
        a.send_trailer("x", b"no trailer announced")
    a.abort("x")
    a.send_layer("x", 0, layers[0])  # ended transfers ignore late layers (the failure was reported)
    assert a.poll().failed == {"x": "aborted"}
    assert not a.poll()  # each event once
    a.start_send("y", b.endpoint, [LayerSpec.of(t) for t in layers])
    a.abort("y", "client disconnected")  # free text reason: reported under its kind, counted as "aborted"
    assert a.poll().failed == {"y": "aborted: client disconnected"}  # every reason names its kind
    assert a.stats().failed == {"aborted": 2}


def test_pull_that_overtakes_start_send_is_held(pair: tuple[TransferAgent, TransferAgent]) -> None:
    a, b = pair
    b.expect("early-pull", num_layers=3, pull_from=a.endpoint)
    deadline = time.monotonic() + 10
    while "early-pull" not in a._sender.pending_pulls:  # the Pull arrived before start_send
        assert time.monotonic() < deadline
        time.sleep(0.002)
    _send(a, "early-pull", None, _layers())
    poll_until(b, lambda ev: "early-pull" in ev["recvd"])
    assert all(
        torch.equal(x, y) for x, y in zip(b.take_layers("early-pull").values(), _layers(), strict=True)
    )


def test_unpulled_lease_expires(pair: tuple[TransferAgent, TransferAgent]) -> None:
    a, _ = pair
    _send(a, "lease", None, _layers(), deadline_s=0.2)
    assert poll_until(a, lambda ev: "lease" in ev["failed"])["failed"]["lease"] == "deadline: not pulled"


def test_stats_count_transfers_and_bytes(pair: tuple[TransferAgent, TransferAgent]) -> None:
    a, b = pair
    layers = _layers()
    b.expect("st", num_layers=3)
    _send(a, "st", b.endpoint, layers)
    poll_until(a, lambda ev: "st" in ev["sent"])
    poll_until(b, lambda ev: "st" in ev["recvd"])
    total = sum(t.numel() * t.element_size() for t in layers)
    sa, sb = a.stats(), b.stats()
    assert (sa.sends_started, sa.sends_completed, sa.bytes_sent) == (1, 1, total)
    assert (sb.recvs_started, sb.recvs_completed, sb.bytes_received) == (1, 1, total)
    assert sb.budget_bytes_in_use == total  # held until take_layers
    b.take_layers("st")
    assert b.stats().budget_bytes_in_use == 0


def test_wait_sleeps_until_an_event_is_ready(pair: tuple[TransferAgent, TransferAgent]) -> None:
    """``wait`` returns False after its timeout when nothing happened, and True (without running out
    its timeout) once a transfer's end is waiting for ``poll``; that event is then polled as usual."""
    a, b = pair
    assert a.wait(0.05) is False
    assert b.poll().finished_recving == frozenset()
    layers = _layers()
    b.expect("w1", num_layers=len(layers))
    _send(a, "w1", b.endpoint, layers)
    seen: set[str] = set()
    deadline = time.monotonic() + 20.0
    while "w1" not in seen:
        left = deadline - time.monotonic()
        assert left > 0, "the transfer did not end in 20 s"
        start = time.monotonic()
        if b.wait(left):
            assert time.monotonic() - start < left  # woken by the event, not by the timeout
            ev = b.poll()
            assert not ev.failed
            seen |= ev.finished_recving
    assert torch.equal(b.take_layers("w1")[0], layers[0])
    poll_until(a, lambda e: "w1" in e["sent"])
