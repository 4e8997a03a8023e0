"""A transfer is bound to the pair the router named: a third agent that knows (or guessed) the
transfer id can neither offer into a receive nor pull a lease. Real agents: D in this process, P and
the intruders in child processes, TCP on loopback, all with the shared secret unless said otherwise."""

from __future__ import annotations

import logging
import secrets
from collections.abc import Iterator

import pytest

from kvwire.errors import TransferError
from kvwire.transfer import TransferAgent, TransferConfig
from kvwire.transfer.core import TransferStats
from support.transfer_helpers import PeerProcess, digest, expected_digests, has_all, plane_address, poll_until

SECRET = "binding-test-secret"
SPECS = [([2, 3, 4, 8], "float32"), ([2, 3, 4, 8], "float16")]


@pytest.fixture(scope="module")
def peers() -> Iterator[dict[str, PeerProcess]]:
    procs = {"p": PeerProcess("--secret", SECRET), "intruder": PeerProcess("--secret", SECRET),
             "outsider": PeerProcess()}  # the outsider lacks the secret
    try:
        for proc in procs.values():
            proc.hello()
        yield procs
    finally:
        for proc in procs.values():
            proc.kill()


@pytest.fixture
def d_agent() -> Iterator[TransferAgent]:
    with TransferAgent(TransferConfig(secret=SECRET.encode())) as agent:
        yield agent


def _send(peer: PeerProcess, tid: str, to: str, seed: int) -> None:
    peer.call("send", tid=tid, peer=to, seed=seed, specs=SPECS, order=[0, 1], deadline_s=10.0)


def _stats_reach(agent: TransferAgent, done: object, timeout_s: float = 10.0) -> TransferStats:
    def check(_: object) -> bool:
        return bool(done(agent.stats()))  # type: ignore[operator]

    poll_until(agent, check, timeout_s)
    return agent.stats()


def test_offers_from_other_agents_are_refused_and_the_pair_completes(
    peers: dict[str, PeerProcess], d_agent: TransferAgent, caplog: pytest.LogCaptureFixture
) -> None:
    tid = secrets.token_hex(16)
    d_agent.expect(tid, num_layers=len(SPECS), accept_from=peers["p"].endpoint)
    # Both intruders know the id and offer first: with the secret -> refused as the wrong peer (the
    # intruder tries twice); without it -> the message itself is rejected.
    with caplog.at_level(logging.WARNING, logger="kvwire.transfer.core"):
        _send(peers["intruder"], tid, d_agent.endpoint, seed=666)
        _send(peers["outsider"], tid, d_agent.endpoint, seed=667)
        stats = _stats_reach(d_agent, lambda s: s.offers_refused >= 1 and s.messages_rejected >= 1)
        intruder = peers["intruder"].call("wait", tids=[tid], timeout_s=10.0)
        assert "not this transfer's peer" in intruder["events"]["failed"][tid]
        _send(peers["intruder"], tid, d_agent.endpoint, seed=668)
        stats = _stats_reach(d_agent, lambda s: s.offers_refused >= 2)
    assert sum("refused transfer message" in r.getMessage() for r in caplog.records) == 1  # not per offer
    # The real prefill's offer still goes through, with its own bytes.
    _send(peers["p"], tid, d_agent.endpoint, seed=42)
    poll_until(d_agent, has_all("recvd", [tid]), timeout_s=20)
    layers = d_agent.take_layers(tid)
    assert {i: digest(t) for i, t in layers.items()} == expected_digests(42, SPECS)
    assert peers["p"].call("wait", tids=[tid])["events"]["sent"] == {tid: ""}
    assert d_agent.stats().offers_refused == stats.offers_refused == 2


def test_an_offer_that_came_before_expect_from_another_agent_fails_the_transfer(
    peers: dict[str, PeerProcess], d_agent: TransferAgent
) -> None:
    tid = secrets.token_hex(16)
    _send(peers["intruder"], tid, d_agent.endpoint, seed=5)
    _stats_reach(d_agent, lambda s: s.bytes_received > 0)  # the intruder's offer is in, unexpected
    with pytest.raises(TransferError, match="not by its peer"):
        d_agent.expect(tid, num_layers=len(SPECS), accept_from=peers["p"].endpoint)
    assert d_agent.stats().offers_refused == 1
    assert "refused" in d_agent.poll().failed[tid]  # nothing of it is ever delivered
    # The agent keeps serving: the next transfer from the real peer completes.
    tid2 = secrets.token_hex(16)
    d_agent.expect(tid2, num_layers=len(SPECS), accept_from=peers["p"].endpoint)
    _send(peers["p"], tid2, d_agent.endpoint, seed=9)
    poll_until(d_agent, has_all("recvd", [tid2]), timeout_s=20)


