"""Transfer-agent failure handling with real peer processes: abort, deadline, kill -9 mid-transfer,
restart on the same port, budget -> spill -> backpressure, malformed messages."""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Callable, Iterator

import msgspec
import pytest
import torch
import zmq

from kvwire.cluster.local import free_port
from kvwire.transfer import LayerSpec, TransferAgent, TransferConfig, TransferStats
from support.transfer_helpers import (
    DTYPES,
    PeerProcess,
    expected_digests,
    has_all,
    make_layer,
    plane_address,
    poll_until,
    shm_rings_mapped,
)
from support.waiting import wait_for

KIB = 1024
# 3 layers of [2, 4, 8, 64] float32 = 16 KiB each
SPECS3 = [([2, 4, 8, 64], "float32")] * 3


@pytest.fixture(scope="module", params=["auto", "tcp"])
def transport(request: pytest.FixtureRequest) -> str:
    """Faults on the default plane of one host (shared memory) and on forced TCP."""
    return str(request.param)


@pytest.fixture(scope="module")
def peer(transport: str) -> Iterator[PeerProcess]:
    proc = PeerProcess("--transport", transport)
    try:
        yield proc
    finally:
        proc.kill()


@pytest.fixture
def agent(transport: str) -> Iterator[TransferAgent]:
    with TransferAgent(TransferConfig(transport=transport)) as a:
        yield a


def test_abort_by_receiver_fails_both_sides_and_frees(peer: PeerProcess, agent: TransferAgent) -> None:
    agent.expect("ab-1", num_layers=3)
    peer.call("send", tid="ab-1", peer=agent.endpoint, seed=1, specs=SPECS3, order=[0])
    poll_until_stat(agent, lambda s: s.bytes_received >= 16 * KIB)
    agent.abort("ab-1")
    events = poll_until(agent, has_all("failed", ["ab-1"]), timeout_s=5)
    assert events["failed"]["ab-1"] == "aborted"
    reply = peer.call("wait", tids=["ab-1"], timeout_s=10)
    assert reply["events"]["failed"]["ab-1"].startswith("peer_aborted")
    stats = agent.stats()
    assert stats.budget_bytes_in_use == 0 and stats.transfers_active == 0


def test_abort_by_sender_fails_receiver(peer: PeerProcess, agent: TransferAgent) -> None:
    agent.expect("ab-2", num_layers=3)
    peer.call("send", tid="ab-2", peer=agent.endpoint, seed=2, specs=SPECS3, order=[1])
    poll_until_stat(agent, lambda s: s.bytes_received >= 16 * KIB)
    peer.call("abort", tid="ab-2", reason="client went away")
    events = poll_until(agent, has_all("failed", ["ab-2"]), timeout_s=5)
    assert events["failed"]["ab-2"] == "peer_aborted: client went away"
    assert agent.stats().budget_bytes_in_use == 0


def test_deadline_expires_on_both_sides(peer: PeerProcess, agent: TransferAgent) -> None:
    start = time.monotonic()
    agent.expect("dl-1", num_layers=3, deadline_s=1.0)
    peer.call("send", tid="dl-1", peer=agent.endpoint, seed=3, specs=SPECS3, order=[0, 2], deadline_s=1.0)
    events = poll_until(agent, has_all("failed", ["dl-1"]), timeout_s=10)
    # whichever side's deadline fires first tells the other ("peer_aborted: deadline ...")
    assert "deadline" in events["failed"]["dl-1"]
    assert 0.9 < time.monotonic() - start < 5.0
    reply = peer.call("wait", tids=["dl-1"], timeout_s=10)
    assert "deadline" in reply["events"]["failed"]["dl-1"]
    assert agent.stats().budget_bytes_in_use == 0


