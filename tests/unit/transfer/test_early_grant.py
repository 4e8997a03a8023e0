"""Early grants (decision 110): a receiver that knows its sender grants at expect time, before the
Offer, so the sender writes without the Offer -> Grant round trip; the Offer is then checked
against what was granted."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

from kvwire.transfer import TransferAgent, TransferConfig
from kvwire.transfer.core import PeerState
from kvwire.transfer.enums import KVLayout
from kvwire.transfer.memory import (
    BlockTarget,
    LayerSpec,
    block_ids_tensor,
    block_spans,
    gather_blocks,
    shared_tensors,
)
from kvwire.transfer.wire import Grant, Renew
from support.agent_helpers import poll_until
from support.shm_planes import shm_plane
from support.waiting import free_port, wait_for

SHAPE = (2, 16, 8, 2, 16)  # KV_FIRST: 16 blocks of 512-byte halves (bfloat16)
LAYERS = 3


@pytest.fixture(params=["auto", "tcp"])
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[TransferAgent, TransferAgent]]:
    """P and D on the plane they negotiate by default (shared memory) or on forced TCP."""
    cfg = TransferConfig(transport=request.param)
    with TransferAgent(cfg) as p, TransferAgent(cfg) as d:
        yield p, d


def _caches(seed: int, shared: bool) -> list[torch.Tensor]:
    if shared:
        caches = shared_tensors([SHAPE] * LAYERS, torch.bfloat16)  # as the engine allocates on CPU
        gen = torch.Generator().manual_seed(seed)
        for c in caches:
            c.copy_(torch.randn(SHAPE, generator=gen).to(torch.bfloat16))
        return caches
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(SHAPE, generator=gen).to(torch.bfloat16) for _ in range(LAYERS)]


def _push(p: TransferAgent, d: TransferAgent, tid: str, src: list[torch.Tensor], dst: list[torch.Tensor],
          src_ids: list[int], dst_ids: list[int], sender: str | None) -> None:
    """D expects (naming its sender or not), then P starts and hands over every layer as spans."""
    d.expect(tid, num_layers=LAYERS, deadline_s=20.0, sender=sender,
             scatter_into=lambda i: block_spans(dst[i], dst_ids, KVLayout.KV_FIRST))
    payload = gather_blocks(src[0], block_ids_tensor(src_ids, "cpu"), KVLayout.KV_FIRST)
    p.start_send(tid, d.endpoint, [LayerSpec.of(payload)] * LAYERS, deadline_s=20.0)
    for i in range(LAYERS):
        p.send_layer_spans(tid, i, block_spans(src[i], src_ids, KVLayout.KV_FIRST))


def _grants_sent(agent: TransferAgent) -> list[Grant]:
    """Every Grant ``agent`` sends from now on (its core's send, wrapped)."""
    sent: list[Grant] = []
    send = agent._core.send

    def recording(endpoint: str, msg: object) -> None:
        if isinstance(msg, Grant):
            sent.append(msg)
        send(endpoint, msg)  # type: ignore[arg-type]

    agent._core.send = recording  # type: ignore[method-assign]
    return sent


def _landed(src: list[torch.Tensor], dst: list[torch.Tensor], src_ids: list[int], dst_ids: list[int]) -> bool:
    return all(
        torch.equal(gather_blocks(d, block_ids_tensor(dst_ids, "cpu"), KVLayout.KV_FIRST).view(torch.int16),
                    gather_blocks(s, block_ids_tensor(src_ids, "cpu"), KVLayout.KV_FIRST).view(torch.int16))
        for s, d in zip(src, dst, strict=True)
    )


def _send_started(p: TransferAgent, d: TransferAgent, tid: str, src: list[torch.Tensor], src_ids: list[int],
                  dst: list[torch.Tensor], dst_ids: list[int], started: bool = False) -> None:
    """P starts ``tid`` (unless ``started``) and hands over every layer as spans; both ends finish
    it without a failure and the blocks landed."""
    if not started:
        payload = gather_blocks(src[0], block_ids_tensor(src_ids, "cpu"), KVLayout.KV_FIRST)
        p.start_send(tid, d.endpoint, [LayerSpec.of(payload)] * LAYERS, deadline_s=20.0)
    for i in range(LAYERS):
        p.send_layer_spans(tid, i, block_spans(src[i], src_ids, KVLayout.KV_FIRST))
    ev_d = poll_until(d, lambda e: tid in e["recvd"] or tid in e["failed"])
    ev_p = poll_until(p, lambda e: tid in e["sent"] or tid in e["failed"])
    assert not ev_d["failed"] and not ev_p["failed"], (ev_d, ev_p)
    assert _landed(src, dst, src_ids, dst_ids)


@pytest.mark.parametrize("shared", [True, False], ids=["shared-cache", "ordinary-cache"])
def test_a_known_sender_is_granted_at_expect_and_writes_bit_exact(
    pair: tuple[TransferAgent, TransferAgent], shared: bool
) -> None:
    p, d = pair
    src, dst = _caches(1, False), _caches(2, shared)
    for c in dst:
        c.zero_()
    src_ids, dst_ids = [4, 5, 9, 1], [0, 7, 8, 3]
    # first contact: D does not know P's epoch yet, so it grants on P's Offer as always
    _push(p, d, "first", src, dst, src_ids, dst_ids, sender=p.endpoint)
    poll_until(d, lambda e: "first" in e["recvd"])
    poll_until(p, lambda e: "first" in e["sent"])
    assert d.stats().early_grants == 0
    for c in dst:
        c.zero_()
    # now D knows P: its expect grants every layer before P's Offer
    grants = _grants_sent(d)
    d.expect("early", num_layers=LAYERS, deadline_s=20.0, sender=p.endpoint,
             scatter_into=lambda i: block_spans(dst[i], dst_ids, KVLayout.KV_FIRST))
    assert d.stats().early_grants == 1
    wait_for(lambda: "early" in p._sender.early_grants, 10.0, "P kept the early grant")
    payload = gather_blocks(src[0], block_ids_tensor(src_ids, "cpu"), KVLayout.KV_FIRST)
    p.start_send("early", d.endpoint, [LayerSpec.of(payload)] * LAYERS, deadline_s=20.0)
    assert "early" not in p._sender.early_grants  # applied with the start
    assert p._sender.table["early"].granted == set(range(LAYERS))  # no round trip needed
    _send_started(p, d, "early", src, src_ids, dst, dst_ids, started=True)
    # P's Offer said it sends under the early grant: D does not grant again (decision 165)
    assert [g.early for g in grants if g.transfer_id == "early"] == [True]
    if p.peer_transports() == {d.endpoint: "shm"}:
        # no destination is left behind on P
        wait_for(lambda: not shm_plane(d)._granted, 5.0, "D's grant retired")
        assert not shm_plane(p).dests
        if shared:
            assert shm_plane(p).layers_sent["one_copy"] == 2 * LAYERS


def test_an_offer_of_other_sizes_is_granted_again_the_ordinary_way(
    pair: tuple[TransferAgent, TransferAgent],
) -> None:
    """P's layers are not the sizes D granted early (P sends 3 blocks, D takes 2): P does not use
    the early grant and D grants on the Offer as it always did — into blocks, the copy path drops
    what D does not take; into spans of another size, the transfer fails as a mismatch, as without
    early grants. Nothing is written under the unused grant."""
    p, d = pair
    src = _caches(1, False)
    dst = [torch.zeros(SHAPE, dtype=torch.bfloat16) for _ in range(LAYERS)]
    p.register_kv_caches(src, KVLayout.KV_FIRST)
    d.register_kv_caches(dst, KVLayout.KV_FIRST)
    _push(p, d, "contact", src, dst, [1, 2], [3, 4], sender=p.endpoint)
    poll_until(d, lambda e: "contact" in e["recvd"])
    poll_until(p, lambda e: "contact" in e["sent"])
    for c in dst:
        c.zero_()
    d.expect("more", num_layers=LAYERS, into_blocks=BlockTarget((5, 6)), deadline_s=20.0, sender=p.endpoint)
    assert d.stats().early_grants == 1
    wait_for(lambda: "more" in p._sender.early_grants, 10.0, "P kept the early grant")
    p.start_send("more", d.endpoint, p.block_layers(3), deadline_s=20.0)
    assert p._sender.table["more"].granted == set()  # not used: 3 blocks offered, 2 granted
    ids = torch.tensor([7, 8, 9], dtype=torch.int64)
    for i in range(LAYERS):
        p.send_blocks("more", i, ids)
    ev_d = poll_until(d, lambda e: "more" in e["recvd"] or "more" in e["failed"])
    ev_p = poll_until(p, lambda e: "more" in e["sent"] or "more" in e["failed"])
    assert not ev_d["failed"] and not ev_p["failed"], (ev_d, ev_p)
    assert d.stats().early_grants_unused == 1
    assert _landed(src, dst, [7, 8], [5, 6])  # the third block dropped

    d.expect("mm", num_layers=LAYERS, deadline_s=20.0, sender=p.endpoint,
             scatter_into=lambda i: block_spans(dst[i], [10, 11], KVLayout.KV_FIRST))  # 2 blocks
    assert d.stats().early_grants == 2
    three = gather_blocks(src[0], block_ids_tensor([1, 2, 3], "cpu"), KVLayout.KV_FIRST)
    wait_for(lambda: "mm" in p._sender.early_grants, 10.0, "P kept the early grant")
    p.start_send("mm", d.endpoint, [LayerSpec.of(three)] * LAYERS, deadline_s=20.0)  # 3 blocks
    for i in range(LAYERS):
        p.send_layer_spans("mm", i, block_spans(src[i], [1, 2, 3], KVLayout.KV_FIRST))
    ev_d = poll_until(d, lambda e: "mm" in e["failed"])
    ev_p = poll_until(p, lambda e: "mm" in e["failed"])
    assert "mismatch" in ev_d["failed"]["mm"]
    assert all(not gather_blocks(c, block_ids_tensor([10, 11], "cpu"), KVLayout.KV_FIRST).any() for c in dst)
    # the agents go on: the next transfer between them works
    _push(p, d, "after", src, dst, [1, 2], [3, 4], sender=p.endpoint)
    poll_until(d, lambda e: "after" in e["recvd"])
    poll_until(p, lambda e: "after" in e["sent"])


def test_an_early_grant_the_receiver_gives_up_is_dropped_by_the_sender(
    pair: tuple[TransferAgent, TransferAgent],
) -> None:
    """D aborts before P ever started (the request ended on D's side): P forgets the grant, and a
    later start of that id is refused by D rather than written into blocks D took back."""
    p, d = pair
    src, dst = _caches(1, False), [torch.zeros(SHAPE, dtype=torch.bfloat16) for _ in range(LAYERS)]
    _push(p, d, "contact", src, dst, [1], [2], sender=p.endpoint)
    poll_until(d, lambda e: "contact" in e["recvd"])
    poll_until(p, lambda e: "contact" in e["sent"])
    d.expect("gone", num_layers=LAYERS, deadline_s=20.0, sender=p.endpoint,
             scatter_into=lambda i: block_spans(dst[i], [3], KVLayout.KV_FIRST))
    wait_for(lambda: "gone" in p._sender.early_grants, 10.0, "P kept the early grant")
    d.abort("gone", "request cancelled")
    wait_for(lambda: "gone" not in p._sender.early_grants, 10.0, "P dropped the early grant")
    one = gather_blocks(src[0], block_ids_tensor([1], "cpu"), KVLayout.KV_FIRST)
    p.start_send("gone", d.endpoint, [LayerSpec.of(one)] * LAYERS, deadline_s=20.0)
    for i in range(LAYERS):
        p.send_layer_spans("gone", i, block_spans(src[i], [1], KVLayout.KV_FIRST))
    ev_p = poll_until(p, lambda e: "gone" in e["failed"] or "gone" in e["sent"])
    assert "gone" in ev_p["failed"]
    assert all(not gather_blocks(c, block_ids_tensor([3], "cpu"), KVLayout.KV_FIRST).any() for c in dst)


def test_into_blocks_with_a_known_sender_is_granted_early(pair: tuple[TransferAgent, TransferAgent]) -> None:
    """The serving path (registered caches, ``into_blocks``) takes early grants too."""
    p, d = pair
    src, dst = _caches(3, False), _caches(4, True)
    for c in dst:
        c.zero_()
    p.register_kv_caches(src, KVLayout.KV_FIRST)
    d.register_kv_caches(dst, KVLayout.KV_FIRST)
    for n, (tid, src_ids, dst_ids) in enumerate([("b1", [2, 3], [9, 10]), ("b2", [6, 1, 7], [0, 14, 5])]):
        d.expect(tid, num_layers=LAYERS, into_blocks=BlockTarget(tuple(dst_ids)), deadline_s=20.0,
                 sender=p.endpoint)
        assert d.stats().early_grants == n  # the first transfer is the first contact
        p.start_send(tid, d.endpoint, p.block_layers(len(src_ids)), deadline_s=20.0)
        ids = torch.tensor(src_ids, dtype=torch.int64)
        for i in range(LAYERS):
            p.send_blocks(tid, i, ids)
        ev_p = poll_until(p, lambda e, t=tid: t in e["sent"] or t in e["failed"])  # type: ignore[misc]
        ev_d = poll_until(d, lambda e, t=tid: t in e["recvd"] or t in e["failed"])  # type: ignore[misc]
        assert not ev_p["failed"] and not ev_d["failed"], (ev_p, ev_d)
        assert _landed(src, dst, src_ids, dst_ids)


def test_an_early_grant_arriving_after_the_start_is_used_only_if_the_sizes_fit(
    pair: tuple[TransferAgent, TransferAgent],
) -> None:
    """D's early grant can reach P after P's start_send (both sides move at once): P checks its
    sizes there too, and leaves one that does not fit for D's grant on the Offer."""
    p, d = pair
    src = _caches(1, False)
    payload = gather_blocks(src[0], block_ids_tensor([1, 2], "cpu"), KVLayout.KV_FIRST)
    p.start_send("late", d.endpoint, [LayerSpec.of(payload)] * LAYERS, deadline_s=20.0)
    header = {"src_id": d.instance_id, "src_endpoint": d.endpoint, "dst_id": p.instance_id,
              "transfer_id": "late"}
    size = LayerSpec.of(payload).num_bytes
    wrong = Grant(**header, layers=[0, 1, 2], data_address="", early=True, sizes=[size // 2] * LAYERS)
    right = Grant(**header, layers=[0, 1, 2], data_address="", early=True, sizes=[size] * LAYERS)
    with p._core.lock:
        p._sender.on_grant(wrong)
        assert p._sender.table["late"].granted == set()
        p._sender.on_grant(right)
        assert p._sender.table["late"].granted == {0, 1, 2}
    p.abort("late", "test over")


@pytest.mark.parametrize("transport", ["auto", "tcp"])
def test_a_sender_restarted_before_the_request_gets_the_transfer_granted_afresh(
    transport: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """D met P, P restarted on the same port unnoticed by D's data links (another host gone without
    a FIN, say), then the request came: D's early grant went to the old process, which never had
    the transfer. The new process's Offer is granted the ordinary way and the transfer completes
    (it failed as peer_lost before)."""
    port = free_port()
    cfg_p = TransferConfig(transport=transport, control_port=port)
    src, dst = _caches(1, False), _caches(2, True)
    for c in dst:
        c.zero_()
    src_ids, dst_ids = [4, 5, 9, 1], [0, 7, 8, 3]
    with TransferAgent(TransferConfig(transport=transport)) as d:
        # D's data links do not report the old process's end: D keeps the pair's plane and epoch
        monkeypatch.setattr(d._routes, "on_peer_failed", lambda peer_id, reason: None)
        with TransferAgent(cfg_p) as old:
            _push(old, d, "meet", src, dst, src_ids, dst_ids, sender=old.endpoint)
            poll_until(d, lambda e: "meet" in e["recvd"])
            poll_until(old, lambda e: "meet" in e["sent"])
            endpoint, old_id = old.endpoint, old.instance_id
        for c in dst:
            c.zero_()
        with TransferAgent(cfg_p) as new:
            assert new.endpoint == endpoint and new.instance_id != old_id
            # D still knows the old epoch: it grants early, to the process that is gone
            d.expect(
                "after",
                num_layers=LAYERS,
                deadline_s=20.0,
                sender=endpoint,
                scatter_into=lambda i: block_spans(dst[i], dst_ids, KVLayout.KV_FIRST),
            )
            assert d.stats().early_grants == 1
            _send_started(new, d, "after", src, src_ids, dst, dst_ids)
            stats = d.stats()
            assert stats.peers_restarted == 1 and stats.early_grants_unused == 1


def _known_pair(p: TransferAgent, d: TransferAgent) -> Callable[[str], None]:
    """P and D after one transfer (D knows P's epoch); returns an ``expect(tid)`` that D grants
    early."""
    src, dst = _caches(1, False), _caches(2, True)
    src_ids, dst_ids = [4, 5], [0, 7]
    _push(p, d, "meet", src, dst, src_ids, dst_ids, sender=p.endpoint)
    poll_until(d, lambda e: "meet" in e["recvd"])

    def expect(tid: str) -> None:
        d.expect(tid, num_layers=LAYERS, deadline_s=20.0, sender=p.endpoint,
                 scatter_into=lambda i: block_spans(dst[i], dst_ids, KVLayout.KV_FIRST))

    return expect


def test_a_restart_forgets_only_early_grants_the_old_epoch_never_had(
    pair: tuple[TransferAgent, TransferAgent],
) -> None:
    """The edge of that rule, as D's control thread sees it: a restart (a new process at P's
    endpoint) forgets an early grant the old epoch never showed it had, and fails one it reported
    as its own (a Renew in progress) at once, as before."""
    p, d = pair
    expect = _known_pair(p, d)
    for tid in ("had", "never"):
        expect(tid)
    assert d.stats().early_grants == 2
    had, never = d._receiver.table["had"], d._receiver.table["never"]
    with d._core.lock:  # P's Renew reply "queued" (it had the request) as the control thread sees it
        d._receiver.on_renew(Renew(**p._core.header(d.endpoint, "had", d.instance_id),
                                   state=PeerState.QUEUED.value, reply=True))
    assert had.sender_id == p.instance_id and never.sender_id is None
    with d._core.lock:
        d._routes._fail_peer(p.instance_id, "peer_lost: test restart", restarted=True)
    assert "had" in poll_until(d, lambda e: "had" in e["failed"])["failed"]
    assert d._receiver.table["never"] is never  # still waiting, for the new process's Offer
    assert never.peer is None and not never.early and d.stats().early_grants_unused == 1


def test_a_broken_link_of_a_live_sender_fails_its_early_grants(
    pair: tuple[TransferAgent, TransferAgent],
) -> None:
    """Not a restart: the live P may have kept the early grant, whose slot goes with the link, so
    D fails the transfer (P learns of it on its Offer) rather than wait for its deadline."""
    p, d = pair
    expect = _known_pair(p, d)
    expect("linked")
    assert d.stats().early_grants == 1
    with d._core.lock:
        d._routes._fail_peer(p.instance_id, "peer_lost: link broke")
    assert "linked" in poll_until(d, lambda e: "linked" in e["failed"])["failed"]
