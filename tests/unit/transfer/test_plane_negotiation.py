"""Per-peer plane negotiation: the pure choice, forced transports between real in-process agents,
and the shared-memory plane's span/ring arithmetic."""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Sequence

import msgspec
import numpy as np
import pytest
import torch

from kvwire.errors import ConfigError
from kvwire.transfer import LayerSpec, TransferAgent, TransferConfig
from kvwire.transfer.enums import Backend, Transport
from kvwire.transfer.memory import PeerRef, RecvItem, SendItem
from kvwire.transfer.planes.base import (
    DataPlane,
    Envelope,
    Hello,
    PlaneCallbacks,
    PlaneSet,
    choose,
    host_identity,
)
from kvwire.transfer.planes.factory import held_backends
from kvwire.transfer.planes.shm.send import SpanCursor, coalesce, next_slot
from support.plane_callbacks import RecordingCallbacks
from support.waiting import wait_for

BOOT, HOST, NETNS = host_identity()


def hello(iid: str, device: str = "cpu", planes: tuple[str, ...] = ("shm", "tcp"), **kw: object) -> Hello:
    fields: dict[str, object] = {"boot_id": BOOT, "hostname": HOST, "netns": NETNS, **kw}
    return Hello(
        instance_id=iid,
        device=device,
        planes={p: f"{p}-addr" for p in planes},
        **fields,  # type: ignore[arg-type]
    )


OTHER_HOST = {"boot_id": "another-boot", "hostname": "other"}
CUDA = ("ipc", "nccl")  # what a CUDA agent holds under auto


@pytest.mark.parametrize(
    ("a", "b", "want"),
    [
        (hello("a"), hello("b"), Backend.SHM),  # CPU, one host
        (hello("a"), hello("b", **OTHER_HOST), Backend.TCP),  # CPU, two hosts
        (hello("a"), hello("b", netns=NETNS + 1), Backend.TCP),  # one host, other network namespace
        (hello("a", "cuda", CUDA, gpu_uuid="GPU-0"), hello("b", "cuda", CUDA, gpu_uuid="GPU-0"), Backend.IPC),
        (  # two GPUs of one host that reach each other (NVLink, or PCIe peer access)
            hello("a", "cuda", CUDA, gpu_uuid="GPU-0", peer_gpus=["GPU-1"]),
            hello("b", "cuda", CUDA, gpu_uuid="GPU-1", peer_gpus=["GPU-0"]),
            Backend.IPC,
        ),
        (  # two GPUs without peer access: IPC cannot map the other's memory
            hello("a", "cuda", CUDA, gpu_uuid="GPU-0"),
            hello("b", "cuda", CUDA, gpu_uuid="GPU-1"),
            Backend.NCCL,
        ),
        (
            hello("a", "cuda", CUDA, gpu_uuid="GPU-0"),
            hello("b", "cuda", CUDA, gpu_uuid="GPU-0", **OTHER_HOST),
            Backend.NCCL,
        ),
        (hello("a", "cuda", ("nccl",)), hello("b", "cuda", ("ipc", "nccl")), Backend.NCCL),  # not held by a
        (hello("a"), hello("b", forced="tcp", planes=("tcp",)), Backend.TCP),  # one end forces
        (hello("a", "cuda", ("tcp",)), hello("b", "cpu", ("shm", "tcp")), Backend.TCP),  # mixed devices
    ],
)
def test_choice_prefers_same_host_planes_and_is_symmetric(a: Hello, b: Hello, want: Backend) -> None:
    assert choose(a, b).backend is want
    assert choose(b, a).backend is want


@pytest.mark.parametrize(
    ("a", "b", "why"),
    [
        (hello("a", forced="shm"), hello("b", **OTHER_HOST), "not on the same host"),
        (
            hello("a", forced="shm", planes=("shm",)),
            hello("b", forced="tcp", planes=("tcp",)),
            "forced on the two ends",
        ),
        (hello("a", forced="shm", planes=("shm",)), hello("b", planes=("tcp",)), "not held by both ends"),
    ],
)
def test_forced_transport_the_pair_cannot_use_names_both_ends(a: Hello, b: Hello, why: str) -> None:
    for x, y in ((a, b), (b, a)):
        choice = choose(x, y)
        assert choice.backend is None and why in choice.error
        assert "instance a" in choice.error and "instance b" in choice.error


