"""Data-plane listeners and links under pressure (decision 115): connection caps per listener and per
peer, the handshake deadline, EMFILE back-off, heartbeats of a TCP link, supervised acceptors and
reporters, and the flags and config keys that set the caps."""

from __future__ import annotations

import argparse
import errno
import select
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest

from kvwire.errors import ConfigError
from kvwire.integrations.vllm_config import VllmTransferView, plugin_config_from_vllm
from kvwire.server.cli import add_arguments, server_config_from_args
from kvwire.supervision import HealthBoard, SupervisionCollector
from kvwire.transfer.agent import TransferAgent
from kvwire.transfer.config import TransferConfig
from kvwire.transfer.enums import Backend, Transport
from kvwire.transfer.memory import PeerRef, RecvItem, SendItem
from kvwire.transfer.planes.base import PlaneSet
from kvwire.transfer.planes.common import admission
from kvwire.transfer.planes.common.admission import Admission, accept_loop
from kvwire.transfer.planes.common.hello import HELLO, NONCE_BYTES, prove_hello
from kvwire.transfer.planes.common.link_config import DataLinkConfig
from kvwire.transfer.planes.common.wire import abstract_name
from kvwire.transfer.planes.shm.plane import ShmPlane
from kvwire.transfer.planes.tcp.plane import TcpPlane
from kvwire.transfer.planes.tcp.wire import FRAME, MAGIC, PING_FRAME, VERSION, host_port
from support.plane_callbacks import RecordingCallbacks as Callbacks
from support.waiting import wait_for

# short deadlines, with room for a loaded box: a link is cut after 8 missed heartbeats
LINKS = DataLinkConfig(max_connections=4, max_connections_per_peer=2, handshake_timeout_s=0.5,
                       keepalive_s=0.25, link_timeout_s=2.0)


@pytest.fixture
def board() -> HealthBoard:
    return HealthBoard()


@pytest.fixture
def tcp(board: HealthBoard) -> Iterator[tuple[TcpPlane, Callbacks]]:
    plane = TcpPlane(TransferConfig(transport=Transport.TCP, links=LINKS), "receiver", board)
    callbacks = Callbacks()
    plane.start(callbacks)
    try:
        yield plane, callbacks
    finally:
        plane.close()


def hits(board: HealthBoard) -> dict[str, int]:
    """The limits hit at least once (every data-plane limit is on the board from the start, at 0)."""
    return {name: count for name, count in board.limit_hits().items() if count}


def _readable(sock: socket.socket) -> bool:
    return bool(select.select([sock], [], [], 0)[0])


def dial(address: str, source: str = "127.0.0.1") -> socket.socket:
    sock = socket.create_connection(host_port(address), timeout=10, source_address=(source, 0))
    return sock


def refused(sock: socket.socket) -> bool:
    """True when the listener closed ``sock`` without a nonce (a refusal), False when it sent one."""
    try:
        return sock.recv(NONCE_BYTES) == b""
    except ConnectionResetError:
        return True


def test_defaults_and_validation() -> None:
    links = TransferConfig().links
    assert (links.max_connections, links.max_connections_per_peer) == (256, 32)
    assert links.keepalive_probes * links.keepalive_s >= links.link_timeout_s
    for bad in ({"max_connections": 0}, {"max_connections_per_peer": 0},
                {"handshake_timeout_s": float("inf")}, {"keepalive_s": -1.0},
                {"keepalive_s": 2.0, "link_timeout_s": 3.0}):
        with pytest.raises(ConfigError):
            DataLinkConfig(**bad)  # type: ignore[arg-type]


def test_serve_flags_and_plugin_keys_set_the_caps() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--kv-data-max-connections", "64", "--kv-data-max-connections-per-peer", "8",
                              "--kv-data-handshake-timeout-s", "2", "--kv-data-keepalive-s", "1",
                              "--kv-data-link-timeout-s", "9", "--kv-data-max-granted-dests-per-peer", "100",
                              "--kv-data-max-granted-dests", "300"])
    assert server_config_from_args(args).transfer.links == DataLinkConfig(64, 8, 2.0, 1.0, 9.0, 100, 300)
    assert server_config_from_args(parser.parse_args([])).transfer.links == DataLinkConfig()
    view = VllmTransferView(kv_role="kv_producer", kv_connector_extra_config={
        "data_max_connections": 16, "data_link_timeout_s": "20", "data_max_granted_dests": 500})
    links = plugin_config_from_vllm(view).transfer.links
    assert links == DataLinkConfig(max_connections=16, link_timeout_s=20.0, max_granted_dests=500)
    with pytest.raises(ConfigError):
        plugin_config_from_vllm(VllmTransferView(kv_role="kv_producer", kv_connector_extra_config={
            "data_max_connections_per_peer": 0}))


