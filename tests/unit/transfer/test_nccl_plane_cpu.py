"""CPU-side logic of the NCCL data plane: framing, handshake bytes, configs, the ctypes config struct,
and the torch fallback of the one-launch paged gather/scatter (the GPU paths are in tests/gpu)."""

from __future__ import annotations

import collections
import ctypes
import itertools
import threading
import time

import msgspec
import pytest
import torch

from kvwire.errors import ConfigError, ProtocolError
from kvwire.transfer.config import TransferConfig
from kvwire.transfer.enums import Backend
from kvwire.transfer.memory import KVLayout, PeerRef, RecvItem, gather_blocks
from kvwire.transfer.planes.common import group_kernels
from kvwire.transfer.planes.nccl.bindings import (
    CommConfig,
    NcclUnavailableError,
    _Config,
    _make_config,
)
from kvwire.transfer.planes.nccl.channel import adjacent_ptr
from kvwire.transfer.planes.nccl.framing import message_ranges, plan_chunks
from kvwire.transfer.planes.nccl.plane import NcclPlane, NcclPlaneConfig
from kvwire.transfer.planes.nccl.plane_info import ChunkPlan, CommOffer, NcclInfo, decode_info, encode_info
from kvwire.transfer.planes.nccl.send import SendChannel
from support.plane_callbacks import RecordingCallbacks

MiB = 1 << 20


def _items(spec: list[tuple[str, int]]) -> list[RecvItem]:
    return [
        RecvItem(tid, i, size, torch.empty(size, dtype=torch.uint8)) for i, (tid, size) in enumerate(spec)
    ]


