"""The CUDA IPC plane's pure logic on CPU: run pairing, the Grant's destination messages, mapping
bookkeeping per peer epoch, and the receiver/sender tables (no CUDA needed; GPU runs: tests/gpu)."""

from __future__ import annotations

import random

import msgspec
import pytest
import torch

from kvwire.transfer.config import TransferConfig
from kvwire.transfer.enums import Backend
from kvwire.transfer.planes.factory import held_backends
from kvwire.transfer.planes.ipc.plane import IpcPlane
from kvwire.transfer.planes.ipc.runs import Dest, GrantInfo, ImportTable, pair_runs
from kvwire.transfer.types import ByteSpans, PeerRef, RecvItem


def _apply(runs: list[tuple[int, int, int]], src: bytes, size: int) -> bytes:
    out = bytearray(size)
    for s, d, n in runs:
        out[d : d + n] = src[s : s + n]
    return bytes(out)


def test_pair_runs_merges_runs_contiguous_on_both_sides() -> None:
    # blocks 2,3 -> 7,8 are one run on both sides; block 5 -> 0 is another
    assert pair_runs([(20, 10), (30, 10), (50, 10)], [(70, 10), (80, 10), (0, 10)]) == [
        (20, 70, 20),
        (50, 0, 10),
    ]
    assert pair_runs([(0, 30)], [(100, 10), (0, 20)]) == [(0, 100, 10), (10, 0, 20)]
    assert pair_runs([], []) == []
    with pytest.raises(ValueError):
        pair_runs([(0, 10)], [(0, 9)])


@pytest.mark.parametrize("seed", range(4))
def test_pair_runs_moves_the_same_bytes_as_gather_then_scatter(seed: int) -> None:
    rng = random.Random(seed)
    src = rng.randbytes(2048)
    lengths = [rng.choice([0, 4, 16, 64]) for _ in range(12)]
    src_spans = [(rng.randrange(0, 1900), n) for n in lengths]
    dst_spans = [(i * 128, n) for i, n in enumerate(rng.sample(lengths, len(lengths)))]
    gathered = b"".join(src[o : o + n] for o, n in src_spans)
    want = bytearray(2048)
    pos = 0
    for o, n in dst_spans:
        want[o : o + n] = gathered[pos : pos + n]
        pos += n
    assert _apply(pair_runs(src_spans, dst_spans), src, 2048) == bytes(want)


def test_import_table_maps_once_per_peer_epoch_and_closes_on_loss() -> None:
    opened: list[bytes] = []
    closed: list[int] = []
    table = ImportTable(lambda h: (opened.append(h), 1000 + len(opened))[1], closed.append)
    assert table.address("p1", b"a" * 64) == 1001
    assert table.address("p1", b"a" * 64) == 1001  # cached: CUDA maps an allocation once per process
    assert table.address("p1", b"b" * 64) == 1002
    assert table.address("p2", b"a" * 64) == 1003  # another epoch maps anew
    assert table.close_peer("p1") == 2 and sorted(closed) == [1001, 1002]
    table.close_all()
    assert sorted(closed) == [1001, 1002, 1003] and table.by_peer == {}


def test_grant_info_round_trips() -> None:
    info = GrantInfo([Dest("t", 3, b"h" * 64, [(0, 16), (64, 32)])])
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(info), type=GrantInfo) == info


def test_receiver_destinations_travel_with_the_next_grant_and_sender_takes_them_once() -> None:
    receiver = IpcPlane(TransferConfig(device="cuda:0", transport="ipc"), "rx")
    sender = IpcPlane(TransferConfig(device="cuda:0", transport="ipc"), "tx")
    peer_tx, peer_rx = PeerRef("tcp://tx", "tx", "@a"), PeerRef("tcp://rx", "rx", "@b")
    base = torch.zeros(64, dtype=torch.uint8)  # host memory: exported as "no handle" (the sender fails it)
    items = [
        RecvItem("t", 0, 16, base[:0], dest_spans=ByteSpans(base, ((0, 8), (32, 8)))),
        RecvItem("t", 1, 16, base[:16]),
    ]
    receiver.post_recv(peer_tx, items)
    info = receiver.local_info(peer_tx)
    assert receiver.local_info(peer_tx) == b""  # drained: each Grant carries its own layers
    sender.on_peer_info(peer_rx, info)
    dest = sender.take_dest("rx", "t", 0)
    assert dest is not None and dest.handle == b"" and sender.take_dest("rx", "t", 0) is None
    assert sender.take_dest("someone-else", "t", 1) is None  # only the granting peer's destinations
    receiver.cancel("t")
    assert not receiver.done("tx", "t", 1)


def test_ipc_is_held_only_when_forced_on_cuda() -> None:
    assert held_backends(TransferConfig(device="cuda:0", transport="ipc")) == [Backend.IPC]
    assert held_backends(TransferConfig(device="cuda:0", backend=Backend.NCCL)) == [Backend.NCCL]