def test_sender_killed_mid_transfer_fails_receiver_before_deadline(
    agent: TransferAgent, transport: str
) -> None:
    rings_before = shm_rings_mapped()
    sender = PeerProcess("--transport", transport)
    try:
        arrived: list[int] = []
        agent.expect("kill-1", num_layers=3, sink=lambda i, t: arrived.append(i), deadline_s=30.0)
        sender.call("send", tid="kill-1", peer=agent.endpoint, seed=4, specs=SPECS3, order=[0])
        poll_until_stat(agent, lambda s: s.bytes_received >= 16 * KIB)
        start = time.monotonic()
        sender.kill()
        events = poll_until(agent, has_all("failed", ["kill-1"]), timeout_s=10)
    finally:
        sender.kill()
    assert events["failed"]["kill-1"].startswith("peer_lost")
    assert time.monotonic() - start < 10.0  # far within the 30 s deadline
    assert arrived == [0] and agent.stats().budget_bytes_in_use == 0
    wait_for(lambda: shm_rings_mapped() == rings_before, 10.0, "condition")  # the survivor unmapped the ring


def _send_all(
    agent: TransferAgent, tid: str, endpoint: str, seed: int, specs: list, order: list[int]
) -> None:
    agent.start_send(tid, endpoint, [LayerSpec(tuple(s), DTYPES[d]) for s, d in specs])
    for i in order:
        shape, dt = specs[i]
        agent.send_layer(tid, i, make_layer(seed, i, shape, dt))


def test_receiver_restarted_on_same_port(agent: TransferAgent, transport: str) -> None:
    port = free_port("127.0.0.1")
    old = PeerProcess("--port", str(port), "--transport", transport)
    new: PeerProcess | None = None
    try:
        endpoint = old.endpoint
        old.call("expect", tid="rs-1", num_layers=3)
        _send_all(agent, "rs-1", endpoint, 5, SPECS3, [0, 1, 2])
        poll_until(agent, has_all("sent", ["rs-1"]), timeout_s=15)
        old.call("expect", tid="rs-2", num_layers=3, sink=True)  # in flight when the receiver dies
        _send_all(agent, "rs-2", endpoint, 6, SPECS3, [0])
        poll_until_peer(old, "rs-2", 1)
        rings_with_old = shm_rings_mapped()
        old.kill()
        new = PeerProcess("--port", str(port), "--transport", transport)
        assert new.endpoint == endpoint and new.instance_id != old.instance_id
        start = time.monotonic()
        new.call("expect", tid="rs-3", num_layers=3)
        _send_all(agent, "rs-3", endpoint, 7, SPECS3, [2, 0, 1])
        events = poll_until(agent, lambda ev: "rs-3" in ev["sent"] and "rs-2" in ev["failed"], timeout_s=15)
        assert events["failed"]["rs-2"].startswith("peer_lost")
        assert time.monotonic() - start < 15.0  # the old transfer's deadline is 30 s
        if transport == "auto":  # the ring to the killed receiver is gone, one to the new one mapped
            wait_for(lambda: shm_rings_mapped() == rings_with_old, 10.0, "condition")
        reply = new.call("wait", tids=["rs-3"])
        assert reply["digests"]["rs-3"] == {str(i): d for i, d in expected_digests(7, SPECS3).items()}
    finally:
        old.kill()
        if new is not None:
            new.kill()


def test_budget_exhaustion_spills_then_backpressure_without_loss(peer: PeerProcess, transport: str) -> None:
    layer = ([2, 8, 16, 64], "float32")  # 64 KiB
    cfg = TransferConfig(recv_budget_bytes=256 * KIB, spill_budget_bytes=256 * KIB, transport=transport)
    with TransferAgent(cfg) as agent:
        sunk: dict[int, torch.Tensor] = {}
        agent.expect("bp-a", num_layers=6)  # held: 384 KiB of 512 KiB
        agent.expect("bp-b", num_layers=8, sink=lambda i, t: sunk.__setitem__(i, t.clone()))  # streams
        agent.expect("bp-c", num_layers=6)  # must wait until bp-a is taken
        agent.expect("bp-d", num_layers=10)  # 640 KiB without a sink: can never fit
        for tid, n, seed in (("bp-a", 6, 10), ("bp-b", 8, 11), ("bp-c", 6, 12), ("bp-d", 10, 13)):
            peer.call(
                "send", tid=tid, peer=agent.endpoint, seed=seed, specs=[layer] * n, order=list(range(n))
            )
        events = poll_until(agent, lambda ev: {"bp-a", "bp-b"} <= set(ev["recvd"]), timeout_s=20)
        assert events["failed"]["bp-d"].startswith("budget")
        assert "bp-c" not in events["recvd"]
        stats = agent.stats()
        assert stats.spilled_layers > 0 and stats.credit_waits > 0
        got_a = agent.take_layers("bp-a")  # frees memory: bp-c gets credit and completes
        poll_until(agent, has_all("recvd", ["bp-c"]), timeout_s=20)
        got_c = agent.take_layers("bp-c")
        for got, seed, n in ((got_a, 10, 6), (sunk, 11, 8), (got_c, 12, 6)):
            assert sorted(got) == list(range(n))
            for i in range(n):
                assert torch.equal(got[i], make_layer(seed, i, *layer)), (seed, i)
        reply = peer.call("wait", tids=["bp-a", "bp-b", "bp-c"])
        assert set(reply["events"]["sent"]) >= {"bp-a", "bp-b", "bp-c"}
        assert agent.stats().budget_bytes_in_use == 0 and agent.stats().spill_bytes_in_use == 0