def test_tcp_listener_caps_per_peer_and_in_total(tcp: tuple[TcpPlane, Callbacks], board: HealthBoard) -> None:
    plane, _ = tcp
    held = [dial(plane.address), dial(plane.address)]
    third = dial(plane.address)  # a third from 127.0.0.1: over the per-peer cap of 2
    assert refused(third)
    assert not any(refused(s) for s in held)  # the first two got their nonce
    assert hits(board) == {admission.PEER_FULL: 1}
    held += [dial(plane.address, "127.0.0.2"), dial(plane.address, "127.0.0.3")]  # 4: the listener is full
    assert not any(refused(s) for s in held[2:])
    assert refused(dial(plane.address, "127.0.0.4"))
    assert board.limit_hits()[admission.LISTENER_FULL] == 1
    for sock in held:
        sock.close()
    wait_for(lambda: plane.admission.held() == 0, 10, "the closed connections released")
    wait_for(lambda: not plane.readers, 10, "their reader threads gone")
    assert not refused(dial(plane.address))  # room again
    registry = CollectorRegistry()
    registry.register(SupervisionCollector(board))
    text = generate_latest(registry).decode()
    assert 'kvwire_limit_hits_total{limit="data_peer_full"} 1.0' in text
    assert 'kvwire_limit_hits_total{limit="data_listener_full"} 1.0' in text
    assert 'kvwire_limit_hits_total{limit="data_link_timeout"} 0.0' in text  # named before a hit


def test_handshake_deadline_cuts_a_slow_hello(tcp: tuple[TcpPlane, Callbacks], board: HealthBoard) -> None:
    plane, callbacks = tcp
    sock = dial(plane.address)
    assert len(sock.recv(NONCE_BYTES)) == NONCE_BYTES
    start = time.monotonic()
    # a valid hello header announcing two 50-byte ids, then the ids a byte every 0.1 s: every read
    # succeeds well within a per-read timeout; only the deadline on the whole hello ends it
    for byte in HELLO.pack(MAGIC, VERSION, 50, 50) + b"x" * 100:
        if _readable(sock):  # EOF (or a reset): the listener cut it
            break
        try:
            sock.sendall(bytes([byte]))
        except OSError:
            break
        time.sleep(0.1)  # the trickle's pace, not a wait for something
    else:
        pytest.fail("the listener kept a connection that trickled its hello for 10 s")
    assert time.monotonic() - start < 30  # a bound, not a speed goal: it did not wait for ever
    wait_for(lambda: board.limit_hits().get(admission.HANDSHAKE_TIMEOUT) == 1, 10, "the cut counted")
    wait_for(lambda: plane.admission.held() == 0 and not plane.readers, 10, "reader and slot freed")
    assert any("handshake" in e for e in callbacks.protocol_errors)


