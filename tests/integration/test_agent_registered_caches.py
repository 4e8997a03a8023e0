"""The serving path of the agent: registered paged KV caches and block ids (``register_kv_caches``,
``send_blocks``, ``expect(into_blocks=...)``), on the TCP plane (in place: the socket reads from and
writes into the blocks) and on a device-producer/consumer plane (the NCCL plane's path, here with
an in-process CPU stand-in). Bit-exact contents, the copy fallback when D skips blocks, an abort
that never writes into blocks the engine reuses, and a sender killed mid-transfer."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

import pytest
import torch

from kvwire.transfer import TransferAgent, TransferConfig
from kvwire.transfer.enums import KVLayout
from kvwire.transfer.memory import BlockTarget
from support.loopback_plane import LoopbackPlane
from support.transfer_helpers import PeerProcess

NUM_LAYERS, NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM = 4, 24, 16, 2, 64  # 8 KiB per block and K/V half
LAYER_SHAPE = (2, NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM)


def caches(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(LAYER_SHAPE, generator=gen) for _ in range(NUM_LAYERS)]


def wait(cond: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not reached within {timeout_s}s")
        time.sleep(0.005)


class Events:
    """Accumulates one agent's poll() results."""

    def __init__(self, agent: TransferAgent) -> None:
        self.agent = agent
        self.sent: set[str] = set()
        self.recvd: set[str] = set()
        self.failed: dict[str, str] = {}

    def poll(self) -> Events:
        ev = self.agent.poll()
        self.sent |= ev.finished_sending
        self.recvd |= ev.finished_recving
        self.failed.update(ev.failed)
        return self


@contextlib.contextmanager
def pair(**cfg: object) -> Iterator[tuple[TransferAgent, TransferAgent]]:
    factory = cfg.pop("plane_factory", None)
    kwargs = {} if factory is None else {"plane_factory": factory}
    with TransferAgent(TransferConfig(**cfg), **kwargs) as p, TransferAgent(
        TransferConfig(**cfg), **kwargs
    ) as d:
        yield p, d


def send_all(p: TransferAgent, tid: str, peer: str, ids: list[int], layers: range) -> None:
    block_ids = torch.tensor(ids, dtype=torch.int64)
    for index in layers:
        p.send_blocks(tid, index, block_ids)


def start(p: TransferAgent, tid: str, peer: str, num_blocks: int) -> None:
    p.start_send(tid, peer, p.block_layers(num_blocks), deadline_s=20.0)


def blocks(cache: list[torch.Tensor], ids: list[int]) -> torch.Tensor:
    return torch.stack([layer[:, ids] for layer in cache])


def test_tcp_moves_blocks_in_place_with_no_receive_buffer() -> None:
    # A 1 KiB receive budget and no spill pool: a layer (16 KiB per block and layer) could never be
    # buffered, so completing proves the bytes went straight into D's blocks.
    with pair(recv_budget_bytes=1024, spill_budget_bytes=0) as (p, d):
        src, dst = caches(1), caches(2)
        p.register_kv_caches(src, KVLayout.KV_FIRST)
        d.register_kv_caches(dst, KVLayout.KV_FIRST)
        p_ids, d_ids = [3, 4, 5, 9, 17], [20, 1, 2, 11, 12]  # runs and singles on both ends
        d.expect("t1", num_layers=NUM_LAYERS, into_blocks=BlockTarget(tuple(d_ids)))
        start(p, "t1", d.endpoint, len(p_ids))
        send_all(p, "t1", d.endpoint, p_ids, range(NUM_LAYERS))
        pe, de = Events(p), Events(d)
        wait(lambda: "t1" in pe.poll().sent and "t1" in de.poll().recvd, 20, "transfer done")
        assert not pe.failed and not de.failed
        assert torch.equal(blocks(dst, d_ids), blocks(src, p_ids))
        assert d.stats().spilled_layers == 0