def test_a_pull_lease_goes_only_to_the_named_receiver(
    peers: dict[str, PeerProcess], d_agent: TransferAgent
) -> None:
    tid = secrets.token_hex(16)
    p = peers["p"]
    p.call("send", tid=tid, peer=None, seed=77, specs=SPECS, order=[0, 1], deadline_s=10.0,
           pull_by=d_agent.endpoint)
    refused_before = p.call("stats")["offers_refused"]
    intruder = peers["intruder"]
    intruder.call("expect", tid=tid, num_layers=len(SPECS), pull_from=p.endpoint, deadline_s=10.0)
    failed = intruder.call("wait", tids=[tid], timeout_s=10.0)["events"]["failed"]
    assert "not this transfer's peer" in failed[tid]
    assert p.call("stats")["offers_refused"] == refused_before + 1
    # The lease is intact: the receiver the router named pulls it.
    d_agent.expect(tid, num_layers=len(SPECS), pull_from=p.endpoint)
    poll_until(d_agent, has_all("recvd", [tid]), timeout_s=20)
    assert {i: digest(t) for i, t in d_agent.take_layers(tid).items()} == expected_digests(77, SPECS)


# A process with the secret dials D's data listener and proves the MAC, claiming an epoch D's control
# plane does not hold (P restarted, or forged) or naming an earlier epoch of D; then it writes a frame
# for the victim's transfer. argv: address ("host:port" or "@abstract"), magic, version, secret, src, dst.
FORGER = """
import socket, sys
from kvwire.transfer.planes.common.hello import prove_hello
from kvwire.transfer.planes.common.wire import abstract_name
from kvwire.transfer.planes.tcp.wire import FRAME, host_port
address, magic, version, secret, src, dst, tid = sys.argv[1:8]
if address.startswith("@"):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(20)
    sock.connect(abstract_name(address))
else:
    sock = socket.create_connection(host_port(address), timeout=20)
prove_hello(sock, secret.encode(), src, dst, magic.encode(), int(version))
try:
    sock.sendall(FRAME.pack(0, 96, len(tid)) + tid.encode() + bytes(96))
    while sock.recv(4096):
        pass
except OSError:
    pass
print("closed")
"""


def _forge(address: str, magic: bytes, version: int, src: str, dst: str, tid: str) -> None:
    import subprocess
    import sys

    argv = [sys.executable, "-c", FORGER, address, magic.decode(), str(version), SECRET, src, dst, tid]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    assert done.stdout.strip() == "closed", done.stderr  # the listener closed the forged link


def test_a_forged_data_link_hello_is_refused_and_the_pair_completes(
    peers: dict[str, PeerProcess], d_agent: TransferAgent, caplog: pytest.LogCaptureFixture
) -> None:
    """Decision 126: with the secret, a hello whose epochs are not the ones D's control plane holds
    (P's epoch after a restart, or D's earlier epoch) is refused on every plane, counted, and the
    link closed; the real P's transfer then completes with its own bytes."""
    from kvwire.transfer.planes.common import admission
    from kvwire.transfer.planes.shm import wire as shm_wire
    from kvwire.transfer.planes.tcp import wire as tcp_wire

    p = peers["p"]
    warm = secrets.token_hex(16)  # D hears P: its control plane now holds P's epoch
    d_agent.expect(warm, num_layers=len(SPECS), accept_from=p.endpoint)
    _send(p, warm, d_agent.endpoint, seed=3)
    poll_until(d_agent, has_all("recvd", [warm]), timeout_s=20)
    tid = secrets.token_hex(16)  # the victim: expected from P while the forgers dial (each a slow start)
    d_agent.expect(tid, num_layers=len(SPECS), accept_from=p.endpoint, deadline_s=300.0)
    planes = [(plane_address(d_agent, "tcp"), tcp_wire.MAGIC, tcp_wire.VERSION),
              (plane_address(d_agent, "shm"), shm_wire.MAGIC, shm_wire.VERSION)]
    for address, magic, version in planes:
        _forge(address, magic, version, secrets.token_hex(8), d_agent.instance_id, tid)  # unknown epoch
        _forge(address, magic, version, p.instance_id, "d-earlier-epoch", tid)  # not meant for this D
    refused = d_agent.board.limit_hits()[admission.LINK_REFUSED]
    assert refused == 4
    assert d_agent.stats().messages_rejected >= 4  # each refusal is a rejected message too
    _send(p, tid, d_agent.endpoint, seed=42)
    poll_until(d_agent, has_all("recvd", [tid]), timeout_s=20)
    layers = d_agent.take_layers(tid)
    assert {i: digest(t) for i, t in layers.items()} == expected_digests(42, SPECS)
    assert d_agent.board.limit_hits()[admission.LINK_REFUSED] == refused  # P's own links: accepted