def test_a_connection_without_a_reader_thread_is_closed_and_released(
    tcp: tuple[TcpPlane, Callbacks], board: HealthBoard, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The process cannot start another thread: the accepted connection is closed and released (no
    slot, no socket kept), counted, and the acceptor goes on."""
    plane, _ = tcp

    class NoReader(threading.Thread):
        def start(self) -> None:
            if self.name == "kvwire-tcp-recv":
                raise RuntimeError("can't start new thread")
            super().start()

    monkeypatch.setattr(threading, "Thread", NoReader)
    assert refused(dial(plane.address))
    wait_for(lambda: hits(board) == {admission.NO_THREAD: 1}, 10, "the refusal counted")
    assert plane.admission.held() == 0 and not plane.inbound and not plane.readers
    monkeypatch.undo()
    assert not refused(dial(plane.address))  # the acceptor is fine


def test_accept_backs_off_when_descriptors_run_out(board: HealthBoard) -> None:
    """EMFILE on every accept: the loop waits, doubling, instead of spinning."""

    class Exhausted:
        calls: list[float] = []

        def accept(self) -> tuple[socket.socket, object]:
            self.calls.append(time.monotonic())
            if len(self.calls) >= 5:
                closing.set()
            raise OSError(errno.EMFILE, "Too many open files")

    closing = threading.Event()
    listener = Exhausted()
    gate = Admission("tcp", LINKS, board)
    thread = threading.Thread(target=accept_loop, args=(listener, gate, closing, admission.tcp_peer, print))
    thread.start()
    thread.join(30)
    assert not thread.is_alive()
    gaps = [b - a for a, b in zip(listener.calls, listener.calls[1:], strict=False)]
    assert len(gaps) == 4
    assert all(gap >= want * 0.9 for gap, want in zip(gaps, (0.05, 0.1, 0.2, 0.4), strict=True)), gaps
    assert board.limit_hits()[admission.FD_EXHAUSTED] == 4  # the fifth failed while closing: not counted


def test_an_acceptor_that_keeps_failing_is_dead_on_the_board(
    tcp: tuple[TcpPlane, Callbacks], board: HealthBoard
) -> None:
    plane, _ = tcp
    assert plane._listener is not None
    plane._listener.close()  # accept now fails with EBADF: not transient, not descriptors running out
    wait_for(lambda: [s.name for s in board.dead()] == ["kvwire-tcp-accept"], 30, "the acceptor dead")
    assert board.restarts()["kvwire-tcp-accept"] >= 1
    body = board.health_body()
    assert body is not None and "kvwire-tcp-accept" in str(body["reason"])


def _pair(board: HealthBoard, receiver_cb: Callbacks) -> tuple[TcpPlane, TcpPlane, Callbacks]:
    sender_cb = Callbacks()
    receiver = TcpPlane(TransferConfig(transport=Transport.TCP, links=LINKS), "receiver", board)
    sender = TcpPlane(TransferConfig(transport=Transport.TCP, links=LINKS), "sender", board)
    receiver.start(receiver_cb)
    sender.start(sender_cb)
    return sender, receiver, sender_cb


def _send_layer(sender: TcpPlane, receiver: TcpPlane, tid: str, value: int) -> torch.Tensor:
    dest = torch.zeros(1024, dtype=torch.uint8)
    receiver.post_recv(PeerRef("tcp://s", "sender", ""), [RecvItem(tid, 0, 1024, dest)])
    src = torch.full((1024,), value, dtype=torch.uint8)
    sender.send(PeerRef("tcp://r", "receiver", receiver.address), [SendItem(tid, 0, src)])
    return dest


def test_reporter_restarts_after_a_sink_raises(board: HealthBoard) -> None:
    receiver_cb = Callbacks(fail_first=1)
    sender, receiver, _ = _pair(board, receiver_cb)
    try:
        _send_layer(sender, receiver, "t-1", 1)  # its report raises: the reporter restarts
        wait_for(lambda: board.restarts().get("kvwire-tcp-deliver") == 1, 10, "the reporter restarted")
        dest = _send_layer(sender, receiver, "t-2", 2)
        wait_for(lambda: ("t-2", 0) in receiver_cb.received, 10, "the next layer reported")
        assert bool((dest == 2).all())
        assert not board.dead()
    finally:
        sender.close()
        receiver.close()
    assert not board.snapshot()  # closed on purpose: nothing left on the board


def test_a_reporter_that_keeps_failing_ends_its_link(board: HealthBoard) -> None:
    """A sink that always raises: the reporter restarts, then gives up (dead); its link is cut (the
    peer's transfers fail instead of waiting for reports that never come) and, with the link gone,
    the reporter leaves the board."""
    receiver_cb = Callbacks(fail_first=1000)
    sender, receiver, _ = _pair(board, receiver_cb)
    try:
        receiver.post_recv(PeerRef("tcp://s", "sender", ""),
                           [RecvItem("t-x", i, 16, torch.zeros(16, dtype=torch.uint8)) for i in range(8)])
        sender.send(PeerRef("tcp://r", "receiver", receiver.address),
                    [SendItem("t-x", i, torch.ones(16, dtype=torch.uint8)) for i in range(8)])
        wait_for(lambda: receiver_cb.peer_failed, 30, "the link of the dead reporter cut")
        assert receiver_cb.peer_failed[0][0] == "sender"
        assert board.restarts()["kvwire-tcp-deliver"] == 5  # RestartPolicy's max_restarts, then dead
        wait_for(lambda: "kvwire-tcp-deliver" not in [c.name for c in board.snapshot()], 10, "off the board")
    finally:
        sender.close()
        receiver.close()


def test_an_idle_link_stays_up_on_heartbeats(board: HealthBoard) -> None:
    """Idle for several link timeouts, a link is kept alive by heartbeats both ways."""
    receiver_cb = Callbacks()
    sender, receiver, sender_cb = _pair(board, receiver_cb)
    try:
        _send_layer(sender, receiver, "t-1", 1)
        wait_for(lambda: ("t-1", 0) in receiver_cb.received, 10, "the first layer")
        (link,) = sender.outbound.values()
        deadline = time.monotonic() + 3 * LINKS.link_timeout_s
        wait_for(lambda: time.monotonic() > deadline, 10, "three link timeouts of idleness")
        assert sender.outbound.get("receiver") is link and not link.dead
        assert not sender_cb.peer_failed and not receiver_cb.peer_failed
        _send_layer(sender, receiver, "t-2", 2)
        wait_for(lambda: ("t-2", 0) in receiver_cb.received, 10, "a layer on the same link")
    finally:
        sender.close()
        receiver.close()


def test_a_silent_sender_is_cut_by_the_receiver(tcp: tuple[TcpPlane, Callbacks], board: HealthBoard) -> None:
    """An authenticated sender that goes quiet (no frame, no heartbeat): the reader cuts the link
    after ``link_timeout_s``, fails the peer and frees its thread and socket."""
    plane, callbacks = tcp
    sock = dial(plane.address)
    sock.settimeout(10)
    prove_hello(sock, None, "quiet", "receiver", MAGIC, VERSION)
    sock.sendall(PING_FRAME)  # one heartbeat, then silence
    wait_for(lambda: callbacks.peer_failed, 20, "the silent link cut")
    (peer, reason), = callbacks.peer_failed
    assert peer == "quiet" and "nothing heard" in reason
    wait_for(lambda: plane.admission.held() == 0 and not plane.readers, 10, "reader and slot freed")
    assert board.limit_hits()["data_link_timeout"] == 1
    data = b""
    while chunk := sock.recv(64):  # the receiver's heartbeats, then EOF
        data += chunk
    assert data and set(data) == {0}
    sock.close()


def test_a_frame_slower_than_the_link_timeout_is_not_cut(tcp: tuple[TcpPlane, Callbacks]) -> None:
    """A frame that streams in for twice ``link_timeout_s`` (a slow link that keeps moving): the
    receiver keeps the link, sends its heartbeats during the frame (not only between frames: a
    writer that has handed its last bytes to the kernel is idle and checks for them), and lands it."""
    plane, callbacks = tcp
    dest = torch.zeros(128, dtype=torch.uint8)
    plane.post_recv(PeerRef("tcp://s", "slow", ""), [RecvItem("t-slow", 0, 128, dest)])
    sock = dial(plane.address)
    sock.settimeout(10)
    prove_hello(sock, None, "slow", "receiver", MAGIC, VERSION)
    sock.sendall(FRAME.pack(0, 128, len(b"t-slow")) + b"t-slow")
    heard_during: list[float] = []
    start = time.monotonic()
    for _ in range(64):  # 128 bytes, 2 every 0.08 s: 5 s or more for a link timeout of 2 s
        sock.sendall(b"\x07\x07")
        while _readable(sock):
            chunk = sock.recv(64)
            assert chunk, "the receiver cut a link that was moving"
            heard_during.append(time.monotonic() - start)
        time.sleep(0.08)  # the slow link's pace, not a wait for something
    wait_for(lambda: ("t-slow", 0) in callbacks.received, 10, "the slow layer landed")
    assert bool((dest == 7).all()) and not callbacks.peer_failed
    assert len(heard_during) >= 2, heard_during  # keepalive 0.25 s over 5 s of one frame
    sock.close()


def test_plane_set_fail_loop_survives_a_callback_that_raises(board: HealthBoard) -> None:
    """Transfers to a peer with no plane handshake fail from the set's own (supervised) thread; a
    callback that raises is logged and counted, and the next failure is still delivered."""

    class Failing(Callbacks):
        def __init__(self) -> None:
            super().__init__()
            self.failed: list[str] = []

        def on_transfer_failed(self, transfer_id: str, reason: str) -> None:
            self.failed.append(transfer_id)
            if len(self.failed) == 1:
                raise RuntimeError("a callback that raises")

    member = TcpPlane(TransferConfig(transport=Transport.TCP, links=LINKS), "me", board)
    planes = PlaneSet([(Backend.TCP, member)], "me", "cpu", Transport.TCP, board)
    callbacks = Failing()
    planes.start(callbacks)
    try:
        unknown = PeerRef("tcp://nowhere", "stranger", "")
        src = torch.zeros(4, dtype=torch.uint8)
        planes.send(unknown, [SendItem("t-1", 0, src)])
        planes.send(unknown, [SendItem("t-2", 0, src)])
        wait_for(lambda: callbacks.failed == ["t-1", "t-2"], 10, "both failures delivered")
        assert board.worker_errors() == {"kvwire-planes-fail": 1}
        assert "kvwire-planes-fail" in [c.name for c in board.snapshot()] and not board.dead()
    finally:
        planes.close()
    assert not board.snapshot()  # every supervised thread of the set stopped and left the board


def test_the_agents_board_reaches_every_plane(board: HealthBoard) -> None:
    """The process's board, given to the agent, lists the planes' supervised threads (and their limit
    hits land on it); closing the agent takes them off."""
    planes = {"kvwire-shm-accept", "kvwire-tcp-accept", "kvwire-planes-fail"}
    with TransferAgent(TransferConfig(links=LINKS), board=board) as agent:
        names = {c.name for c in board.snapshot()}
        assert planes <= names, names
        tcp_address = dict(p.split("=", 1) for p in agent.data_address.split(","))["tcp"]
        held = [dial(tcp_address) for _ in range(3)]
        assert refused(held[-1])
        assert board.limit_hits().get(admission.PEER_FULL) == 1
        for sock in held:
            sock.close()
    assert not {c.name for c in board.snapshot()} & planes


def test_serve_hands_the_links_and_board_to_the_planes() -> None:
    """``kvwire serve``'s config reaches the planes: the agent's TransferConfig carries the links,
    and the instance's board (exported on its /metrics) names every data-plane limit and acceptor."""
    from kvwire.engine.config import EngineConfig
    from kvwire.protocol.kv_params import Role
    from kvwire.server.config import ServerConfig
    from kvwire.server.connectors import build_connector_set

    config = ServerConfig(role=Role.PREFILL, transfer=TransferConfig(links=LINKS))
    board, registry = HealthBoard(), CollectorRegistry()
    registry.register(SupervisionCollector(board))
    connectors = build_connector_set(config, EngineConfig(model="tiny"), registry, board=board)
    try:
        assert connectors.worker.agent.config.links == LINKS
        assert registry.get_sample_value("kvwire_component_up", {"component": "kvwire-tcp-accept"}) == 1
        for limit in (*admission.LIMITS, "data_link_timeout"):
            assert registry.get_sample_value("kvwire_limit_hits_total", {"limit": limit}) == 0, limit
    finally:
        connectors.close()
    assert board.snapshot() == []


def test_unix_listener_caps_per_peer_process(board: HealthBoard) -> None:
    plane = ShmPlane(TransferConfig(transport=Transport.SHM, links=LINKS), "receiver", board)
    plane.start(Callbacks())
    held: list[socket.socket] = []
    try:
        for _ in range(3):  # all from this process: the third is over the per-peer cap
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(10)
            sock.connect(abstract_name(plane.address))
            held.append(sock)
        assert [refused(s) for s in held] == [False, False, True]
        assert hits(board) == {admission.PEER_FULL: 1}
        wait_for(lambda: board.limit_hits().get(admission.HANDSHAKE_TIMEOUT) == 2, 10, "hellos cut")
        wait_for(lambda: plane.admission.held() == 0 and not plane.readers, 10, "readers freed")
    finally:
        for sock in held:
            sock.close()
        plane.close()


@pytest.mark.parametrize("address", ["no-port", "127.0.0.1:99999", ":5", "127.0.0.1:x"])
def test_a_data_address_that_is_not_host_port_fails_the_link_clearly(
    tcp: tuple[TcpPlane, Callbacks], board: HealthBoard, address: str,
) -> None:
    """The peer's data address comes from its plane_info. One that is not host:port raised ValueError
    or OverflowError in the writer thread (logged as a thread error, the queue failed as a vague
    "link closed"): now the link fails with the reason, and no thread error is counted."""
    plane, callbacks = tcp
    plane.send(PeerRef("tcp://127.0.0.1:9", "sender-peer", address), [SendItem("t", 0, torch.zeros(8))])
    wait_for(lambda: callbacks.peer_failed, 10, "the link to fail")
    assert "is not a host:port data address" in callbacks.peer_failed[0][1]
    assert board.worker_errors() == {}