def test_every_pair_of_cpu_configurations_agrees() -> None:
    """Whatever two CPU agents hold and force, both ends reach the same verdict."""
    options = [("shm", "tcp"), ("tcp",), ("shm",)]
    for (pa, fa), (pb, fb) in itertools.product(itertools.product(options, ["", "shm", "tcp"]), repeat=2):
        a, b = hello("a", planes=pa, forced=fa), hello("b", planes=pb, forced=fb)
        assert choose(a, b) == choose(b, a) or choose(a, b).backend is None is choose(b, a).backend


def test_held_planes_follow_transport_and_device() -> None:
    assert held_backends(TransferConfig()) == [Backend.SHM, Backend.TCP]
    assert held_backends(TransferConfig(device="cuda:0", backend=Backend.NCCL)) == [Backend.IPC, Backend.NCCL]
    assert held_backends(TransferConfig(transport="tcp")) == [Backend.TCP]
    assert held_backends(TransferConfig(transport="shm")) == [Backend.SHM]
    for bad in (
        {"transport": "shm", "device": "cuda"},
        {"transport": "nccl"},
        {"transport": "ipc"},
        {"transport": "x"},
    ):
        with pytest.raises(ConfigError):
            TransferConfig(**bad)  # type: ignore[arg-type]


def _poll_failed(agent: TransferAgent, tid: str, timeout_s: float = 10.0) -> str:
    deadline = time.monotonic() + timeout_s
    while True:
        failed = agent.poll().failed
        if tid in failed:
            return failed[tid]
        assert time.monotonic() < deadline, f"{tid} did not fail"
        time.sleep(0.002)


def test_forced_transports_that_disagree_fail_the_first_transfer_on_both_ends() -> None:
    layer = torch.arange(12, dtype=torch.float32)
    with (
        TransferAgent(TransferConfig(transport="shm")) as a,
        TransferAgent(TransferConfig(transport="tcp")) as b,
    ):
        b.expect("x", num_layers=1)
        a.start_send("x", b.endpoint, [LayerSpec.of(layer)])
        a.send_layer("x", 0, layer)
        for agent in (a, b):
            # its own verdict, or the peer's abort carrying it (whichever comes first)
            reason = _poll_failed(agent, "x").removeprefix("peer_aborted: ")
            assert reason.startswith("transport:") and "shm and tcp are forced" in reason
            assert a.instance_id[:8] in reason and b.instance_id[:8] in reason
        assert sum(agent.stats().failed.get("transport", 0) for agent in (a, b)) >= 1
        assert a.peer_transports() == {b.endpoint: "none"}


def test_auto_meets_forced_tcp_and_reports_the_plane() -> None:
    layer = torch.arange(12, dtype=torch.float32)
    with TransferAgent(TransferConfig()) as a, TransferAgent(TransferConfig(transport="tcp")) as b:
        b.expect("y", num_layers=1)
        a.start_send("y", b.endpoint, [LayerSpec.of(layer)])
        a.send_layer("y", 0, layer)
        deadline = time.monotonic() + 10
        while "y" not in b.poll().finished_recving:
            assert time.monotonic() < deadline
            time.sleep(0.002)
        assert torch.equal(b.take_layers("y")[0], layer)
        assert a.peer_transports() == {b.endpoint: "tcp"} and b.peer_transports() == {a.endpoint: "tcp"}


class _Member(DataPlane):
    """A plane that records its posts and says a piece of its own to each peer."""

    def __init__(self, address: str) -> None:
        self._own = address
        self.posted: list[tuple[PeerRef, list[RecvItem]]] = []

    def start(self, callbacks: PlaneCallbacks) -> None:
        del callbacks

    @property
    def address(self) -> str:
        return self._own

    def local_info(self, peer: PeerRef) -> bytes:
        return f"piece for {peer.instance_id}".encode()

    def send(self, peer: PeerRef, items: Sequence[SendItem]) -> None:
        raise AssertionError("not sent to")

    def post_recv(self, peer: PeerRef, items: Sequence[RecvItem]) -> None:
        self.posted.append((peer, list(items)))

    def cancel(self, transfer_id: str) -> None:
        del transfer_id

    def drop_peer(self, peer_instance_id: str) -> None:
        del peer_instance_id

    def close(self) -> None:
        pass


