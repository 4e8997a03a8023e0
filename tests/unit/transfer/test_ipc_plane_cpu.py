"""The CUDA IPC plane's pure logic on CPU: run pairing, the Grant's destination messages, mapping
bookkeeping per peer epoch, and the receiver/sender tables (no CUDA needed; GPU runs: tests/gpu)."""

from __future__ import annotations

import random

import msgspec
import numpy as np
import pytest
import torch

from kvwire.transfer.config import TransferConfig
from kvwire.transfer.enums import Backend
from kvwire.transfer.memory import ByteSpans, PeerRef, RecvItem
from kvwire.transfer.planes.common.runs import pair_runs, spans_array, tile_runs
from kvwire.transfer.planes.factory import held_backends
from kvwire.transfer.planes.ipc.grants import Dest, GrantInfo, ImportTable
from kvwire.transfer.planes.ipc.plane import IpcPlane
from support.plane_callbacks import RecordingCallbacks


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


def _apply_tiles(tiles: np.ndarray, src: bytes, size: int) -> bytes:
    out = bytearray(size)
    for s, d, n in tiles.tolist():
        out[d : d + n] = src[s : s + n]
    return bytes(out)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("one_to_one", [True, False])
def test_tile_runs_move_the_same_bytes_as_gather_then_scatter(seed: int, one_to_one: bool) -> None:
    rng = random.Random(seed)
    size, block = 4096, 64
    src_blocks = rng.sample(range(size // block), 20)
    dst_blocks = rng.sample(range(size // block), 20)
    if seed % 2:  # consecutive ids on both sides: merged runs, then cut into tiles
        src_blocks, dst_blocks = list(range(3, 23)), list(range(30, 50))
    src_spans = [(b * block, block) for b in src_blocks]
    dst_spans = [(b * block, block) for b in dst_blocks]
    if not one_to_one:  # destination spans of other sizes: the general pairing
        dst_spans = [(o, n // 2) for o, n in dst_spans] + [(o + block // 2, block // 2) for o, _ in dst_spans]
        dst_spans = [span for pair in zip(dst_spans[:20], dst_spans[20:], strict=True) for span in pair]
    src = rng.randbytes(size)
    tiles = tile_runs(spans_array(src_spans), spans_array(dst_spans), tile_bytes=256)
    assert tiles.dtype == np.int64 and tiles[:, 2].max() <= 256 and tiles[:, 2].min() > 0
    assert _apply_tiles(tiles, src, size) == _apply(pair_runs(src_spans, dst_spans), src, size)
    if seed % 2:  # 20 consecutive 64-byte blocks = one 1280-byte run = 5 full tiles
        assert len(tiles) == 5


def test_tile_runs_refuse_spans_of_different_totals() -> None:
    with pytest.raises(ValueError):
        tile_runs(spans_array([(0, 64)]), spans_array([(0, 32), (64, 16)]), tile_bytes=64)
    assert len(tile_runs(spans_array([]), spans_array([]), tile_bytes=64)) == 0


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


def test_grant_info_round_trips_and_carries_each_span_set_once() -> None:
    spans = spans_array([(0, 16), (64, 32)])
    info = GrantInfo([Dest("t", 3, b"h" * 64, 128, 0), Dest("t", 4, b"h" * 64, 4096, 0)], [spans.tobytes()])
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(info), type=GrantInfo)
    assert back == info
    assert [a.tolist() for a in back.arrays()] == [[[0, 16], [64, 32]]]


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


def test_undecodable_plane_info_is_a_protocol_error_not_a_crash() -> None:
    sender = IpcPlane(TransferConfig(device="cuda:0", transport="ipc"), "tx")
    callbacks = RecordingCallbacks()
    sender.callbacks = callbacks  # start() would open the link socket
    peer = PeerRef("tcp://rx", "rx", "@b")
    bad_set = GrantInfo([Dest("t", 0, b"h" * 64, 0, 5)], [])  # names a span set it does not carry
    for info in (b"\x93garbage", msgspec.msgpack.encode(bad_set)):
        sender.on_peer_info(peer, info)
    assert len(callbacks.protocol_errors) == 2 and sender.take_dest("rx", "t", 0) is None


def test_ipc_is_the_same_host_plane_of_cuda_agents() -> None:
    assert held_backends(TransferConfig(device="cuda:0", transport="ipc")) == [Backend.IPC]
    assert held_backends(TransferConfig(device="cuda:0", backend=Backend.NCCL)) == [Backend.IPC, Backend.NCCL]
    assert Backend.IPC not in held_backends(TransferConfig(device="cpu"))


def test_the_completer_waits_for_the_gpu_with_a_deadline() -> None:
    from kvwire.transfer.planes.ipc.link import _passed

    class Event:  # a CUDA event's query(): done after ``after`` polls
        def __init__(self, after: int) -> None:
            self.polls, self.after = 0, after

        def query(self) -> bool:
            self.polls += 1
            return self.polls > self.after

    assert _passed(Event(3), timeout_s=5.0)  # type: ignore[arg-type]
    never = Event(10**9)
    assert not _passed(never, timeout_s=0.05)  # type: ignore[arg-type]
    assert never.polls > 1
