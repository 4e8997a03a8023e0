"""The shared-memory plane's one-copy path: shared regions, the grant table, run pairing and copies,
and in-process agents moving paged KV straight into a shared cache (ring for any other memory)."""

from __future__ import annotations

import gc
import os
import random
import threading
import time
from collections.abc import Iterator

import msgspec
import numpy as np
import pytest
import torch

from kvwire.transfer import LayerSpec, TransferAgent, TransferConfig
from kvwire.transfer.enums import KVLayout
from kvwire.transfer.memory import (
    BlockTarget,
    SharedArena,
    check_peer_memfd,
    live_regions,
    region_of,
    sealed_memfd,
    shared_tensors,
    shared_zeros,
)
from kvwire.transfer.planes.common.runs import pair_runs
from kvwire.transfer.planes.shm import plane as shm_plane_module
from kvwire.transfer.planes.shm import send as shm_send
from kvwire.transfer.planes.shm.plane import GrantTable
from kvwire.transfer.planes.shm.send import (
    DirectInfo,
    GrantView,
    MappedRegions,
    RunCopier,
    RunPlans,
    ShmDest,
    SourceViews,
    WireDest,
    check_table,
    decode_direct,
    encode_direct,
    layer_runs,
    run_table,
)
from support.shm_planes import shm_plane
from support.waiting import wait_for

SHAPE = (2, 24, 16, 4, 32)  # KV_FIRST: 24 blocks of 4 KiB halves (bfloat16)
LAYERS = 4


def _fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def test_shared_tensors_are_zeroed_views_of_one_region_released_with_the_last_tensor() -> None:
    gc.collect()  # regions of earlier tests' tensors go now, not in the middle of this one
    before = {r.region_id for r in live_regions()}
    fds = _fds()
    caches = shared_tensors([SHAPE] * 3, torch.bfloat16)
    new = [r for r in live_regions() if r.region_id not in before]
    assert len(new) == 1 and all(c.shape == SHAPE and c.dtype == torch.bfloat16 for c in caches)
    assert all(not c.any() for c in caches)
    found = [region_of(c) for c in caches]
    assert all(f is not None and f[0] == new[0] for f in found)
    offsets = [f[1] for f in found if f is not None]
    assert offsets == sorted(offsets) and offsets[0] == 0 and offsets[1] >= caches[0].nbytes
    assert region_of(caches[1][:, 3:5].contiguous()) is None  # a copy: ordinary memory
    assert region_of(torch.zeros(8)) is None
    assert region_of(shared_zeros((0,), torch.float32)) is None  # nothing to share
    caches[2][1, 5] = 3.0  # writable
    del caches, found
    gc.collect()
    assert new[0].region_id not in {r.region_id for r in live_regions()}
    assert _fds() <= fds  # its descriptor closed


def test_grant_revoke_waits_for_a_writer_holding_the_slot() -> None:
    """A sender holds the slot across layers and checks the grant before each one: a revoke stops
    it after the layer under way, and returns only once it let go."""
    table = GrantTable(slots=4)
    view = GrantView(os.dup(table.fd), table.size)  # as a sender maps it (own open file description)
    try:
        claimed = table.claim()
        assert claimed is not None
        slot, token = claimed
        holding, release, revoked = threading.Event(), threading.Event(), threading.Event()
        checks: list[bool] = []

        def writer() -> None:
            with view.holding(slot, token, 5.0) as granted:
                checks.append(granted())  # before "layer 1"
                holding.set()
                release.wait(10.0)  # "layer 1" being copied
                checks.append(granted())  # before "layer 2": the revoke zeroed the token

        thread = threading.Thread(target=writer)
        thread.start()
        assert holding.wait(10.0)
        assert not table.revoke(slot, 0.05)  # the writer holds the slot: revoke cannot finish
        assert table.tokens[slot] == 0  # but no new write may start under the grant
        canceller = threading.Thread(target=lambda: revoked.set() if table.revoke(slot, 10.0) else None)
        canceller.start()
        assert not revoked.is_set()
        release.set()
        thread.join(10.0)
        canceller.join(10.0)
        assert revoked.is_set()
        assert checks == [True, False]  # the writer stopped after the layer under way
        with view.holding(slot, token, 1.0) as granted:
            assert not granted()  # revoked: the sender writes nothing
        assert [table.claim() for _ in range(4)].count(None) == 0  # the slot was freed again
        assert table.claim() is None  # four slots, all in use
        with pytest.raises(ValueError, match="outside the table"), view.holding(99, 1, 1.0):
            pass
    finally:
        view.close()
        table.close()