def test_post_grant_posts_through_the_negotiated_plane_and_returns_the_grants_fields() -> None:
    """The receiver's one call per grant gives what post_recv, address and local_info gave: the set's
    address, and its envelope around the negotiated plane's piece; the post reaches that plane once,
    with the peer's address for it. A peer with no handshake gets every member's piece and its
    transfers fail (reason ``transport: ...``)."""
    members = {"a": _Member("tcp-of-a"), "b": _Member("tcp-of-b")}
    planes = {n: PlaneSet([(Backend.TCP, m)], n, "cpu", Transport.AUTO) for n, m in members.items()}
    callbacks = RecordingCallbacks()
    for plane_set in planes.values():
        plane_set.start(callbacks)
    try:
        a_ref = PeerRef("tcp://a", "a", planes["a"].address)
        items = [RecvItem("t", 0, 8, torch.zeros(8, dtype=torch.uint8))]
        address, info = planes["b"].post_grant(a_ref, items)  # no hello from "a" yet
        assert address == planes["b"].address == "tcp=tcp-of-b"
        assert msgspec.msgpack.decode(info, type=Envelope).inner == {"tcp": b"piece for a"}
        assert not members["b"].posted
        wait_for(lambda: [t for t, _ in callbacks.transfer_failed] == ["t"], 10, "unrouted transfer failed")
        assert callbacks.transfer_failed[0][1].startswith("transport: no plane handshake")

        planes["b"].on_peer_info(a_ref, planes["a"].local_info(PeerRef("tcp://b", "b", "")))
        address, info = planes["b"].post_grant(a_ref, items)
        envelope = msgspec.msgpack.decode(info, type=Envelope)
        assert address == "tcp=tcp-of-b" and envelope.hello.instance_id == "b"
        assert envelope.inner == {"tcp": b"piece for a"}
        assert info == planes["b"].local_info(a_ref)  # what the two calls say
        [(peer, posted)] = members["b"].posted
        assert (peer.instance_id, peer.data_address, posted) == ("a", "tcp-of-a", items)
        assert members["b"].post_grant(peer, items) == ("tcp-of-b", b"piece for a")  # the default
    finally:
        for plane_set in planes.values():
            plane_set.close()


@pytest.mark.parametrize("seed", range(5))
def test_span_cursor_round_trips_through_a_ring_in_chunks(seed: int) -> None:
    rng = random.Random(seed)
    src = np.frombuffer(rng.randbytes(4096), dtype=np.uint8).copy()
    spans = [(rng.randrange(0, 4000), rng.randrange(0, 96)) for _ in range(rng.randrange(1, 40))]
    want = np.concatenate([src[o : o + n] for o, n in spans])
    dst = np.zeros(8192, dtype=np.uint8)
    out_spans = [(i * 100, n) for i, (_, n) in enumerate(spans)]  # other places, same lengths
    gather, scatter = SpanCursor(src, spans), SpanCursor(dst, out_spans)
    ring, head = np.zeros(256, dtype=np.uint8), 0
    while gather.remaining():
        n = min(rng.randrange(1, 128), gather.remaining())
        pos = next_slot(head, n, ring.size)
        gather.gather(ring, pos % ring.size, n)
        scatter.scatter(ring, pos % ring.size, n)
        head = pos + n
    assert scatter.remaining() == 0
    assert np.array_equal(np.concatenate([dst[o : o + n] for o, n in out_spans]), want)
    with pytest.raises(ValueError):
        gather.gather(ring, 0, 1)


def test_coalesce_and_ring_slots() -> None:
    assert coalesce([(0, 4), (4, 4), (10, 0), (12, 2), (14, 1), (0, 1)]) == [(0, 8), (12, 3), (0, 1)]
    assert next_slot(0, 10, 16) == 0
    assert next_slot(10, 6, 16) == 10  # fits exactly before the end
    assert next_slot(10, 7, 16) == 16  # skips the 6 bytes left: a chunk never wraps
    assert next_slot(35, 4, 16) == 35


def test_shm_link_survives_many_tiny_layers() -> None:
    """Thousands of tiny chunks on one link (each returns a credit) keep flowing."""
    layers = [torch.full((3,), float(i)) for i in range(64)]
    with TransferAgent(TransferConfig()) as a, TransferAgent(TransferConfig()) as b:
        for round_ in range(40):  # 2,560 chunks of 12 bytes: 20 KiB of credits
            tid = f"tiny-{round_}"
            b.expect(tid, num_layers=len(layers))
            a.start_send(tid, b.endpoint, [LayerSpec.of(t) for t in layers])
            for i, t in enumerate(layers):
                a.send_layer(tid, i, t)
            deadline = time.monotonic() + 10
            while tid not in b.poll().finished_recving:
                assert time.monotonic() < deadline, f"{tid} stuck"
                time.sleep(0.001)
            assert torch.equal(b.take_layers(tid)[63], layers[63])
        assert a.peer_transports() == {b.endpoint: "shm"}
