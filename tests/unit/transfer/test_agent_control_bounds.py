"""The transfer control plane as a trust boundary (decision 116): sizes before the MAC, frame counts,
peer leases clamped, what peers leave waiting capped per peer and in all, peer epochs bounded.

A *raw peer* is a pair of ZMQ sockets speaking the control protocol by hand: a DEALER that sends to
the agent, and a ROUTER bound where the agent's replies go (so the agent sees a live endpoint)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

import msgspec
import pytest
import torch
import zmq

from kvwire.errors import AuthenticationError, ProtocolError
from kvwire.transfer import LayerSpec, TransferAgent, TransferConfig
from kvwire.transfer import wire as messages_module
from kvwire.transfer.config import ControlLimits
from kvwire.transfer.memory import PeerRef
from kvwire.transfer.wire import PROTOCOL_VERSION, Abort, Codec, Grant, Offer, Pull, Renew, WireLayer
from support.agent_helpers import _layers, _send, poll_until

HEAD = {"src_id": "peer-epoch-1", "transfer_id": "t"}
SMALL = ControlLimits(max_message_bytes=64 * 1024)


def wait_for(cond: Callable[[], bool], what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for: {what}"
        time.sleep(0.01)


class RawPeer:
    """Sends hand-made control messages to ``target`` from ``endpoint`` (a ROUTER that takes replies)."""

    def __init__(self, ctx: zmq.Context, target: str, secret: bytes | None = None) -> None:
        self.inbox = ctx.socket(zmq.ROUTER)
        self.inbox.setsockopt(zmq.LINGER, 0)
        port = self.inbox.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.out = ctx.socket(zmq.DEALER)
        self.out.setsockopt(zmq.LINGER, 0)
        self.out.connect(target)
        self.codec = Codec(secret)

    def send(self, msg: object) -> None:
        self.out.send_multipart(self.codec.encode(msg))  # type: ignore[arg-type]

    def send_frames(self, frames: list[bytes]) -> None:
        self.out.send_multipart(frames)

    def close(self) -> None:
        self.out.close(0)
        self.inbox.close(0)


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    context = zmq.Context()
    yield context
    context.term()


@contextlib.contextmanager
def raw_peer(ctx: zmq.Context, agent: TransferAgent) -> Iterator[RawPeer]:
    peer = RawPeer(ctx, agent.endpoint)
    try:
        yield peer
    finally:
        peer.close()


@contextlib.contextmanager
def holding_agent(config: TransferConfig) -> Iterator[TransferAgent]:
    """An agent whose receive memory has no room now (every reservation refused): a raw peer's Offer
    stays held, waiting for credit, until its lease ends."""
    with TransferAgent(config) as agent:
        agent._core.memory.reserve = lambda _num_bytes: None  # type: ignore[method-assign]
        yield agent


def offer(peer: RawPeer, tid: str, deadline_s: float = 30.0) -> Offer:
    layers = [WireLayer([8, 8], "float16")]  # 128 bytes
    return Offer(src_id="peer-epoch-1", src_endpoint=peer.endpoint, transfer_id=tid, layers=layers,
                 deadline_s=deadline_s, data_address="127.0.0.1:1")  # fmt: skip


# --- the codec -------------------------------------------------------------------------------------


def test_oversized_message_is_refused_before_its_mac_is_computed(monkeypatch: pytest.MonkeyPatch) -> None:
    codec = Codec(b"secret", max_message_bytes=64 * 1024)

    def no_mac(*_args: object) -> object:
        raise AssertionError("the MAC of an oversized message was computed")

    monkeypatch.setattr(messages_module.hmac, "new", no_mac)
    with pytest.raises(ProtocolError, match="exceeds 65536") as info:
        codec.decode([b"\x00" * (64 * 1024 + 1), b"m" * 32])
    assert not isinstance(info.value, AuthenticationError)
    with pytest.raises(AuthenticationError):  # a MAC frame of the wrong size: refused without hashing
        codec.decode([b"\x00" * 10, b"m" * (1 << 20)])
    with pytest.raises(ProtocolError, match="frames"):
        codec.decode([b"a", b"b", b"c"])


@pytest.mark.parametrize("deadline_s", [float("inf"), float("nan"), -1.0, 0.0, float("-inf")])
def test_non_finite_or_negative_deadlines_are_refused(deadline_s: float) -> None:
    base = {"t": "offer", "v": PROTOCOL_VERSION, **HEAD, "src_endpoint": "tcp://127.0.0.1:9",
            "layers": [[[4], "float16"]], "data_address": "h:1"}  # fmt: skip
    for kind in ("offer", "pull"):
        payload = msgspec.msgpack.encode({**base, "t": kind, "deadline_s": deadline_s})
        with pytest.raises(ProtocolError, match="deadline_s must be finite and > 0"):
            Codec(None).decode([payload])


def test_hostile_payloads_raise_protocol_error_only() -> None:
    codec = Codec(None)
    nested = b"\x91" * 200_000 + b"\xc0"  # arrays nested 200,000 deep
    nested_map = b"\x81\xa1t" * 50_000 + b"\xc0"
    huge_dims = msgspec.msgpack.encode({"t": "offer", "v": PROTOCOL_VERSION, **HEAD,
                                        "src_endpoint": "tcp://127.0.0.1:9", "deadline_s": 1.0,
                                        "layers": [[[2**62] * 5000, "float16"]], "data_address": "h:1"})
    for payload in (nested, nested_map, huge_dims, b"\xdd\xff\xff\xff\xff", b"\xc6\xff\xff\xff\xff"):
        with pytest.raises(ProtocolError):
            codec.decode([payload])


# --- limits on a live agent ------------------------------------------------------------------------


def test_message_of_too_many_frames_is_refused_and_counted(ctx: zmq.Context) -> None:
    with TransferAgent(TransferConfig(limits=SMALL)) as agent, raw_peer(ctx, agent) as peer:
        peer.send_frames([b"x"] * 1000)
        wait_for(lambda: agent.stats().limits_hit.get("control_frames") == 1, "frames refused")
        assert agent.stats().messages_rejected == 1
        peer.send_frames([b"\x00" * (64 * 1024 + 1)])  # over MAXMSGSIZE: ZMQ drops it (and the peer)
        peer.send(Renew(**HEAD, src_endpoint=peer.endpoint, state="unknown", reply=True))
        time.sleep(0.2)
        stats = agent.stats()
        assert stats.messages_rejected == 1 and stats.limits_hit.get("control_message_bytes") is None
        again = RawPeer(ctx, agent.endpoint)  # a new connection is heard again
        try:
            again.send_frames([b"\xc1"])
            wait_for(lambda: agent.stats().messages_rejected == 2, "the next message decoded")
        finally:
            again.close()


def test_peer_lease_is_clamped_so_an_offer_expires(ctx: zmq.Context) -> None:
    limits = ControlLimits(min_peer_deadline_s=0.05, max_peer_deadline_s=0.3)
    with holding_agent(TransferConfig(limits=limits)) as agent, raw_peer(ctx, agent) as peer:
        peer.send(offer(peer, "forever", deadline_s=1e300))
        events = poll_until(agent, lambda ev: "forever" in ev["failed"], timeout_s=20.0)
        assert events["failed"]["forever"] == "deadline: 0/1 layers received"
        stats = agent.stats()
        assert stats.limits_hit["peer_deadline"] == 1 and stats.transfers_active == 0


def test_unsolicited_offers_are_capped_per_peer(ctx: zmq.Context) -> None:
    limits = ControlLimits(max_pending_per_peer=3)
    with holding_agent(TransferConfig(limits=limits)) as agent, raw_peer(ctx, agent) as a, \
            raw_peer(ctx, agent) as b:  # fmt: skip
        for i in range(5):
            a.send(offer(a, f"a{i}"))
        wait_for(lambda: agent.stats().limits_hit.get("pending_per_peer") == 2, "two offers refused")
        b.send(offer(b, "b0"))  # another peer is not crowded out
        wait_for(lambda: agent.stats().transfers_active == 4, "b's offer held")
        agent.expect("a0", num_layers=1)  # an expected transfer no longer counts against its sender
        a.send(offer(a, "a5"))
        wait_for(lambda: agent.stats().transfers_active == 5, "a's next offer held")
        assert agent.stats().limits_hit["pending_per_peer"] == 2


def test_pending_transfers_cap_refuses_offers(ctx: zmq.Context) -> None:
    config = TransferConfig(max_pending_transfers=2)
    with holding_agent(config) as agent, raw_peer(ctx, agent) as peer:
        for i in range(4):
            peer.send(offer(peer, f"o{i}"))
        wait_for(lambda: agent.stats().limits_hit.get("pending_transfers") == 2, "two offers refused")
        assert agent.stats().transfers_active == 2


def _early_grant(peer: RawPeer, tid: str) -> Grant:
    return Grant(src_id="d-epoch", src_endpoint=peer.endpoint, transfer_id=tid, layers=[0], sizes=[64],
                 data_address="127.0.0.1:1", early=True)  # fmt: skip


def test_early_grants_are_capped_per_peer_and_in_all(ctx: zmq.Context) -> None:
    limits = ControlLimits(max_early_grants=3, max_early_grants_per_peer=2)
    with TransferAgent(TransferConfig(limits=limits)) as p, raw_peer(ctx, p) as a, raw_peer(ctx, p) as b:
        for i in range(4):
            a.send(_early_grant(a, f"a{i}"))
        wait_for(lambda: p.stats().limits_hit.get("early_grants_per_peer") == 2, "a's extra grants refused")
        for i in range(2):
            b.send(_early_grant(b, f"b{i}"))
        wait_for(lambda: p.stats().limits_hit.get("early_grants") == 1, "the total cap reached")
        with p._core.lock:
            kept = sorted(tid for tid, _ in p._sender.early_grants.items())
        assert kept == ["a0", "a1", "b0"]
        outsized = msgspec.structs.replace(_early_grant(a, "big"), layers=list(range(5000)), sizes=[1] * 5000)
        b.send(msgspec.structs.replace(outsized, src_endpoint=b.endpoint))  # not the shape of a transfer
        time.sleep(0.2)
        with p._core.lock:
            assert "big" not in p._sender.early_grants


def test_pulls_before_start_send_are_capped(ctx: zmq.Context) -> None:
    limits = ControlLimits(max_pending_per_peer=2, max_pending_pulls=3)
    with TransferAgent(TransferConfig(limits=limits)) as p, raw_peer(ctx, p) as a, raw_peer(ctx, p) as b:
        for i in range(3):
            a.send(Pull(src_id="d", src_endpoint=a.endpoint, transfer_id=f"a{i}", deadline_s=1e9,
                        data_address="127.0.0.1:1"))  # fmt: skip
        # a's third is refused for its peer before b sends: read interleaved, b's could fill the table
        # first and both of a's last two would be refused as pending_pulls instead
        wait_for(lambda: p.stats().limits_hit.get("pending_per_peer", 0) == 1, "a's third pull refused")
        for i in range(2):
            b.send(Pull(src_id="d", src_endpoint=b.endpoint, transfer_id=f"b{i}", deadline_s=30.0,
                        data_address="127.0.0.1:1"))  # fmt: skip
        refused = ("pending_per_peer", "pending_pulls")
        wait_for(lambda: sum(p.stats().limits_hit.get(k, 0) for k in refused) == 2, "two pulls refused")
        stats = p.stats()
        assert stats.limits_hit == {"peer_deadline": 2, "pending_per_peer": 1, "pending_pulls": 1}
        with p._core.lock:
            assert len(p._sender.pending_pulls) == 3
            until = max(until for _, (_, until) in p._sender.pending_pulls.items())
        assert until <= time.monotonic() + limits.max_peer_deadline_s


def test_peer_epochs_are_bounded(ctx: zmq.Context) -> None:
    config = TransferConfig(limits=ControlLimits(max_peers=4))
    with TransferAgent(config) as agent, raw_peer(ctx, agent) as peer:
        for i in range(10):  # spoofed endpoints: a Renew reply about nothing is answered with nothing
            peer.send(Renew(**HEAD, src_endpoint=f"tcp://10.0.0.{i}:1", state="unknown", reply=True))
        wait_for(lambda: agent.stats().limits_hit.get("peers") == 6, "six epochs forgotten")
        assert len(agent._core.peer_ids) == 4


def test_transfers_work_at_the_default_limits() -> None:
    with TransferAgent(TransferConfig()) as a, TransferAgent(TransferConfig()) as b:
        layers = _layers(3)
        b.expect("ok", num_layers=3)
        _send(a, "ok", b.endpoint, layers)
        poll_until(b, lambda ev: "ok" in ev["recvd"])
        got = b.take_layers("ok")
        assert all(torch.equal(got[i], t) for i, t in enumerate(layers))
        assert a.stats().limits_hit == {} and b.stats().limits_hit == {}



def test_an_offer_of_a_layer_no_pool_can_hold_fails_and_blocks_no_one(ctx: zmq.Context) -> None:
    """Credit is granted in Offer order. A layer larger than either pool (budget, spill) never gets a
    buffer, though both together could hold it: an Offer of one (here a raw peer's, not expected)
    used to wait at the head of the queue for its whole lease (up to max_peer_deadline_s), and every
    transfer behind it with it. It fails at once; the next transfer is granted and lands."""
    config = TransferConfig(recv_budget_bytes=1024, spill_budget_bytes=1024)
    with TransferAgent(config) as agent, TransferAgent(TransferConfig()) as sender, \
            raw_peer(ctx, agent) as hostile:  # fmt: skip
        big = msgspec.structs.replace(offer(hostile, "big"), layers=[WireLayer([32, 32], "float16")])
        hostile.send(big)  # 2,048 bytes: the two pools together, neither alone
        events = poll_until(agent, lambda ev: "big" in ev["failed"], timeout_s=20.0)
        assert events["failed"]["big"] == "budget: layer of 2048 bytes never fits"
        layers = _layers(2)
        agent.expect("after", num_layers=2, deadline_s=20.0)
        _send(sender, "after", agent.endpoint, layers, deadline_s=20.0)
        poll_until(agent, lambda ev: "after" in ev["recvd"], timeout_s=30.0)
        got = agent.take_layers("after")
        assert all(torch.equal(got[i], layers[i]) for i in range(2))


def test_endpoints_zeromq_refuses_are_dropped_not_loop_errors() -> None:
    """A peer endpoint comes from the caller (kv_transfer_params) or a peer; one ZeroMQ cannot connect
    to was an error of the control loop, and a hundred of them a minute gave the loop up (every
    transfer of the process failed). The message is dropped and counted (as a full queue's: the
    transfer ends at its lease); the loop stays up and moves the next transfer."""
    bad = ["not an endpoint", "tcp://", "http://host:1", "tcp://127.0.0.1:99999"]
    with TransferAgent(TransferConfig()) as agent, TransferAgent(TransferConfig()) as peer:
        for i in range(40):  # ~160 refused sends (Offers, Pulls, Renews): past MAX_CONTAINED_ERRORS
            agent.start_send(f"s{i}", bad[i % 4], [LayerSpec((4,), torch.float32)], deadline_s=0.5)
            agent.expect(f"r{i}", num_layers=1, pull_from=bad[(i + 1) % 4], deadline_s=0.5)
        events = poll_until(agent, lambda ev: len(ev["failed"]) == 80, timeout_s=30.0)
        assert all(reason.startswith(("deadline", "peer_lost")) for reason in events["failed"].values())
        assert agent.stats().limits_hit["control_endpoint"] >= 80
        assert agent.board.worker_errors().get("kvwire-transfer-control", 0) == 0
        assert not agent.board.dead() and agent.board.restarts().get("kvwire-transfer-control", 0) == 0
        layers = _layers(2)
        peer.expect("after", num_layers=2, deadline_s=20.0)
        _send(agent, "after", peer.endpoint, layers, deadline_s=20.0)
        poll_until(agent, lambda ev: "after" in ev["sent"], timeout_s=30.0)


def test_a_pulled_receive_ends_only_on_an_abort_from_its_sender() -> None:
    """An Abort names a transfer id; a pulled receive took one from any endpoint (a third agent that
    learned the id could end D's receive). Only the endpoint it pulls from may abort it."""
    with TransferAgent(TransferConfig()) as a, TransferAgent(TransferConfig()) as b:
        b.expect("pulled", num_layers=1, deadline_s=10.0, pull_from=a.endpoint)
        routes = b._routes
        for stranger in ("tcp://127.0.0.1:9", b.endpoint):
            routes.on_message(Abort(src_id="stranger-epoch", src_endpoint=stranger, transfer_id="pulled",
                                    dst_id=b.instance_id, reason="go away"))
        assert "pulled" in b._receiver.table  # still waiting for its sender
        routes.on_message(Abort(src_id="a-epoch", src_endpoint=a.endpoint, transfer_id="pulled",
                                dst_id=b.instance_id, reason="prefill failed"))
        failed = poll_until(b, lambda ev: "pulled" in ev["failed"])["failed"]["pulled"]
        assert failed.startswith("peer_aborted: prefill failed"), failed


def test_offers_not_expected_yet_are_granted_at_most_their_byte_cap(ctx: zmq.Context) -> None:
    """An Offer that beats ``expect`` is granted receive memory (decision 110's race), but a peer that
    offers and never sends held the budget until its leases ended. Past the per-peer byte cap an
    Offer waits, out of the credit queue: other transfers are granted and land, and ``expect``
    grants it (decision 150)."""
    limits = ControlLimits(max_unexpected_bytes_per_peer=256)  # two of the raw peer's 128-byte layers
    with TransferAgent(TransferConfig(limits=limits)) as agent, TransferAgent(TransferConfig()) as sender, \
            raw_peer(ctx, agent) as a, raw_peer(ctx, agent) as b:  # fmt: skip
        # the raw peers' Offers carry a real agent's plane handshake: this side grants, nobody sends
        hello = sender._core.plane.local_info(PeerRef(agent.endpoint, agent.instance_id, ""))
        plane = {"plane_info": hello, "data_address": sender._core.plane.address}
        for i in range(3):
            a.send(msgspec.structs.replace(offer(a, f"a{i}"), **plane))
        wait_for(lambda: agent.stats().limits_hit.get("unexpected_bytes_per_peer") == 1, "a2 left waiting")
        b.send(msgspec.structs.replace(offer(b, "b0"), **plane))  # another peer has its own cap
        table = agent._receiver.table
        wait_for(lambda: "b0" in table and 0 in table["b0"].granted, "b0 granted")
        with agent._core.lock:
            assert [0 in table[f"a{i}"].granted for i in range(3)] == [True, True, False]
            assert agent._receiver.unsolicited.granted_bytes[a.endpoint] == 256
        layers = _layers(2)  # an expected transfer is not held up behind the waiting offer
        agent.expect("after", num_layers=2, deadline_s=20.0)
        _send(sender, "after", agent.endpoint, layers, deadline_s=20.0)
        poll_until(agent, lambda ev: "after" in ev["recvd"], timeout_s=30.0)
        agent.expect("a2", num_layers=1)  # expected now: granted, though a's other offers still hold 256
        wait_for(lambda: 0 in table["a2"].granted, "a2 granted once expected")
        with agent._core.lock:
            assert agent._receiver.unsolicited.granted_bytes[a.endpoint] == 256
            assert not agent._receiver.unsolicited.parked
        assert agent.stats().limits_hit["unexpected_bytes_per_peer"] == 1


def test_offers_that_beat_expect_past_the_byte_cap_still_deliver_once_expected() -> None:
    """Decision 110's race with a real sender: both transfers are offered before ``expect``; past the
    cap their remaining layers wait, and each arrives whole once expected."""
    layers = {tid: _layers(3) for tid in ("r0", "r1")}  # 140 bytes a layer
    limits = ControlLimits(max_unexpected_bytes_per_peer=300)
    with TransferAgent(TransferConfig()) as p, TransferAgent(TransferConfig(limits=limits)) as d:
        for tid, tensors in layers.items():
            _send(p, tid, d.endpoint, tensors, deadline_s=30.0)
        # r0 and r1 (420 bytes each) would each pass 300 bytes: both wait, none of them granted
        wait_for(lambda: d.stats().limits_hit.get("unexpected_bytes_per_peer") == 2, "both offers waiting")
        for tid in layers:
            d.expect(tid, num_layers=3, deadline_s=30.0)
        poll_until(d, lambda ev: len(ev["recvd"]) == 2, timeout_s=30.0)
        for tid, tensors in layers.items():
            got = d.take_layers(tid)
            assert all(torch.equal(got[i], t) for i, t in enumerate(tensors))
        with d._core.lock:
            assert not d._receiver.unsolicited.granted_bytes and not d._receiver.unsolicited.parked


def test_an_offer_waiting_past_the_byte_cap_holds_no_memory_a_later_transfer_needs() -> None:
    """Decision 150, review: an Offer left waiting half granted kept its layers' memory while the
    transfers queued after it took the rest; with layers buffered for ``take_layers`` (no sink) the
    later one waited for memory only the waiting one's completion frees, and that one, expected now,
    waited behind it: neither completed. An Offer past the cap now waits before any of it is granted."""
    limits = ControlLimits(max_unexpected_bytes_per_peer=420)  # three of the 140-byte layers
    d_config = TransferConfig(limits=limits, recv_budget_bytes=1400, spill_budget_bytes=0)  # ten
    layers = {"early": _layers(6), "later": _layers(8)}
    with TransferAgent(TransferConfig()) as p, TransferAgent(d_config) as d:
        _send(p, "early", d.endpoint, layers["early"], deadline_s=30.0)  # before D expects it
        wait_for(lambda: d.stats().limits_hit.get("unexpected_bytes_per_peer") == 1, "early left waiting")
        d.expect("later", num_layers=8, deadline_s=30.0)
        _send(p, "later", d.endpoint, layers["later"], deadline_s=30.0)
        table = d._receiver.table

        def later_granted() -> bool:
            with d._core.lock:
                st = table.get("later")
                return st is None or (st.specs is not None and len(st.to_grant) <= 1)

        wait_for(later_granted, "later granted what the budget holds")
        d.expect("early", num_layers=6, deadline_s=30.0)
        got: dict[str, dict[int, torch.Tensor]] = {}
        deadline = time.monotonic() + 30.0
        while len(got) < 2:
            assert time.monotonic() < deadline, f"only {sorted(got)} arrived"
            d.wait(0.1)
            events = d.poll()
            assert not events.failed, events.failed
            got.update((tid, d.take_layers(tid)) for tid in events.finished_recving)  # frees their memory
        for tid, tensors in layers.items():
            assert all(torch.equal(got[tid][i], t) for i, t in enumerate(tensors))