def test_layer_runs_match_pair_runs_and_copies_are_bit_exact() -> None:
    rng = random.Random(7)
    block = 4096
    ids = list(range(40))
    src_ids, dst_ids = rng.sample(ids, 24), rng.sample(ids, 24)
    src_spans = [(h + b * block, block) for h in (0, 40 * block) for b in src_ids]
    dst_spans = [(h + b * block, block) for h in (0, 40 * block) for b in dst_ids]
    assert layer_runs(src_spans, dst_spans) == pair_runs(src_spans, dst_spans)
    uneven = [(0, 3 * block), (10 * block, block)]  # lengths differ per span: the general walk
    assert layer_runs(uneven, dst_spans[:4]) == pair_runs(uneven, dst_spans[:4])
    # into one span (a receive buffer), with empty and adjacent source spans among them
    for src in (src_spans, uneven, [(0, block), (block, 0), (block, block), (5 * block, 2 * block)]):
        one = [(7 * block, sum(n for _, n in src))]
        assert layer_runs(src, one) == pair_runs(src, one), src
    with pytest.raises(ValueError, match="bytes"):
        layer_runs(uneven, [(0, 5 * block)])
    with pytest.raises(ValueError, match="bytes"):
        layer_runs(src_spans, dst_spans[:-1])
    runs = layer_runs(src_spans, dst_spans)
    check_table(run_table(runs), 80 * block, 80 * block)
    with pytest.raises(ValueError, match="outside"):
        check_table(run_table(runs), 80 * block, max(d + n for _, d, n in runs) - 1)
    src = np.frombuffer(rng.randbytes(80 * block), dtype=np.uint8)
    want = np.zeros(80 * block, dtype=np.uint8)
    for s, d, n in runs:
        want[d : d + n] = src[s : s + n]
    for threads in (1, 2, 3):
        copier = RunCopier(threads)
        try:
            got = np.zeros_like(want)
            copier.copy(src, got, runs)
            assert np.array_equal(got, want), threads
            short = np.zeros(max(d + n for _, d, n in runs) - 1, dtype=np.uint8)
            with pytest.raises(ValueError, match="outside"):  # nothing copied, on any thread
                copier.copy(src, short, runs)
            assert not short.any()
        finally:
            copier.close()


def test_run_plans_are_source_ordered_reused_per_transfer_and_bounded_per_layer() -> None:
    block = 4096
    src_spans = tuple((b * block, block) for b in (9, 2, 7, 3))  # 3 follows 2 here, not in payload
    dst_spans = [(b * block, block) for b in (0, 5, 1, 6)]
    plans = RunPlans()
    runs = plans.runs(src_spans, dst_spans, 10 * block, 7 * block)
    assert runs == sorted(layer_runs(src_spans, dst_spans)) and [r[0] for r in runs] == [
        2 * block,
        3 * block,
        7 * block,
        9 * block,
    ]
    # the next layer of the transfer: equal spans (new objects) -> the same plan, no new pairing
    assert plans.runs(tuple(src_spans), list(dst_spans), 10 * block, 7 * block) is runs
    # the copier's run table, made once per plan: run (2 * block -> 5 * block) comes first
    assert runs.table[0].tolist() == [2 * block, 5 * block, block]
    assert runs.table is runs.table and runs.table.shape == (len(runs), 3)
    with pytest.raises(ValueError, match="destination"):  # this layer's tensor is too small
        plans.runs(src_spans, dst_spans, 10 * block, 7 * block - 1)
    with pytest.raises(ValueError, match="bytes"):  # totals differ
        plans.runs(src_spans, dst_spans[:3], 10 * block, 7 * block)
    with pytest.raises(ValueError, match="negative"):
        plans.runs(((-block, block),), [(0, block)], block, block)


