"""The shared-memory plane's one-copy path between real processes: a sender killed mid-transfer, a
receiver restarted on the same port (the new epoch maps the new memfd, the old one is unmapped),
nothing left in /dev/shm."""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Iterator

import pytest
import torch

from kvwire.cluster.local import free_port
from kvwire.transfer import TransferAgent, TransferConfig
from kvwire.transfer.enums import KVLayout
from kvwire.transfer.memory import MEMFD_NAME, BlockTarget, shared_tensors
from support.shm_planes import shm_plane
from support.transfer_helpers import PeerProcess, digest, has_all, poll_until
from support.waiting import wait_for

SHAPE = [2, 12, 16, 4, 32]  # KV_FIRST float32: 12 blocks of 8 KiB halves
LAYERS = 3
LAYER_BYTES = 2 * 2 * 16 * 4 * 32 * 4  # two blocks of one layer


def _source(seed: int) -> list[torch.Tensor]:
    """The caches ``transfer_peer.op_send_blocks`` sends from (same seed, same draws)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(SHAPE, generator=gen) for _ in range(LAYERS)]


def _digests(caches: list[torch.Tensor], block_ids: list[int]) -> list[str]:
    ids = torch.tensor(block_ids, dtype=torch.int64)
    return [digest(c.index_select(1, ids)) for c in caches]


def _mapped_regions() -> int:
    """Shared KV regions mapped into this process (ours and peers'; earlier tests' garbage first
    collected, so that its regions do not vanish in the middle of a count)."""
    gc.collect()
    with open("/proc/self/maps", encoding="ascii", errors="replace") as f:
        return sum(f"memfd:{MEMFD_NAME}" in line for line in f)


def _nothing_in_dev_shm() -> bool:
    return not any("kvwire" in name for name in os.listdir("/dev/shm"))


@pytest.fixture
def agent() -> Iterator[TransferAgent]:
    with TransferAgent(TransferConfig()) as a:
        yield a


def test_sender_killed_mid_transfer_then_a_new_sender_writes_in_one_copy(agent: TransferAgent) -> None:
    dst = shared_tensors([SHAPE] * LAYERS, torch.float32)  # D: its cache in shared memory
    agent.register_kv_caches(dst, KVLayout.KV_FIRST)
    sender = PeerProcess()
    new: PeerProcess | None = None
    try:
        agent.expect("kill-1", num_layers=LAYERS, into_blocks=BlockTarget((4, 5)), deadline_s=30.0)
        sender.call(
            "send_blocks", tid="kill-1", peer=agent.endpoint, seed=1, shape=SHAPE, num_layers=LAYERS,
            block_ids=[1, 2], layers=[0],
        )  # fmt: skip
        wait_for(lambda: agent.stats().bytes_received >= LAYER_BYTES, 20.0, "layer 0 written by the sender")
        wait_for(lambda: sender.call("paths")["paths"] == {"one_copy": 1}, 10.0, "the one-copy path taken")
        start = time.monotonic()
        sender.kill()
        events = poll_until(agent, has_all("failed", ["kill-1"]), timeout_s=10)
        assert events["failed"]["kill-1"].startswith("peer_lost")
        assert time.monotonic() - start < 10.0  # far within the 30 s deadline
        assert _nothing_in_dev_shm()
        assert _digests(dst, [4, 5])[0] == _digests(_source(1), [1, 2])[0]  # what landed, intact
        # the receiver survives and serves the next sender the same way
        new = PeerProcess()
        agent.expect("kill-2", num_layers=LAYERS, into_blocks=BlockTarget((7, 0)), deadline_s=30.0)
        new.call(
            "send_blocks", tid="kill-2", peer=agent.endpoint, seed=2, shape=SHAPE, num_layers=LAYERS,
            block_ids=[3, 9], layers=list(range(LAYERS)),
        )  # fmt: skip
        poll_until(agent, has_all("recvd", ["kill-2"]), timeout_s=20)
        assert _digests(dst, [7, 0]) == _digests(_source(2), [3, 9])
        wait_for(lambda: new.call("paths")["paths"] == {"one_copy": LAYERS}, 10.0, "the one-copy path taken")
    finally:
        sender.kill()
        if new is not None:
            new.kill()
    assert _nothing_in_dev_shm()


def _send(agent: TransferAgent, tid: str, endpoint: str, block_ids: list[int], layers: list[int]) -> None:
    agent.start_send(tid, endpoint, agent.block_layers(len(block_ids)), deadline_s=30.0)
    ids = torch.tensor(block_ids, dtype=torch.int64)
    for i in layers:
        agent.send_blocks(tid, i, ids)


def test_receiver_restarted_new_epoch_maps_the_new_memfd(agent: TransferAgent) -> None:
    src = _source(5)  # P: ordinary memory, so every shared region mapped here is a receiver's
    agent.register_kv_caches(src, KVLayout.KV_FIRST)
    mapped_before = _mapped_regions()
    port = free_port("127.0.0.1")
    old = PeerProcess("--port", str(port))
    new: PeerProcess | None = None
    try:
        endpoint = old.endpoint
        blocks = {"block_ids": [2, 3], "shape": SHAPE, "num_layers": LAYERS}
        old.call("expect_blocks", tid="rs-1", **blocks)
        _send(agent, "rs-1", endpoint, [6, 1], list(range(LAYERS)))
        poll_until(agent, has_all("sent", ["rs-1"]), timeout_s=20)
        assert old.call("block_digests", block_ids=[2, 3])["digests"] == _digests(src, [6, 1])
        wait_for(lambda: shm_plane(agent).layers_sent == {"one_copy": LAYERS}, 10.0, "one copy, every layer")
        # the old receiver's cache and its receive-buffer arena, each mapped once
        assert _mapped_regions() == mapped_before + 2
        old.call("expect_blocks", tid="rs-2", **blocks)  # in flight when the receiver dies
        _send(agent, "rs-2", endpoint, [6, 1], [0])
        wait_for(lambda: shm_plane(agent).layers_sent["one_copy"] == LAYERS + 1, 20.0, "rs-2 layer 0")
        old.kill()
        new = PeerProcess("--port", str(port))
        assert new.endpoint == endpoint and new.instance_id != old.instance_id
        new.call("expect_blocks", tid="rs-3", **blocks)
        _send(agent, "rs-3", endpoint, [0, 11], list(range(LAYERS)))
        events = poll_until(agent, lambda ev: "rs-3" in ev["sent"] and "rs-2" in ev["failed"], timeout_s=20)
        assert events["failed"]["rs-2"].startswith("peer_lost")
        assert new.call("block_digests", block_ids=[2, 3])["digests"] == _digests(src, [0, 11])
        wait_for(lambda: shm_plane(agent).layers_sent == {"one_copy": 2 * LAYERS + 1}, 10.0, "one copy")
        # the killed receiver's memfds are unmapped here, the new one's mapped
        wait_for(lambda: _mapped_regions() == mapped_before + 2, 10.0, "the old epoch's regions unmapped")
    finally:
        old.kill()
        if new is not None:
            new.kill()
    assert _nothing_in_dev_shm()