def test_d_holding_a_prefix_lands_through_the_copy_path() -> None:
    with pair() as (p, d):
        src, dst = caches(3), caches(4)
        before = [layer.clone() for layer in dst]
        p.register_kv_caches(src, KVLayout.KV_FIRST)
        d.register_kv_caches(dst, KVLayout.KV_FIRST)
        p_ids = [0, 1, 2, 3, 4]
        d_ids = [10, 11, 12]  # D already holds the first 2 blocks and wants 3 of the remaining 3
        d.expect("t2", num_layers=NUM_LAYERS, into_blocks=BlockTarget(tuple(d_ids), skip_blocks=2))
        start(p, "t2", d.endpoint, len(p_ids))
        send_all(p, "t2", d.endpoint, p_ids, range(NUM_LAYERS))
        pe, de = Events(p), Events(d)
        wait(lambda: "t2" in pe.poll().sent and "t2" in de.poll().recvd, 20, "transfer done")
        assert torch.equal(blocks(dst, d_ids), blocks(src, [2, 3, 4]))
        untouched = [i for i in range(NUM_BLOCKS) if i not in d_ids]
        assert torch.equal(blocks(dst, untouched), blocks(before, untouched))


@pytest.mark.parametrize("plane", ["tcp", "device"])
def test_abort_never_writes_into_blocks_the_engine_reuses(plane: str) -> None:
    cfg = {"plane_factory": LoopbackPlane} if plane == "device" else {}
    with pair(**cfg) as (p, d):
        src, dst = caches(5), caches(6)
        p.register_kv_caches(src, KVLayout.KV_FIRST)
        d.register_kv_caches(dst, KVLayout.KV_FIRST)
        ids = [5, 6, 7, 8]
        d.expect("t3", num_layers=NUM_LAYERS, into_blocks=BlockTarget(tuple(ids)))
        start(p, "t3", d.endpoint, len(ids))
        send_all(p, "t3", d.endpoint, ids, range(2))
        wait(lambda: d.stats().bytes_received > 0, 20, "first layers landed")
        send_all(p, "t3", d.endpoint, ids, range(2, NUM_LAYERS))  # in flight while D aborts
        d.abort("t3", "request aborted")
        for layer in dst:  # abort returned: the engine reuses the blocks at once
            layer[:, ids] = 7.0
        pe = Events(p)
        wait(lambda: "t3" in pe.poll().failed or "t3" in pe.sent, 20, "P's transfer ended")
        assert all(bool((layer[:, ids] == 7.0).all()) for layer in dst)
        assert d.stats().transfers_active == 0


def test_device_plane_gathers_and_scatters_on_its_streams() -> None:
    with pair(plane_factory=LoopbackPlane) as (p, d):
        src, dst = caches(7), caches(8)
        p.register_kv_caches(src, KVLayout.KV_FIRST)
        d.register_kv_caches(dst, KVLayout.KV_FIRST)
        p_ids, d_ids = [1, 2, 3], [9, 4, 22]
        d.expect("t4", num_layers=NUM_LAYERS, into_blocks=BlockTarget(tuple(d_ids)))
        start(p, "t4", d.endpoint, len(p_ids))
        send_all(p, "t4", d.endpoint, p_ids, range(NUM_LAYERS))
        pe, de = Events(p), Events(d)
        wait(lambda: "t4" in pe.poll().sent and "t4" in de.poll().recvd, 20, "transfer done")
        assert torch.equal(blocks(dst, d_ids), blocks(src, p_ids))
        p_plane, d_plane = p._core.plane, d._core.plane
        assert isinstance(p_plane, LoopbackPlane) and isinstance(d_plane, LoopbackPlane)
        assert p_plane.producer_calls >= 1  # the plane gathered from the cache (no gathered copies)
        assert d_plane.items_with_consumer["t4"] == NUM_LAYERS  # every layer scattered on arrival
        assert d_plane.consumer_calls == NUM_LAYERS


def test_sender_killed_mid_transfer_fails_the_receive() -> None:
    peer = PeerProcess()
    try:
        with TransferAgent(TransferConfig(default_deadline_s=30.0)) as d:
            dst = caches(9)
            d.register_kv_caches(dst, KVLayout.KV_FIRST)
            ids = [2, 3, 4, 5]
            d.expect("t5", num_layers=NUM_LAYERS, into_blocks=BlockTarget(tuple(ids)))
            peer.call(
                "send_blocks", tid="t5", peer=d.endpoint, seed=9, shape=list(LAYER_SHAPE),
                num_layers=NUM_LAYERS, block_ids=ids, layers=[0, 1],
            )
            wait(lambda: d.stats().bytes_received > 0, 20, "first layers landed")
            peer.kill()
            de = Events(d)
            wait(lambda: "t5" in de.poll().failed, 20, "peer loss detected")
            assert de.failed["t5"].startswith(("peer_lost", "peer_aborted"))
            assert d.stats().transfers_active == 0
    finally:
        peer.kill()
