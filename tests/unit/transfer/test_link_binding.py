"""A data link's hello is bound to the epochs the control plane authenticated (decision 126): it names
the dialler's epoch and the acceptor's, both under the MAC, and the acceptor takes the link only when
the first is an epoch its control plane holds now and the second is its own. Planes in this process,
fake agents (``peer_endpoint`` answers from a set), real sockets."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator, Sequence

import pytest
import torch

from kvwire.errors import AuthenticationError, ProtocolError
from kvwire.supervision import HealthBoard
from kvwire.transfer.config import TransferConfig
from kvwire.transfer.enums import Transport
from kvwire.transfer.memory import PeerRef, RecvItem, SendItem
from kvwire.transfer.planes.common import admission
from kvwire.transfer.planes.common.hello import LinkRefused, bind_hello, check_hello, prove_hello
from kvwire.transfer.planes.common.link_config import DataLinkConfig
from kvwire.transfer.planes.common.wire import abstract_name
from kvwire.transfer.planes.shm import wire as shm_wire
from kvwire.transfer.planes.shm.plane import ShmPlane
from kvwire.transfer.planes.tcp import wire as tcp_wire
from kvwire.transfer.planes.tcp.plane import TcpPlane
from kvwire.transfer.planes.tcp.wire import host_port
from support.waiting import wait_for

SECRET = b"s" * 32
LINKS = DataLinkConfig(max_connections=8, max_connections_per_peer=8, handshake_timeout_s=5.0,
                       keepalive_s=0.25, link_timeout_s=5.0)


class Agent:
    """The agent's side of the planes: ``known`` is what its control plane holds (epoch -> endpoint)."""

    def __init__(self, known: dict[str, str]) -> None:
        self.known = known
        self.lock = threading.Lock()
        self.received: list[tuple[str, str, int]] = []
        self.peer_failed: list[tuple[str, str]] = []
        self.protocol_errors: list[str] = []

    def peer_endpoint(self, peer_instance_id: str) -> str | None:
        return self.known.get(peer_instance_id)

    def on_sent(self, peer: str, transfer_id: str, layers: Sequence[int]) -> None:
        pass

    def on_received(self, peer: str, transfer_id: str, layers: Sequence[int]) -> None:
        with self.lock:
            self.received += [(peer, transfer_id, i) for i in layers]

    def on_transfer_failed(self, transfer_id: str, reason: str) -> None:
        pass

    def on_peer_failed(self, peer: str, reason: str) -> None:
        with self.lock:
            self.peer_failed.append((peer, reason))

    def on_protocol_error(self, reason: str) -> None:
        with self.lock:
            self.protocol_errors.append(reason)

    def on_device_copy(self, num_bytes: int, seconds: float) -> None:
        pass


def _hello_over_pair(claim: tuple[str, str], secret_in: bytes | None, secret_out: bytes | None,
                     version: int = tcp_wire.VERSION) -> tuple[str, str]:
    ours, theirs = socket.socketpair()
    ours.settimeout(10)
    theirs.settimeout(10)
    dialler = threading.Thread(
        target=lambda: prove_hello(ours, secret_in, claim[0], claim[1], tcp_wire.MAGIC, version)
    )
    dialler.start()
    try:
        return check_hello(theirs, secret_out, tcp_wire.MAGIC, tcp_wire.VERSION, "test link")
    finally:
        dialler.join(10)
        ours.close()
        theirs.close()


def test_the_hello_carries_both_epochs_under_the_mac() -> None:
    assert _hello_over_pair(("p-epoch", "d-epoch"), SECRET, SECRET) == ("p-epoch", "d-epoch")
    with pytest.raises(AuthenticationError):
        _hello_over_pair(("p-epoch", "d-epoch"), b"x" * 32, SECRET)
    with pytest.raises(ProtocolError, match="version 2; want 3"):  # a version-2 peer: refused, named
        _hello_over_pair(("p-epoch", "d-epoch"), SECRET, SECRET, version=2)


def test_the_binding_names_what_it_refuses() -> None:
    agent = Agent({"p-epoch": "tcp://p:1"})
    assert bind_hello(("p-epoch", "d-epoch"), "d-epoch", agent, "link") == "p-epoch"
    with pytest.raises(LinkRefused, match="does not know"):
        bind_hello(("forged", "d-epoch"), "d-epoch", agent, "link")
    with pytest.raises(LinkRefused, match="meant for epoch 'd-old'"):
        bind_hello(("p-epoch", "d-old"), "d-epoch", agent, "link")


@pytest.fixture
def tcp_pair() -> Iterator[tuple[TcpPlane, Agent, TcpPlane, HealthBoard]]:
    board = HealthBoard()
    config = TransferConfig(transport=Transport.TCP, links=LINKS, secret=SECRET)
    receiver, sender = TcpPlane(config, "d-epoch", board), TcpPlane(config, "p-epoch", HealthBoard())
    agent = Agent({"p-epoch": "tcp://p:1"})
    receiver.start(agent)
    sender.start(Agent({"d-epoch": "tcp://d:1"}))
    try:
        yield receiver, agent, sender, board
    finally:
        sender.close()
        receiver.close()


