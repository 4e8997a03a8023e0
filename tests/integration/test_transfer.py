"""Transfer agents in real processes on loopback: random shapes/dtypes/layer order, 2 -> 1 and 1 -> 2,
push and pull, content checked bit for bit."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
import torch

from kvwire.transfer import LayerSpec, TransferAgent, TransferConfig
from support.transfer_helpers import (
    DTYPES,
    PeerProcess,
    expected_digests,
    has_all,
    make_layer,
    poll_until,
    random_specs,
)


@pytest.fixture(scope="module", params=["auto", "tcp"])
def transport(request: pytest.FixtureRequest) -> str:
    """Every test runs on the plane agents negotiate by default (shared memory: one host) and on
    forced TCP (the plane between hosts)."""
    return str(request.param)


@pytest.fixture(scope="module")
def peers(transport: str) -> Iterator[list[PeerProcess]]:
    """Two peer processes shared by this module's tests (distinct transfer ids); always killed."""
    procs = [PeerProcess("--transport", transport), PeerProcess("--transport", transport)]
    try:
        yield procs
    finally:
        for proc in procs:
            proc.kill()


@pytest.fixture
def agent(transport: str) -> Iterator[TransferAgent]:
    with TransferAgent(TransferConfig(transport=transport)) as a:
        yield a


def _shuffled(rng: random.Random, n: int) -> list[int]:
    order = list(range(n))
    rng.shuffle(order)
    return order


def test_two_senders_to_one_receiver_bit_exact(peers: list[PeerProcess], agent: TransferAgent) -> None:
    rng = random.Random(7)
    senders = peers
    plan: dict[str, tuple[PeerProcess, int, list]] = {}
    sinks: dict[str, dict[int, torch.Tensor]] = {}
    for k in range(16):
        sender = senders[k % 2]
        tid = f"t{k}"
        seed = rng.randrange(1 << 30)
        specs = random_specs(rng)
        plan[tid] = (sender, seed, specs)
        send = dict(tid=tid, peer=agent.endpoint, seed=seed, specs=specs, order=_shuffled(rng, len(specs)))
        if k % 3 == 0:  # announce after the data may already have arrived
            sender.call("send", **send, trailer=f"tok-{tid}")
        sink = None
        if k % 4 < 2:
            sinks[tid] = {}
            sink = lambda i, t, d=sinks[tid]: d.__setitem__(i, t.clone())  # noqa: E731
        agent.expect(tid, num_layers=len(specs), sink=sink)
        if k % 3 != 0:
            sender.call("send", **send, trailer=f"tok-{tid}")
    events = poll_until(agent, has_all("recvd", list(plan)), timeout_s=30)
    assert not events["failed"]
    for tid, (_, seed, specs) in plan.items():
        got = sinks[tid] if tid in sinks else agent.take_layers(tid)
        assert sorted(got) == list(range(len(specs)))
        for i, (shape, dt) in enumerate(specs):
            want = make_layer(seed, i, shape, dt)
            assert got[i].dtype == DTYPES[dt] and tuple(got[i].shape) == tuple(shape)
            assert torch.equal(got[i].view(torch.uint8), want.view(torch.uint8)), (tid, i)
        assert agent.take_trailer(tid) == f"tok-{tid}".encode()
    for sender in senders:
        mine = [t for t, (s, _, _) in plan.items() if s is sender]
        reply = sender.call("wait", tids=mine)
        assert sorted(reply["events"]["sent"]) == sorted(mine) and not reply["events"]["failed"]
    stats = agent.stats()
    assert stats.recvs_completed == 16 and stats.budget_bytes_in_use == 0 and stats.transfers_active == 0


def test_one_sender_to_two_receivers_bit_exact(peers: list[PeerProcess], agent: TransferAgent) -> None:
    rng = random.Random(11)
    receivers = peers
    plan: dict[str, tuple[PeerProcess, int, list]] = {}
    for k in range(12):
        rcv = receivers[k % 2]
        tid = f"t{k}"
        seed = rng.randrange(1 << 30)
        specs = random_specs(rng)
        plan[tid] = (rcv, seed, specs)
        rcv.call("expect", tid=tid, num_layers=len(specs), sink=k % 4 < 2)
        layer_specs = [LayerSpec(tuple(shape), DTYPES[dt]) for shape, dt in specs]
        agent.start_send(tid, rcv.endpoint, layer_specs)
        for i in _shuffled(rng, len(specs)):
            shape, dt = specs[i]
            agent.send_layer(tid, i, make_layer(seed, i, shape, dt))
    events = poll_until(agent, has_all("sent", list(plan)), timeout_s=30)
    assert not events["failed"]
    for rcv in receivers:
        mine = [t for t, (r, _, _) in plan.items() if r is rcv]
        reply = rcv.call("wait", tids=mine)
        assert sorted(reply["events"]["recvd"]) == sorted(mine)
        for tid in mine:
            _, seed, specs = plan[tid]
            want = {str(i): d for i, d in expected_digests(seed, specs).items()}
            assert reply["digests"][tid] == want, tid


def test_pull_mode_sender_holds_until_receiver_pulls(peers: list[PeerProcess], agent: TransferAgent) -> None:
    rng = random.Random(3)
    rcv = peers[0]
    specs = random_specs(rng, max_layers=4)
    seed = 99
    agent.start_send("pull-1", None, [LayerSpec(tuple(s), DTYPES[d]) for s, d in specs], with_trailer=True)
    for i, (shape, dt) in enumerate(specs):
        agent.send_layer("pull-1", i, make_layer(seed, i, shape, dt))
    agent.send_trailer("pull-1", b"first-token:42")
    assert not agent.poll()  # nothing moves until the receiver asks
    rcv.call("expect", tid="pull-1", num_layers=len(specs), sink=True, pull_from=agent.endpoint)
    poll_until(agent, has_all("sent", ["pull-1"]), timeout_s=20)
    reply = rcv.call("wait", tids=["pull-1"])
    assert reply["digests"]["pull-1"] == {str(i): d for i, d in expected_digests(seed, specs).items()}
    assert reply["trailers"]["pull-1"] == "first-token:42"
