"""Liveness of the data links after the handshake (decision 115), with real peer processes.

* TCP: P and D talk through a userspace relay (tests/support/fault_relay.py) on the data plane; the
  relay turns into a blackhole that never heals while P writes a transfer larger than every buffer
  on the way. P's write makes no progress and D hears nothing: each end cuts the link after
  ``link_timeout_s``, both fail the transfer ``peer_lost`` well within its lease, and both processes
  go back to their thread and descriptor counts of before (tests/support/leaks.py). A kernel
  keepalive alone could not do it: the relay's kernel answers the probes.
* Shared memory (a Unix socket and a ring): the receiver stops (SIGSTOP) in the middle of a transfer;
  the sender gets no ring credit back, cuts the link after ``link_timeout_s`` and fails the transfer
  within its lease; its writer thread and socket are gone.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator

import pytest

from kvwire.transfer import LayerSpec, TransferAgent, TransferConfig
from kvwire.transfer.planes.common.link_config import DataLinkConfig
from support.fault_relay import FaultRelay, Mode
from support.leaks import LeakBaseline, socket_kinds
from support.transfer_helpers import DTYPES, PeerProcess, has_all, make_layer, poll_until
from support.waiting import free_port, wait_for

KEEPALIVE_S, LINK_TIMEOUT_S = 0.5, 3.0
LEASE_S = 20.0  # the transfers' deadline: the links must fail them well before it
LINK_ARGS = ("--keepalive-s", str(KEEPALIVE_S), "--link-timeout-s", str(LINK_TIMEOUT_S))
SMALL = [([2, 4, 8, 64], "float32")] * 2  # 16 KiB layers
BIG = [([2, 64, 64, 1024], "float32")] * 2  # 32 MiB layers: more than the socket buffers hold


@pytest.fixture
def relayed() -> Iterator[tuple[PeerProcess, PeerProcess, FaultRelay, int]]:
    """D listens for data on a fixed port and advertises the relay's; P dials the relay."""
    data_port = free_port()
    relay = FaultRelay("127.0.0.1", data_port)
    d = PeerProcess("--transport", "tcp", "--data-port", str(data_port),
                    "--advertise-data-port", str(relay.port), *LINK_ARGS)
    p = PeerProcess("--transport", "tcp", *LINK_ARGS)
    try:
        yield p, d, relay, data_port
    finally:
        p.kill()
        d.kill()
        relay.close()


def _transfer(p: PeerProcess, d: PeerProcess, tid: str, specs: list[tuple[list[int], str]]) -> None:
    d.call("expect", tid=tid, num_layers=len(specs), deadline_s=LEASE_S)
    p.call("send", tid=tid, peer=d.endpoint, seed=7, specs=specs, order=list(range(len(specs))),
           deadline_s=LEASE_S, timeout_s=60)


def test_tcp_blackhole_that_never_heals_fails_within_the_lease_and_frees_the_link(
    relayed: tuple[PeerProcess, PeerProcess, FaultRelay, int],
) -> None:
    p, d, relay, data_port = relayed
    _transfer(p, d, "warm", SMALL)  # the data link is up (through the relay), threads started
    assert "warm" in p.call("wait", tids=["warm"], timeout_s=30)["events"]["sent"]
    assert "warm" in d.call("wait", tids=["warm"], timeout_s=30)["events"]["recvd"]
    assert relay.connections == 1
    baseline = LeakBaseline.take({"P": p.proc.pid, "D": d.proc.pid}, {relay.port: "relay"})
    relay.set_mode(Mode.BLACKHOLE)
    start = time.monotonic()
    _transfer(p, d, "cut", BIG)
    p_events = p.call("wait", tids=["cut"], timeout_s=LEASE_S + 30)["events"]
    d_events = d.call("wait", tids=["cut"], timeout_s=LEASE_S + 30)["events"]
    elapsed_s = time.monotonic() - start
    # each end cut the link itself: peer_lost from the data link, not the lease's deadline
    assert p_events["failed"]["cut"].startswith("peer_lost"), p_events
    assert d_events["failed"]["cut"].startswith("peer_lost"), d_events
    print(f"failed after {elapsed_s:.1f} s (link timeout {LINK_TIMEOUT_S} s, lease {LEASE_S} s)")
    baseline.wait_back(30)  # P's writer and D's reader (and reporter) gone, their sockets closed
    # below the baseline, in fact: the warm link itself is gone on both ends (the relay still holds
    # its two sockets, partitioned); only D's listener is left on its data port
    assert socket_kinds(p.proc.pid, {relay.port: "relay"})["relay"] == 0
    assert socket_kinds(d.proc.pid, {data_port: "data"})["data"] == 1


def test_shm_receiver_that_stops_reading_fails_the_sender_within_the_lease() -> None:
    receiver = PeerProcess("--transport", "shm", "--budget", str(1 << 20), "--ring-bytes", str(1 << 20),
                           *LINK_ARGS)
    links = DataLinkConfig(keepalive_s=KEEPALIVE_S, link_timeout_s=LINK_TIMEOUT_S)
    # 4 MiB layers: spilled on D (1 MiB budget), so through the ring (1 MiB), so waiting for credit
    specs = [([4, 256, 1024], "float32")] * 4
    stopped = False
    try:
        with TransferAgent(TransferConfig(transport="shm", links=links)) as sender:
            receiver.call("expect", tid="stall", num_layers=len(specs), deadline_s=LEASE_S)
            layer_specs = [LayerSpec(tuple(shape), DTYPES[dt]) for shape, dt in specs]
            sender.start_send("stall", receiver.endpoint, layer_specs, deadline_s=LEASE_S)
            sender.send_layer("stall", 0, make_layer(3, 0, *specs[0]))
            wait_for(lambda: receiver.call("stats")["bytes_received"] >= 4 << 20, 30, "layer 0 arrived")
            os.kill(receiver.proc.pid, signal.SIGSTOP)
            stopped = True
            for index in range(1, len(specs)):  # more than the ring: the writer waits for credit
                sender.send_layer("stall", index, make_layer(3, index, *specs[index]))
            events = poll_until(sender, has_all("failed", ["stall"]), timeout_s=LEASE_S + 30)
            assert events["failed"]["stall"].startswith("peer_lost"), events
            assert "credit" in events["failed"]["stall"] or "timed out" in events["failed"]["stall"]
            writers = lambda: [t for t in threading.enumerate() if t.name.startswith("kvwire-shm-send")]  # noqa: E731
            wait_for(lambda: not writers(), 10, "the sender's writer thread gone")
    finally:
        if stopped:
            os.kill(receiver.proc.pid, signal.SIGCONT)
        receiver.kill()