def test_source_views_are_kept_per_tensor_and_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    views = SourceViews()
    cache = [torch.randn(SHAPE).to(torch.bfloat16) for _ in range(3)]
    first = views.of(cache[0])
    assert views.of(cache[0]) is first  # a cache layer comes back for every transfer: viewed once
    assert np.array_equal(first, cache[0].view(-1).view(torch.uint8).numpy())
    cache[0][1, 2] = 7.0
    assert np.array_equal(first, cache[0].view(-1).view(torch.uint8).numpy())  # the memory itself
    assert views.of(cache[1]) is not first and views.of(cache[1]).size == first.size
    odd = cache[2][:, 3:5]  # not contiguous: a copy through torch, not kept
    assert np.array_equal(views.of(odd), odd.contiguous().view(-1).view(torch.uint8).numpy())
    monkeypatch.setattr(SourceViews, "MAX_VIEWS", 2)
    views.of(cache[2])  # a third tensor: the views made so far are dropped
    assert views.of(cache[0]) is not first


def test_grant_info_sends_a_transfers_spans_once() -> None:
    spans = tuple((i * 8192, 4096) for i in range(64))
    dests = [ShmDest("t", layer, 3, layer * 10**6, 5, 77, spans) for layer in range(32)]
    dests.append(ShmDest("u", 0, 3, 0, 6, 78, ((0, 4096),)))
    info = encode_direct(dests)
    assert len(info) < 4 * len(encode_direct(dests[:1]))  # 33 layers, two span sets
    got = decode_direct(info)
    assert [(d.transfer_id, d.layer, d.base, d.slot, d.token) for d in got] == [
        (d.transfer_id, d.layer, d.base, d.slot, d.token) for d in dests
    ]
    assert all(list(map(tuple, d.spans)) == list(w.spans) for d, w in zip(got, dests, strict=True))
    assert got[0].spans is got[31].spans  # the sender's plan is reused by identity
    with pytest.raises(ValueError):
        decode_direct(b"\x81\xa1x\x01")
    with pytest.raises(ValueError, match="span set"):
        decode_direct(msgspec.msgpack.encode(DirectInfo([WireDest("t", 0, 3, 0, 5, 77, 1)], [[(0, 1)]])))


@pytest.fixture
def pair() -> Iterator[tuple[TransferAgent, TransferAgent]]:
    with TransferAgent(TransferConfig()) as p, TransferAgent(TransferConfig()) as d:
        yield p, d


def _transfer(
    p: TransferAgent, d: TransferAgent, tid: str, src_ids: list[int], dst_ids: list[int], layers: int = LAYERS
) -> None:
    d.expect(tid, num_layers=layers, into_blocks=BlockTarget(tuple(dst_ids)), deadline_s=20.0)
    p.start_send(tid, d.endpoint, p.block_layers(len(src_ids)), deadline_s=20.0)
    ids = torch.tensor(src_ids, dtype=torch.int64)
    for i in range(layers):
        p.send_blocks(tid, i, ids)
    sent = recvd = False
    deadline = time.monotonic() + 20.0
    while not (sent and recvd):
        ev_p, ev_d = p.poll(), d.poll()
        assert tid not in ev_p.failed and tid not in ev_d.failed, (ev_p.failed, ev_d.failed)
        sent, recvd = sent or tid in ev_p.finished_sending, recvd or tid in ev_d.finished_recving
        assert time.monotonic() < deadline, f"{tid} did not finish"
        time.sleep(0.002)