def test_plan_chunks_coalesces_within_a_transfer_up_to_the_bound() -> None:
    items = _items([("a", MiB // 2)] * 5 + [("b", MiB // 4)] * 2 + [("b", 3 * MiB)] + [("b", 1)])
    groups = plan_chunks(items, MiB)  # balanced: 2.5 MiB of "a" in 3 messages, not 1 + 1 + 0.5
    assert [[it.layer_index for it in g] for g in groups] == [[0], [1, 2], [3, 4], [5, 6], [7], [8]]
    assert all(len({it.transfer_id for it in g}) == 1 for g in groups)
    # every item exactly once, order kept
    assert [it.layer_index for g in groups for it in g] == list(range(9))


def _lengths(layer_mib: float, layers: int, max_mib: int = 64, edge_mib: int = 8) -> list[int]:
    sizes = [int(layer_mib * MiB)] * layers
    ranges = message_ranges(sizes, max_mib * MiB, edge_mib * MiB)
    assert [a for a, _ in ranges] == [0] + [b for _, b in ranges[:-1]] and ranges[-1][1] == layers
    return [b - a for a, b in ranges]


def test_message_ranges_short_edges_balanced_middle() -> None:
    # Llama-3-8B KV: 2 / 8 / 32 MiB per layer at 512 / 2048 / 8192 tokens
    assert _lengths(2, 32) == [4, 24, 4]
    assert _lengths(8, 32) == [1, 7, 8, 7, 8, 1]
    assert _lengths(32, 32) == [1] + [2] * 15 + [1]
    assert _lengths(8, 3) == [3]  # under 4 edges: one message (boundaries would cost more)
    assert _lengths(8, 32, edge_mib=0) == [8, 8, 8, 8]
    assert _lengths(8, 32, max_mib=16, edge_mib=64) == [2] * 16  # edges never exceed the bound
    assert _lengths(100, 2, max_mib=64) == [1, 1]  # a layer above the bound is its own message
    assert message_ranges([], 64 * MiB, 8 * MiB) == []


def test_message_ranges_ramp_grows_from_the_edges() -> None:
    def ramp(layer_mib: int, max_mib: int, factor: int = 4) -> list[int]:
        ranges = message_ranges([layer_mib * MiB] * 32, max_mib * MiB, 8 * MiB, factor)
        assert [a for a, _ in ranges] == [0] + [b for _, b in ranges[:-1]] and ranges[-1][1] == 32
        return [(b - a) * layer_mib for a, b in ranges]

    # Llama-3-8B KV at 2048 tokens: 8 MiB layers; 8 -> 32 -> middle -> 32 -> 8 MiB
    assert ramp(8, 128) == [8, 32, 88, 88, 32, 8]
    assert ramp(8, 256) == [8, 32, 176, 32, 8]
    # 8192 tokens: 32 MiB layers (the edge is one layer); each step at most 4x the one before
    assert ramp(32, 128) == [32, 96, 128, 128, 128, 96, 128, 128, 128, 32]
    sizes = ramp(32, 256)
    assert all(b <= 4 * a for a, b in itertools.pairwise(sizes) if b > a)
    # 512 tokens (64 MiB in all): a ramp step would pass half the bytes: edges and a middle only
    assert ramp(2, 128) == [8, 48, 8]
    # ramp 0: the single-edge framing
    assert ramp(8, 128, factor=0) == [8, 120, 120, 8]
    assert message_ranges([8 * MiB] * 3, 128 * MiB, 8 * MiB, 4) == [(0, 3)]  # too small for edges
    # one lane, 192 MiB, ramp 6 (the defaults before lanes): 5 / 7 / 3 messages at 2048 / 8192 / 512
    assert ramp(8, 192, factor=6) == [8, 48, 144, 48, 8]
    assert ramp(32, 192, factor=6) == [32, 192, 192, 192, 192, 192, 32]
    assert ramp(2, 192, factor=6) == [8, 48, 8]


def test_message_ranges_cut_the_middle_into_a_multiple_of_the_lanes() -> None:
    def framing(layer_mib: int, lanes: int, max_mib: int = 96, layers: int = 32) -> list[int]:
        ranges = message_ranges([layer_mib * MiB] * layers, max_mib * MiB, 8 * MiB, 4, lanes)
        assert [a for a, _ in ranges] == [0] + [b for _, b in ranges[:-1]] and ranges[-1][1] == layers
        return [(b - a) * layer_mib for a, b in ranges]

    # the defaults (96 MiB, ramp 4, two lanes) at 512 / 2048 / 8192 tokens of Llama-3-8B KV
    assert framing(2, 2) == [8, 24, 24, 8]  # one lane: [8, 48, 8]
    assert framing(2, 1) == [8, 48, 8]
    assert framing(8, 2) == [8, 32, 88, 88, 32, 8]  # already even
    assert framing(32, 2) == [32] + [96] * 10 + [32]
    assert framing(8, 3) == [8, 32, 56, 56, 64, 32, 8]  # three lanes: three middle messages
    assert framing(8, 4, layers=12) == [8, 32, 8, 8, 32, 8]  # at most one message per layer
    # no edges (a small transfer): as few messages as the bound allows, whatever the lanes
    assert message_ranges([MiB] * 3, 96 * MiB, 8 * MiB, 4, 2) == [(0, 3)]
    assert message_ranges([MiB] * 4, 2 * MiB, 0, 0, 2) == [(0, 2), (2, 4)]


def test_plan_chunks_applies_edges_per_transfer_run() -> None:
    items = _items([("a", 8 * MiB)] * 8 + [("b", 8 * MiB)] * 2)
    groups = plan_chunks(items, 64 * MiB, 8 * MiB)
    assert [len(g) for g in groups] == [1, 6, 1, 2]


def test_adjacent_ptr_only_for_device_tensors() -> None:
    flat = torch.zeros(100, dtype=torch.uint8)
    assert adjacent_ptr([flat[:50], flat[50:]], [50, 50], torch.device("cuda", 0)) is None  # host memory


def test_info_round_trip_and_validation() -> None:
    info = NcclInfo(
        offers=[CommOffer(comm_id="c1", unique_id=bytes(range(128)), lane_ids=[bytes(128)])],
        chunks=[ChunkPlan(comm_id="c1", seq=3, transfer_id="t", layers=[0, 1], num_bytes=10, lane=1)],
    )
    assert decode_info(encode_info(info)) == info
    assert info.offers[0].unique_ids == [bytes(range(128)), bytes(128)]
    # an offer and a plan from before lanes (no trailing fields) decode as one lane, lane 0
    old = msgspec.msgpack.encode({"v": 1, "offers": [["c1", bytes(128)]], "chunks": [["c1", 0, "t", [0], 4]]})
    decoded = decode_info(old)
    assert decoded.offers[0].unique_ids == [bytes(128)] and decoded.chunks[0].lane == 0
    for bad in (
        NcclInfo(offers=[CommOffer(comm_id="c1", unique_id=bytes(128), lane_ids=[b"short"])]),
        NcclInfo(offers=[CommOffer(comm_id="c1", unique_id=bytes(128), lane_ids=[bytes(128)] * 4)]),
        NcclInfo(chunks=[ChunkPlan(comm_id="c", seq=0, transfer_id="t", layers=[0], num_bytes=1, lane=4)]),
        NcclInfo(chunks=[ChunkPlan(comm_id="c", seq=0, transfer_id="t", layers=[0], num_bytes=1, lane=-1)]),
    ):
        with pytest.raises(ProtocolError):
            decode_info(encode_info(bad))
    with pytest.raises(ProtocolError):
        decode_info(b"\x93garbage")
    bad_uid = NcclInfo(offers=[CommOffer(comm_id="c1", unique_id=b"short")])
    with pytest.raises(ProtocolError):
        decode_info(encode_info(bad_uid))
    bad_chunk = NcclInfo(chunks=[ChunkPlan(comm_id="c", seq=-1, transfer_id="t", layers=[0], num_bytes=1)])
    with pytest.raises(ProtocolError):
        decode_info(encode_info(bad_chunk))
    with pytest.raises(ProtocolError):
        decode_info(encode_info(NcclInfo(v=99)))


def test_configs_are_validated() -> None:
    with pytest.raises(ConfigError):
        CommConfig(min_ctas=8, max_ctas=4)
    with pytest.raises(ConfigError):
        CommConfig(max_ctas=0)
    with pytest.raises(ConfigError):
        NcclPlaneConfig(chunk_bytes=1024)
    with pytest.raises(ConfigError):
        NcclPlaneConfig(max_ctas=100)
    with pytest.raises(ConfigError):
        NcclPlaneConfig(max_inflight_chunks=0)
    with pytest.raises(ConfigError):
        NcclPlaneConfig(edge_bytes=-1)
    with pytest.raises(ConfigError):
        NcclPlaneConfig(ramp=1)
    with pytest.raises(ConfigError):
        NcclPlaneConfig(send_graphs=-1)
    for lanes in (0, 5):
        with pytest.raises(ConfigError, match="lanes"):
            NcclPlaneConfig(lanes=lanes)
    assert NcclPlaneConfig(max_ctas=8).comm_config == CommConfig(max_ctas=8, blocking=True)


def test_plane_config_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVWIRE_NCCL_MAX_CTAS", "4")
    monkeypatch.setenv("KVWIRE_NCCL_CHUNK_MIB", "16")
    monkeypatch.setenv("KVWIRE_NCCL_EDGE_MIB", "0")
    monkeypatch.setenv("KVWIRE_NCCL_RAMP", "0")
    monkeypatch.setenv("KVWIRE_NCCL_GRAPHS", "0")
    monkeypatch.setenv("KVWIRE_NCCL_LANES", "1")
    monkeypatch.setenv("KVWIRE_NCCL_MAX_PLANS", "1024")
    cfg = NcclPlaneConfig.from_env()
    assert cfg.max_plans == 1024 and NcclPlaneConfig().max_plans == 65536
    with pytest.raises(ConfigError, match="max_plans"):
        NcclPlaneConfig(max_plans=0)
    assert (cfg.max_ctas, cfg.chunk_bytes, cfg.edge_bytes) == (4, 16 * MiB, 0)
    assert (cfg.ramp, cfg.send_graphs, cfg.lanes) == (0, 0, 1)
    defaults = NcclPlaneConfig()
    assert (defaults.ramp, defaults.send_graphs, defaults.lanes, defaults.chunk_bytes) == (4, 8, 2, 96 * MiB)
    assert NcclPlaneConfig().edge_bytes == 8 * MiB
    for raw, expected in (("1", True), ("yes", True), ("off", False), ("0", False)):
        monkeypatch.setenv("KVWIRE_NCCL_ZERO_COPY", raw)
        assert NcclPlaneConfig.from_env().zero_copy is expected


def test_config_struct_matches_nccl_2_27_layout() -> None:
    # size_t, 2 x uint, 4 x int, char*, 2 x int, char*, 4 x int  (x86-64: 72 bytes)
    assert ctypes.sizeof(_Config) == 72
    assert _Config.maxCTAs.offset == 28 and _Config.netName.offset == 32 and _Config.nvlsCTAs.offset == 68
    cfg = _make_config(CommConfig(max_ctas=4))
    assert (cfg.size, cfg.magic, cfg.version, cfg.blocking) == (72, 0xCAFEBEEF, 22700, 0)
    assert cfg.maxCTAs == 4 and cfg.minCTAs == -(2**31)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only failure")
def test_plane_needs_cuda() -> None:
    with pytest.raises(ConfigError):
        TransferConfig(backend=Backend.NCCL, device="cpu")
    plane = NcclPlane(TransferConfig(backend=Backend.NCCL, device="cuda:0"), "me")
    assert plane.send_graph_stats() == {"graphs": 0, "captures": 0, "replays": 0, "aborted": 0}
    with pytest.raises(NcclUnavailableError):
        plane.start(None)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("layout", "shape"),
    [
        (KVLayout.KV_FIRST, (2, 9, 4, 2, 8)),
        (KVLayout.BLOCK_FIRST, (9, 2, 4, 2, 8)),
        (KVLayout.MLA, (9, 4, 24)),
    ],
)
def test_group_gather_scatter_equal_per_layer_ops(layout: KVLayout, shape: tuple[int, ...]) -> None:
    layers = [torch.randn(shape) for _ in range(3)]
    ids = torch.tensor([6, 1, 4])
    out = group_kernels.gather_layers(layers, ids, layout)
    assert out.shape == group_kernels.group_shape(layers, 3, layout)
    for index, layer in enumerate(layers):
        assert torch.equal(out[index], gather_blocks(layer, ids, layout))
    dst = [torch.zeros(shape) for _ in range(3)]
    group_kernels.scatter_layers(dst, torch.tensor([0, 8, 2]), out, layout)
    for index in range(3):
        assert torch.equal(gather_blocks(dst[index], torch.tensor([0, 8, 2]), layout), out[index])
    with pytest.raises(ValueError):
        group_kernels.scatter_layers(dst, ids, out[:2], layout)


def test_gated_scatter_needs_the_one_launch_path() -> None:
    layers = [torch.zeros(2, 4, 2, 1, 8) for _ in range(2)]
    paged = group_kernels.PagedLayers(layers, KVLayout.KV_FIRST)
    assert not paged.gated_scatter  # CPU tensors: torch fallback, which cannot honour a gate
    data = torch.ones(paged.shape(2))
    with pytest.raises(ConfigError):
        paged.scatter(torch.tensor([0, 1]), data, gate=torch.zeros(4, dtype=torch.int32))
    paged.scatter(torch.tensor([0, 1]), data)  # ungated: fine
    assert layers[1][:, :2].eq(1).all()


def test_copy_share_bounds_the_grid_of_this_threads_launches() -> None:
    import threading

    grid = group_kernels._grid
    assert grid(10_000, 100, 132) == 100  # the bounded grid
    with group_kernels.copy_share(0.5):
        assert grid(10_000, 100, 132) == 66  # half of the SMs
        assert grid(10, 100, 132) == 10  # never more programs than tiles
        seen: list[int] = []
        other = threading.Thread(target=lambda: seen.append(grid(10_000, 100, 132)))
        other.start()
        other.join()
        assert seen == [100]  # another thread's launches are not limited
        with group_kernels.copy_share(None):
            assert grid(10_000, 100, 132) == 100
        assert grid(10_000, 100, 132) == 66  # restored on exit
    assert grid(10_000, 100, 132) == 100
    assert grid(10_000, 0, 0) == 10_000  # unbounded (no GPU)
    with group_kernels.copy_share(1.0):
        assert grid(10_000, 400, 132) == 400  # 1.0 is no limit, even above one program per SM
    with pytest.raises(ConfigError, match="share"), group_kernels.copy_share(0.0):
        pass


def test_slack_copy_share_is_validated_and_read_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    assert NcclPlaneConfig().slack_copy_share == 0.5
    for bad in (0.0, 1.5, -1.0):
        with pytest.raises(ConfigError, match="slack_copy_share"):
            NcclPlaneConfig(slack_copy_share=bad)
    monkeypatch.setenv("KVWIRE_NCCL_SLACK_COPY_SHARE", "1.0")
    assert NcclPlaneConfig.from_env().slack_copy_share == 1.0


def test_abort_all_aborts_the_lanes_together() -> None:
    import threading

    from kvwire.transfer.planes.nccl.bindings import abort_all

    class Lane:
        """An abort that returns only once every lane's abort began (as ncclCommAbort frees memory,
        which waits for the other communicator's kernel, stopped only by that one's abort)."""

        def __init__(self, barrier: threading.Barrier) -> None:
            self.barrier = barrier
            self.aborted = False

        def abort(self) -> None:
            self.barrier.wait(timeout=5.0)
            self.aborted = True

    barrier = threading.Barrier(3)
    lanes = [Lane(barrier) for _ in range(3)]
    assert abort_all(lanes, timeout_s=10.0)
    assert all(lane.aborted for lane in lanes)
    # one that does not return is left behind on its daemon thread, within the deadline
    release = threading.Event()

    class Stuck:
        def abort(self) -> None:
            release.wait(timeout=5.0)

    quick = Lane(threading.Barrier(1))
    assert not abort_all([Stuck(), quick], timeout_s=0.2)
    assert quick.aborted
    release.set()


def _bare_sender(max_plans: int) -> SendChannel:
    """A SendChannel with only what ``add_plans`` and ``check`` read (a real one needs CUDA streams)."""
    sender = object.__new__(SendChannel)
    sender.cond, sender.plans, sender.next_seq, sender.warmed = threading.Condition(), {}, 0, False
    sender._ordinals, sender._slack = collections.OrderedDict(), set()
    sender.config = NcclPlaneConfig(max_plans=max_plans)
    sender.broken, sender.closed, sender.condemned, sender.offer = None, False, False, None
    return sender


def test_a_senders_chunk_plans_are_a_bounded_window_ahead_of_its_channel() -> None:
    """Plans were kept for any seq ahead of the channel's, 65,536 a message from any number of
    messages: a peer could grow the table without bound. Only ``max_plans`` ahead are kept; a plan
    past them breaks the channel, which the janitor then fails (its transfers fail peer_lost)."""
    sender = _bare_sender(max_plans=4)
    assert sender.add_plans([ChunkPlan("c", seq, "t", [seq], 1) for seq in range(4)])
    for seq in (0, 1):  # two messages launched: the window moves on
        del sender.plans[seq]
    sender.next_seq = 2
    assert sender.add_plans([ChunkPlan("c", seq, "t", [seq], 1) for seq in (4, 5)])
    assert sorted(sender.plans) == [2, 3, 4, 5]
    assert sender.broken is None
    assert not sender.add_plans([ChunkPlan("c", 6, "u", [0], 1), ChunkPlan("c", 7, "u", [1], 1)])
    assert sorted(sender.plans) == [2, 3, 4, 5]  # the plan past the window is not kept
    assert sender.check(time.monotonic()) == "chunk plan 6 is 4 messages ahead of the channel (max_plans 4)"
    assert not sender.add_plans([ChunkPlan("c", 2, "t", [2], 1)])  # a broken channel keeps nothing more


def test_a_peers_plans_past_the_window_are_counted_once_and_fail_its_channel() -> None:
    plane = NcclPlane(TransferConfig(), "me", NcclPlaneConfig(max_plans=8))
    assert plane.board.limit_hits()["nccl_plans_full"] == 0  # exported before the first hit
    sender = _bare_sender(max_plans=8)
    plane._sender = lambda _peer: sender  # type: ignore[method-assign]
    plane._callbacks = RecordingCallbacks()  # type: ignore[assignment]
    offer = CommOffer("c", bytes(128))
    far = [ChunkPlan("c", 10**12 + i, "t", [0], 1) for i in range(3)]  # never launched: kept for ever
    peer = PeerRef("tcp://127.0.0.1:1", "peer", "")
    for _ in range(3):
        plane.on_peer_info(peer, encode_info(NcclInfo(offers=[offer], chunks=far)))
    assert sender.plans == {} and plane.board.limit_hits()["nccl_plans_full"] == 1
    verdict = sender.check(time.monotonic())  # what the janitor fails the channel with
    assert verdict is not None and "max_plans 8" in verdict
