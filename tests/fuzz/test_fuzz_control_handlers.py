"""The transfer agent's handling of control messages past the codec, under hostile but well-formed
messages (the short fuzzing tier's step behind ``transfer.control``).

The codec's fuzz target proves that bytes become a valid message or a ProtocolError; what a valid
message then does is the agent's routes, senders and receivers (``Routes.on_message``, on the control
thread). An exception there is contained by the loop but counted, and a stream of them gives the loop
up (decision 116): a peer that finds one can stop every transfer of the process. So every message a
seeded generator makes (each kind, with extreme layer indices, sizes, heads, piece counts, leases,
states, epochs, plane_info, for transfers this agent sends, receives, holds, or never heard of) goes
through the real handlers on the test thread, where any exception fails the test; afterwards the
agent still moves a transfer with a real peer.

Every endpoint and data address in the messages is on loopback (nothing listens on them): what the
agent answers or dials stays on this host.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
import torch

from kvwire.bench.fuzz_corpus import plane_infos
from kvwire.errors import ProtocolError
from kvwire.transfer import TransferAgent, TransferConfig
from kvwire.transfer.core import PeerState
from kvwire.transfer.wire import Abort, Ack, AnyMsg, Codec, Grant, Offer, Pull, Renew, Trailer, WireLayer
from support.agent_helpers import _layers, _send, poll_until

ROUNDS = 150
MESSAGES_PER_ROUND = 12
PEERS = ("tcp://127.0.0.1:9", "tcp://127.0.0.1:11")  # nothing listens: answers go nowhere
EPOCHS = ("peer-epoch-a", "peer-epoch-b")
NUMBERS = (0, 1, 2, 3, 7, 4096, 2**31, 2**62)
DIMS = (0, 1, 16, 2**20, 2**40)
DEADLINES = (1e-9, 0.05, 2.0, 1e12)


class Hostile:
    """Builds well-formed control messages with hostile contents, for one round's transfer ids."""

    def __init__(self, rng: random.Random, agent_id: str) -> None:
        self.rng = rng
        self.agent_id = agent_id
        self.infos = [b"", b"\x00garbage", b"\x81\xa1x\x91" * 4, *plane_infos()]

    def _ints(self) -> list[int]:
        return [self.rng.choice(NUMBERS) for _ in range(self.rng.choice((0, 1, 2, 5)))]

    def _layer(self) -> WireLayer:
        shape = [self.rng.choice(DIMS) for _ in range(self.rng.randrange(0, 4))]
        return WireLayer(shape, self.rng.choice(("float32", "bfloat16", "uint8")))

    def message(self, ids: list[str]) -> AnyMsg:
        rng = self.rng
        head = {"src_id": rng.choice(EPOCHS), "src_endpoint": rng.choice(PEERS),
                "transfer_id": rng.choice(ids), "dst_id": rng.choice(("", self.agent_id, "other-epoch"))}
        info = rng.choice(self.infos)
        address = rng.choice(("127.0.0.1:9", "", "no-port"))
        kind = rng.randrange(7)
        if kind == 0:
            layers = [self._layer() for _ in range(rng.choice((0, 1, 2, 3, 5000)))]
            return Offer(**head, layers=layers, deadline_s=rng.choice(DEADLINES), data_address=address,
                         with_trailer=rng.random() < 0.5, plane_info=info)
        if kind == 1:
            return Grant(**head, layers=self._ints(), data_address=address, plane_info=info,
                         early=rng.random() < 0.5, sizes=self._ints())
        if kind == 2:
            return Ack(**head, layers=self._ints(), trailer=rng.random() < 0.5)
        if kind == 3:
            return Trailer(**head, payload=rng.randbytes(rng.choice((0, 8, 4096))))
        if kind == 4:
            return Abort(**head, reason=rng.choice(("", "peer_lost: x", "deadline", "y" * 5000)))
        if kind == 5:
            heads = rng.choice(([], [0, 1], [1, 2**31], [3, 2]))
            return Pull(**head, deadline_s=rng.choice(DEADLINES), data_address=address, plane_info=info,
                        held=rng.choice(("", *ids)), heads=heads, pieces=rng.choice((0, 1, 2, 4096)))
        states = [s.value for s in PeerState] + ["bogus"]
        return Renew(**head, state=rng.choice(states), reply=rng.random() < 0.5)


def _setup_round(agent: TransferAgent, r: int, rng: random.Random) -> list[str]:
    """This round's transfers on ``agent``: a push receive, a pull, a send, a held send; their ids,
    an id nobody knows and one of an earlier round."""
    recv, pull, send, held = (f"{r}-{kind}" for kind in ("recv", "pull", "send", "held"))
    agent.expect(recv, num_layers=2, deadline_s=1.0, accept_from=rng.choice((None, PEERS[0])))
    agent.expect(pull, num_layers=2, deadline_s=1.0, pull_from=PEERS[0])
    layers = [torch.ones(16) * r, torch.zeros(16)]
    _send(agent, send, PEERS[0], layers, deadline_s=1.0)
    _send(agent, held, None, layers, deadline_s=1.0)
    return [recv, pull, send, held, "never-heard-of", f"{max(r - 1, 0)}-send"]


@pytest.fixture(scope="module")
def agents() -> Iterator[tuple[TransferAgent, TransferAgent]]:
    config = TransferConfig(recv_budget_bytes=1 << 20, spill_budget_bytes=1 << 20)
    first, second = TransferAgent(config), TransferAgent(config)
    try:
        yield first, second
    finally:
        first.close()
        second.close()


def test_hostile_well_formed_messages_raise_nothing_in_the_handlers(
    agents: tuple[TransferAgent, TransferAgent],
) -> None:
    agent, peer = agents
    routes = agent._routes
    codec = Codec(None)
    rng = random.Random(2026_12_05)
    hostile = Hostile(rng, agent.instance_id)
    handled = 0
    for r in range(ROUNDS):
        ids = _setup_round(agent, r, rng)
        for _ in range(MESSAGES_PER_ROUND):
            msg = hostile.message(ids)
            try:  # what the control thread hands over: only what the codec lets through
                msg = codec.decode(codec.encode(msg))
            except ProtocolError:
                continue
            routes.on_message(msg)  # any exception here is the finding
            handled += 1
        routes.on_tick()
        agent.poll()
    assert handled > ROUNDS * MESSAGES_PER_ROUND // 2  # most messages reach the handlers
    assert agent._core.dead is None and not agent.board.dead()
    assert agent.board.worker_errors().get("kvwire-transfer-control", 0) == 0

    # the agent still moves a transfer with a real peer, both ways
    layers = _layers(2)
    peer.expect("after-1", num_layers=2, deadline_s=10.0)
    _send(agent, "after-1", peer.endpoint, layers, deadline_s=10.0)
    agent.expect("after-2", num_layers=2, deadline_s=10.0)
    _send(peer, "after-2", agent.endpoint, layers, deadline_s=10.0)
    mine = poll_until(agent, lambda e: "after-1" in e["sent"] and "after-2" in e["recvd"], timeout_s=30.0)
    assert "after-1" not in mine["failed"]
    got = agent.take_layers("after-2")
    assert sorted(got) == [0, 1] and all(torch.equal(got[i], layers[i]) for i in range(2))