def _linked(p: TransferAgent, d: TransferAgent, seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """P's caches and D's shared caches, registered, after one transfer: the link is set up and
    D's region mapped by P. Returns (src, dst)."""
    src = _caches(seed)
    dst = shared_tensors([SHAPE] * LAYERS, torch.bfloat16)
    p.register_kv_caches(src, KVLayout.KV_FIRST)
    d.register_kv_caches(dst, KVLayout.KV_FIRST)
    _transfer(p, d, "warm", [0], [0])
    return src, dst


def _caches(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(SHAPE, generator=gen).to(torch.bfloat16) for _ in range(LAYERS)]


def _blocks(caches: list[torch.Tensor], ids: list[int]) -> list[torch.Tensor]:
    index = torch.tensor(ids, dtype=torch.int64)
    return [c.index_select(1, index).view(torch.int16) for c in caches]


@pytest.mark.parametrize("threads", [1, 2])
def test_paged_transfer_into_a_shared_cache_takes_one_copy_bit_exact(threads: int) -> None:
    cfg = TransferConfig(shm_copy_threads=threads)
    with TransferAgent(cfg) as p, TransferAgent(cfg) as d:
        src = _caches(1)
        dst = shared_tensors([SHAPE] * LAYERS, torch.bfloat16)  # as the engine allocates on CPU
        p.register_kv_caches(src, KVLayout.KV_FIRST)
        d.register_kv_caches(dst, KVLayout.KV_FIRST)
        src_ids = [3, 4, 5, 17, 0, 9, 22, 8]  # runs contiguous on one side only, scattered on both
        dst_ids = [10, 11, 2, 3, 4, 23, 7, 1]
        _transfer(p, d, "one-copy", src_ids, dst_ids)
        assert p.peer_transports() == {d.endpoint: "shm"}
        assert shm_plane(p).layers_sent == {"one_copy": LAYERS}
        for got, want in zip(_blocks(dst, dst_ids), _blocks(src, src_ids), strict=True):
            assert torch.equal(got, want)
        untouched = [b for b in range(SHAPE[1]) if b not in dst_ids]
        assert all(not t.any() for t in _blocks(dst, untouched))  # nothing written outside the grant
        # the grant was retired with the transfer: its slot is free again, no dest left behind
        plane_d, plane_p = shm_plane(d), shm_plane(p)
        wait_for(lambda: not plane_d._granted, 5.0, "the grant retired")
        assert not plane_p.dests and not plane_d._pending


def test_layers_queued_together_are_written_in_batches_and_reported_per_layer(
    pair: tuple[TransferAgent, TransferAgent], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Layers handed over at once go in one batch (one grant hold), announced as they are written
    every ``ANNOUNCE_S``: announcing after every layer, each still lands bit-exact and counts once."""
    p, d = pair
    monkeypatch.setattr(shm_send, "ANNOUNCE_S", 0.0)  # a DONE frame written after every layer
    layers = 8
    src = [c for _ in range(2) for c in _caches(6)]
    dst = shared_tensors([SHAPE] * layers, torch.bfloat16)
    p.register_kv_caches(src, KVLayout.KV_FIRST)
    d.register_kv_caches(dst, KVLayout.KV_FIRST)
    _transfer(p, d, "batched", [4, 12], [13, 2], layers=layers)
    assert shm_plane(p).layers_sent == {"one_copy": layers}
    for got, want in zip(_blocks(dst, [13, 2]), _blocks(src, [4, 12]), strict=True):
        assert torch.equal(got, want)


def test_ordinary_destinations_fall_back_to_the_ring(pair: tuple[TransferAgent, TransferAgent]) -> None:
    p, d = pair
    src = _caches(2)
    dst = [torch.zeros(SHAPE, dtype=torch.bfloat16) for _ in range(LAYERS)]  # like vLLM's caches
    p.register_kv_caches(src, KVLayout.KV_FIRST)
    d.register_kv_caches(dst, KVLayout.KV_FIRST)
    _transfer(p, d, "ring", [1, 2, 3], [5, 0, 6])
    assert shm_plane(p).layers_sent == {"ring": LAYERS}
    for got, want in zip(_blocks(dst, [5, 0, 6]), _blocks(src, [1, 2, 3]), strict=True):
        assert torch.equal(got, want)


def test_one_transfer_mixes_paths_per_destination(pair: tuple[TransferAgent, TransferAgent]) -> None:
    """Layers whose blocks are shared go in one copy, the others through the ring."""
    p, d = pair
    src = _caches(3)
    shared = shared_tensors([SHAPE] * 2, torch.bfloat16)
    dst = [
        shared[0],
        torch.zeros(SHAPE, dtype=torch.bfloat16),
        shared[1],
        torch.zeros(SHAPE, dtype=torch.bfloat16),
    ]
    p.register_kv_caches(src, KVLayout.KV_FIRST)
    d.register_kv_caches(dst, KVLayout.KV_FIRST)
    _transfer(p, d, "mixed", [7, 8], [20, 21])
    assert shm_plane(p).layers_sent == {"one_copy": 2, "ring": 2}
    for got, want in zip(_blocks(dst, [20, 21]), _blocks(src, [7, 8]), strict=True):
        assert torch.equal(got, want)


def test_abort_on_the_receiver_stops_later_writes_into_its_blocks(
    pair: tuple[TransferAgent, TransferAgent],
) -> None:
    """Once the receiver's abort returned, no layer of that transfer lands in its shared blocks,
    even when the sender hands them over afterwards (the grant was revoked)."""
    p, d = pair
    src, dst = _linked(p, d, 4)
    d.expect("cut", num_layers=LAYERS, into_blocks=BlockTarget((5, 6)), deadline_s=20.0)
    p.start_send("cut", d.endpoint, p.block_layers(2), deadline_s=20.0)
    ids = torch.tensor([1, 2], dtype=torch.int64)
    p.send_blocks("cut", 0, ids)
    wait_for(lambda: shm_plane(p).layers_sent["one_copy"] == LAYERS + 1, 10.0, "layer 0 written")
    d.abort("cut", "test")
    for i in range(1, LAYERS):
        p.send_blocks("cut", i, ids)
    wait_for(lambda: "cut" in p.poll().failed, 10.0, "the sender learns of the abort")
    assert torch.equal(_blocks(dst, [5, 6])[0], _blocks(src, [1, 2])[0])
    assert all(not t.any() for t in _blocks(dst[1:], [5, 6]))
    assert shm_plane(p).layers_sent["one_copy"] == LAYERS + 1


class _GatedCopier:
    """Wraps a plane's copier: copy number ``n`` signals ``entered[n]`` and waits for ``proceed[n]``."""

    def __init__(self, inner: RunCopier, calls: int) -> None:
        self.inner, self.calls = inner, 0
        self.entered = [threading.Event() for _ in range(calls)]
        self.proceed = [threading.Event() for _ in range(calls)]

    def copy(self, src: np.ndarray, dst: np.ndarray, runs: list[tuple[int, int, int]]) -> None:
        n, self.calls = self.calls, self.calls + 1
        if n < len(self.entered):
            self.entered[n].set()
            assert self.proceed[n].wait(20.0), f"copy {n} was never let through"
        self.inner.copy(src, dst, runs)

    def close(self) -> None:
        self.inner.close()


def test_abort_mid_batch_stops_the_writer_after_the_layer_under_way(
    pair: tuple[TransferAgent, TransferAgent], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The writer holds a grant across the layers queued together: an abort on the receiver waits
    for the layer being copied, the writer stops before the next, and nothing lands afterwards."""
    monkeypatch.setattr(shm_plane_module, "CANCEL_WAIT_S", 20.0)  # the test holds the writer a while
    p, d = pair
    src, dst = _linked(p, d, 5)
    plane_p, plane_d = shm_plane(p), shm_plane(d)
    gate = _GatedCopier(plane_p.copier, 3)
    monkeypatch.setattr(plane_p, "copier", gate)
    gate.proceed[1].set()  # copy 1 ("cut" layer 0) runs freely
    # copy 0: a first transfer's layer keeps the writer busy while "cut"'s layers queue up behind it
    d.expect("busy", num_layers=LAYERS, into_blocks=BlockTarget((20,)), deadline_s=20.0)
    p.start_send("busy", d.endpoint, p.block_layers(1), deadline_s=20.0)
    p.send_blocks("busy", 0, torch.tensor([9], dtype=torch.int64))
    assert gate.entered[0].wait(10.0)
    d.expect("cut", num_layers=LAYERS, into_blocks=BlockTarget((5, 6)), deadline_s=20.0)
    p.start_send("cut", d.endpoint, p.block_layers(2), deadline_s=20.0)
    for i in range(LAYERS):
        p.send_blocks("cut", i, torch.tensor([1, 2], dtype=torch.int64))
    writer = plane_p.outbound[d.instance_id]
    wait_for(lambda: writer.queue.qsize() == LAYERS, 10.0, "cut's layers queued behind the busy one")
    gate.proceed[0].set()
    assert gate.entered[2].wait(10.0)  # "cut" layer 1 is being copied under the grant's lock
    slot = plane_d._granted["cut"].slot
    table = plane_d.grants.table(p.instance_id)  # p's own grant region (its link keeps it)
    assert table is not None
    aborter = threading.Thread(target=d.abort, args=("cut", "test"))
    aborter.start()
    wait_for(lambda: int(table.tokens[slot]) == 0, 10.0, "the revoke zeroed the token")
    assert aborter.is_alive()  # it waits for the layer under way
    gate.proceed[2].set()
    aborter.join(20.0)
    assert not aborter.is_alive()
    wait_for(lambda: "cut" in p.poll().failed, 10.0, "the sender learns of the abort")
    assert gate.calls == 3  # layers 2 and 3 were never copied
    written = _blocks(dst, [5, 6])
    assert all(torch.equal(written[i], _blocks(src, [1, 2])[i]) for i in (0, 1))
    assert all(not written[i].any() for i in (2, 3))
    assert plane_p.layers_sent["one_copy"] == LAYERS + 3  # warm-up, busy's layer, cut's two


def test_a_granted_destination_outside_the_region_fails_that_transfer_only(
    pair: tuple[TransferAgent, TransferAgent], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A grant whose spans leave the receiver's region (a corrupt or hostile peer) fails its
    transfer as a mismatch at that layer, writes nothing out of bounds, and the link goes on."""
    p, d = pair
    src, dst = _linked(p, d, 6)
    plane_p = shm_plane(p)
    take = plane_p.take_dest

    def corrupt(peer_id: str, transfer_id: str, layer: int) -> ShmDest | None:
        dest = take(peer_id, transfer_id, layer)
        if dest is not None and transfer_id == "bad" and layer == 1:
            return msgspec.structs.replace(dest, base=dest.base + (1 << 40))
        return dest

    monkeypatch.setattr(plane_p, "take_dest", corrupt)
    d.expect("bad", num_layers=LAYERS, into_blocks=BlockTarget((5, 6)), deadline_s=20.0)
    p.start_send("bad", d.endpoint, p.block_layers(2), deadline_s=20.0)
    for i in range(LAYERS):
        p.send_blocks("bad", i, torch.tensor([1, 2], dtype=torch.int64))
    failed_p: dict[str, str] = {}
    wait_for(lambda: failed_p.update(p.poll().failed) or "bad" in failed_p, 10.0, "the sender fails it")
    assert failed_p["bad"].startswith("mismatch: shared-memory layer 1"), failed_p
    wait_for(lambda: "bad" in d.poll().failed, 10.0, "the receiver learns of it")
    written = _blocks(dst, [5, 6])
    assert all(not written[i].any() for i in range(1, LAYERS))  # nothing after the bad layer
    _transfer(p, d, "after", [3, 4], [8, 9])  # the link and the plane go on
    assert all(torch.equal(g, w) for g, w in zip(_blocks(dst, [8, 9]), _blocks(src, [3, 4]), strict=True))


def test_memory_from_a_peer_must_be_sealed_against_shrinking() -> None:
    """A peer that could shrink a memfd after it was mapped would crash the mapper (SIGBUS)."""
    loose = os.memfd_create("kvwire-test", os.MFD_CLOEXEC)
    sealed = sealed_memfd("kvwire-test", 8192)
    try:
        os.ftruncate(loose, 8192)
        with pytest.raises(ValueError, match="sealed"):
            check_peer_memfd(loose, 8192)
        with pytest.raises(ValueError, match="announced"):
            check_peer_memfd(sealed, 4096)
        check_peer_memfd(sealed, 8192)
        with pytest.raises(PermissionError):
            os.ftruncate(sealed, 4096)
        regions = MappedRegions()
        with pytest.raises(ValueError, match="sealed"):
            regions.add(1, os.dup(loose), 8192)
        regions.add(2, os.dup(sealed), 8192)
        assert regions.arrays[2].size == 8192
        regions.close()
    finally:
        os.close(loose)
        os.close(sealed)


def test_arena_hands_out_page_aligned_buffers_and_merges_freed_ranges() -> None:
    arena = SharedArena(64 * 4096)
    a, b, c = arena.allocate(5000), arena.allocate(3 * 4096), arena.allocate(1)
    assert a is not None and b is not None and c is not None
    offsets = [found[1] for found in map(region_of, (a, b, c)) if found is not None]
    assert offsets == [0, 2 * 4096, 5 * 4096] and a.numel() == 5000
    assert arena.allocate(60 * 4096) is None  # 58 pages left
    view = b.view(torch.int32)[:10]
    del b
    gc.collect()
    assert arena.free_bytes() == 58 * 4096  # a view still holds b's range
    del view, a
    gc.collect()
    assert arena.free_bytes() == 63 * 4096
    big = arena.allocate(5 * 4096)  # the merged range at the front
    assert big is not None and region_of(big) == (arena.region, 0)
    del big, c
    gc.collect()
    assert arena.free_bytes() == 64 * 4096


def test_offer_before_expect_lands_in_a_shared_receive_buffer_in_one_copy(
    pair: tuple[TransferAgent, TransferAgent],
) -> None:
    """A transfer offered before the receiver knows its blocks is received into budget buffers;
    those are shared too, so the sender writes them in one copy."""
    p, d = pair
    layers = [torch.randn(2, 8, 64) for _ in range(3)]
    p.start_send("early", d.endpoint, [LayerSpec.of(t) for t in layers], deadline_s=20.0)
    for i, t in enumerate(layers):
        p.send_layer("early", i, t)
    wait_for(lambda: shm_plane(p).layers_sent["one_copy"] == 3, 20.0, "the layers written in one copy")
    d.expect("early", num_layers=3, deadline_s=20.0)
    wait_for(lambda: "early" in d.poll().finished_recving, 20.0, "the transfer received")
    got = d.take_layers("early")
    assert all(torch.equal(got[i], layers[i]) for i in range(3))
    assert shm_plane(p).layers_sent == {"one_copy": 3}


def test_a_finalizer_inside_the_locked_section_does_not_deadlock() -> None:
    """The garbage collector may free a region's last array while this thread holds the regions'
    lock (it hung a CI run in region_of): the release is deferred to the end of the section."""
    import threading

    from kvwire.transfer import memory as shared_memory

    tensor = shared_memory.shared_zeros((4096,), torch.uint8)
    region, _ = shared_memory.region_of(tensor)  # type: ignore[misc]
    done = threading.Event()

    def inside() -> None:
        with shared_memory._lock.held():
            shared_memory._release(region.region_id)  # what the finalizer does mid-section
            assert region.region_id in shared_memory._regions  # deferred: released on the way out
        done.set()

    worker = threading.Thread(target=inside, daemon=True)
    worker.start()
    worker.join(5)
    assert done.is_set(), "deadlocked"
    assert region.region_id not in {r.region_id for r in shared_memory.live_regions()}