def _forge(address: str, claim: tuple[str, str], secret: bytes) -> bool:
    """Dial with a hello proving ``secret`` and claiming ``claim``, send a frame for the victim's
    transfer; True when the acceptor then closed the link."""
    with socket.create_connection(host_port(address), timeout=10) as sock:
        prove_hello(sock, secret, claim[0], claim[1], tcp_wire.MAGIC, tcp_wire.VERSION)
        tid = b"victim"
        try:
            sock.sendall(tcp_wire.FRAME.pack(0, 1024, len(tid)) + tid + b"\xee" * 1024)
        except OSError:
            return True
        try:
            while sock.recv(4096):
                pass
        except ConnectionResetError:
            pass
        return True


@pytest.mark.parametrize(
    ("claim", "why"),
    [(("p-restarted", "d-epoch"), "does not know"), (("p-epoch", "d-old"), "meant for epoch")],
)
def test_a_forged_tcp_hello_is_refused_and_the_victims_transfer_is_untouched(
    tcp_pair: tuple[TcpPlane, Agent, TcpPlane, HealthBoard], claim: tuple[str, str], why: str
) -> None:
    receiver, agent, sender, board = tcp_pair
    dest = torch.zeros(1024, dtype=torch.uint8)
    receiver.post_recv(PeerRef("tcp://p:1", "p-epoch", ""), [RecvItem("victim", 0, 1024, dest)])
    assert _forge(receiver.address, claim, SECRET)  # with the secret: the MAC holds, the binding does not
    wait_for(lambda: agent.protocol_errors, 10, "the refusal reported")
    assert why in agent.protocol_errors[0] and "refused" in agent.protocol_errors[0]
    assert board.limit_hits()[admission.LINK_REFUSED] == 1
    wait_for(lambda: receiver.admission.held() == 0 and not receiver.readers, 10, "the link closed")
    assert not agent.received and not agent.peer_failed and bool((dest == 0).all())
    # the real peer's link: accepted, and its frame lands in the posted receive
    sender.send(PeerRef("tcp://d:1", "d-epoch", receiver.address),
                [SendItem("victim", 0, torch.full((1024,), 7, dtype=torch.uint8))])
    wait_for(lambda: agent.received, 10, "the real peer's layer")
    assert agent.received == [("p-epoch", "victim", 0)] and bool((dest == 7).all())
    assert board.limit_hits()[admission.LINK_REFUSED] == 1


def test_a_peer_the_control_plane_forgot_is_refused_until_heard_again(
    tcp_pair: tuple[TcpPlane, Agent, TcpPlane, HealthBoard],
) -> None:
    receiver, agent, sender, board = tcp_pair
    agent.known.clear()  # restarted since, or forgotten (max_peers)
    sender.send(PeerRef("tcp://d:1", "d-epoch", receiver.address),
                [SendItem("t", 0, torch.ones(8, dtype=torch.uint8))])
    wait_for(lambda: board.limit_hits()[admission.LINK_REFUSED] == 1, 10, "the link refused")
    assert not agent.received


def test_a_forged_shm_hello_is_refused() -> None:
    board = HealthBoard()
    plane = ShmPlane(TransferConfig(transport=Transport.SHM, links=LINKS, secret=SECRET), "d-epoch", board)
    agent = Agent({"p-epoch": "tcp://p:1"})
    plane.start(agent)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(10)
            sock.connect(abstract_name(plane.address))
            prove_hello(sock, SECRET, "p-restarted", "d-epoch", shm_wire.MAGIC, shm_wire.VERSION)
            assert sock.recv(4096) == b""  # closed: no ring, no grant table, no regions sent
        wait_for(lambda: agent.protocol_errors, 10, "the refusal reported")
        assert "does not know" in agent.protocol_errors[0]
        assert board.limit_hits()[admission.LINK_REFUSED] == 1
        wait_for(lambda: plane.admission.held() == 0 and not plane.readers, 10, "the link closed")
    finally:
        plane.close()


@pytest.mark.parametrize("transport", [Transport.TCP, Transport.SHM])
def test_frames_from_another_authenticated_peer_leave_the_victims_receive(transport: Transport) -> None:
    """Q (an epoch the control plane holds, with the secret) writes the layer P's transfer posted: it
    is discarded and reported, P's receive stays posted, and P's own layer then lands in it."""
    config = TransferConfig(transport=transport, links=LINKS, secret=SECRET)
    kind = TcpPlane if transport is Transport.TCP else ShmPlane
    agent = Agent({"p-epoch": "tcp://p:1", "q-epoch": "tcp://q:1"})
    receiver = kind(config, "d-epoch", HealthBoard())
    p, q = kind(config, "p-epoch", HealthBoard()), kind(config, "q-epoch", HealthBoard())
    receiver.start(agent)
    for sender in (p, q):
        sender.start(Agent({"d-epoch": "tcp://d:1"}))
    try:
        dest = torch.zeros(1024, dtype=torch.uint8)
        receiver.post_recv(PeerRef("tcp://p:1", "p-epoch", ""), [RecvItem("victim", 0, 1024, dest)])
        d = PeerRef("tcp://d:1", "d-epoch", receiver.address)
        q.send(d, [SendItem("victim", 0, torch.full((1024,), 9, dtype=torch.uint8))])
        wait_for(lambda: any("not its sender" in e for e in agent.protocol_errors), 10, "Q's frame reported")
        assert not agent.received and bool((dest == 0).all())
        p.send(d, [SendItem("victim", 0, torch.full((1024,), 7, dtype=torch.uint8))])
        wait_for(lambda: agent.received, 10, "P's layer")
        assert agent.received == [("p-epoch", "victim", 0)] and bool((dest == 7).all())
    finally:
        for plane in (p, q, receiver):
            plane.close()