def test_malformed_control_and_data_messages_are_rejected(peer: PeerProcess, agent: TransferAgent) -> None:
    enc = msgspec.msgpack.encode
    head = {"src_id": "x", "src_endpoint": "tcp://127.0.0.1:1", "transfer_id": "m"}
    bad = [
        [b"\xc1garbage"],
        [enc({"t": "offer", "v": 0, **head})],  # old version
        [enc({"t": "bogus", "v": 1, **head})],  # unknown type
        [enc({"t": "grant", "v": 1, **head, "layers": "nope", "data_address": "a"})],  # wrong field type
        [
            enc(
                {
                    "t": "offer",
                    "v": 1,
                    **head,
                    "layers": [[[-1], "float32"]],
                    "deadline_s": 1,
                    "data_address": "a",
                }
            )
        ],
        [
            enc(
                {
                    "t": "offer",
                    "v": 1,
                    **head,
                    "layers": [[[1], "complex1"]],
                    "deadline_s": 1,
                    "data_address": "a",
                }
            )
        ],
        [b"a", b"b", b"c"],  # too many frames
    ]
    ctx = zmq.Context()
    try:
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 1000)
        dealer.connect(agent.endpoint)
        for frames in bad:
            dealer.send_multipart(frames)
        dealer.close()
    finally:
        ctx.term()
    host, port = plane_address(agent, "tcp").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as raw:
        raw.recv(16)
        raw.sendall(b"HTTP/1.1 GET /\r\n\r\n" + bytes(64))
        try:
            hung_up = raw.recv(1) == b""  # the plane closed the connection on us
        except ConnectionResetError:
            hung_up = True  # ... with our junk unread: RST
        assert hung_up
    junk_links = 1
    if "shm=" in agent.data_address:  # the shared-memory plane's socket refuses junk the same way
        junk_links += 1
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:
            raw.settimeout(5)
            raw.connect("\0" + plane_address(agent, "shm")[1:])
            raw.recv(16)
            raw.sendall(b"HTTP/1.1 GET /\r\n\r\n" + bytes(64))
            with contextlib.suppress(ConnectionResetError):
                assert raw.recv(1) == b""
    poll_until_stat(agent, lambda s: s.messages_rejected >= len(bad) + junk_links)
    agent.expect("after-bad", num_layers=3)
    peer.call("send", tid="after-bad", peer=agent.endpoint, seed=8, specs=SPECS3, order=[0, 1, 2])
    poll_until(agent, has_all("recvd", ["after-bad"]), timeout_s=10)
    got = agent.take_layers("after-bad")
    assert all(torch.equal(got[i], make_layer(8, i, *SPECS3[i])) for i in range(3))


def poll_until_stat(
    agent: TransferAgent, cond: Callable[[TransferStats], bool], timeout_s: float = 10.0
) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond(agent.stats()):
        assert time.monotonic() < deadline, f"stats condition not met: {agent.stats()}"
        time.sleep(0.005)


def poll_until_peer(peer: PeerProcess, tid: str, count: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while peer.call("arrived", tid=tid)["count"] < count:
        assert time.monotonic() < deadline, f"{tid}: fewer than {count} layers arrived at the peer"
        time.sleep(0.01)
