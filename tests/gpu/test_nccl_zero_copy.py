"""Zero-copy communicators (``NcclPlaneConfig.zero_copy``, decision 066) across two GPUs in two processes.

Each scenario runs three transfers over one communicator and checks every byte:

* ``slab``: both ends' layers lie back to back in :meth:`NcclPlane.allocate_zero_copy` slabs, so
  NCCL moves them in place (no staging buffer is taken from the pool on either end);
* ``loose``: ordinary device tensors on both ends, staged through pooled registered buffers;
* ``slab-again``: the ``slab`` shape once more (the pool does not grow, the slabs are reused).

With the receiver's zero-copy off, the sender follows its offer and nothing is registered.
"""

from __future__ import annotations

from multiprocessing.connection import Connection
from typing import Any

import pytest
import torch

from support.nccl_planes import child_results, two_gpus

MiB = 1 << 20
SLAB = [512 * 1024] * 12  # 6 MiB in 1 MiB messages
LOOSE = [300 * 1024 + 5] * 9

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not two_gpus(), reason="needs 2 CUDA GPUs")]


def _data(seed: int, sizes: list[int]) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (size,), dtype=torch.uint8, generator=gen) for size in sizes]


def _views(flat: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    return [flat[o : o + s] for o, s in zip(offsets, sizes, strict=True)]


def _cfg(zero_copy: bool) -> Any:
    from kvwire.transfer.planes.nccl.plane import NcclPlaneConfig

    return NcclPlaneConfig(chunk_bytes=1 * MiB, edge_bytes=0, zero_copy=zero_copy)


def _recv(conn: Connection, zero_copy: bool) -> dict[str, Any]:
    from kvwire.transfer.memory import RecvItem
    from support import nccl_planes as h

    plane, rec = h.start_plane(1, "zc-recv-1", _cfg(zero_copy))
    peer = h.peer_ref("zc-send-0")
    slab = plane.allocate_zero_copy(sum(SLAB))
    out: dict[str, Any] = {"offer_zero_copy": plane._receiver(peer.instance_id).offer.zero_copy}
    assert plane.memory is not None  # this NCCL can register buffers
    for seed, (tid, sizes) in enumerate((("slab", SLAB), ("loose", LOOSE), ("slab-again", SLAB))):
        views = _views(slab, sizes) if sizes is SLAB else [plane.allocate(s) for s in sizes]
        items = [RecvItem(tid, i, s, v) for i, (s, v) in enumerate(zip(sizes, views, strict=True))]
        plane.post_recv(peer, items)
        conn.send(plane.local_info(peer))
        rec.wait_received(tid, len(sizes))
        got = [v.cpu() for v in views]
        out[tid] = all(torch.equal(a, b) for a, b in zip(got, _data(seed, sizes), strict=True))
        out[f"{tid}-held"] = plane.zero_copy_bytes  # the slab, plus pooled staging buffers
    conn.send("done")
    plane.release_zero_copy(slab)
    out["after-release"] = plane.zero_copy_bytes
    try:
        plane.release_zero_copy(slab)
        out["double-release"] = "accepted"
    except ValueError:
        out["double-release"] = "refused"
    out["failed"] = dict(rec.failed)
    plane.close()
    return out


def _send(conn: Connection, zero_copy: bool) -> dict[str, Any]:
    from support import nccl_planes as h

    del zero_copy  # the sender runs the default config and follows the receiver's offer
    plane, rec = h.start_plane(0, "zc-send-0", _cfg(True))
    peer = h.peer_ref("zc-recv-1")
    slab = plane.allocate_zero_copy(sum(SLAB))
    assert plane.memory is not None  # this NCCL can register buffers
    out: dict[str, Any] = {}
    for seed, (tid, sizes) in enumerate((("slab", SLAB), ("loose", LOOSE), ("slab-again", SLAB))):
        plane.on_peer_info(peer, conn.recv())
        data = _data(seed, sizes)
        if sizes is SLAB:
            views = _views(slab, sizes)
            for view, chunk in zip(views, data, strict=True):
                view.copy_(chunk)
        else:
            views = [chunk.to("cuda:0") for chunk in data]
        torch.cuda.synchronize()
        h.send_layers(plane, peer, tid, views)
        rec.wait_sent(tid, len(sizes))
        out[f"{tid}-held"] = plane.zero_copy_bytes
    assert conn.recv() == "done"
    out["zero_copy"] = plane._sender(peer.instance_id).zero_copy
    out["failed"] = dict(rec.failed)
    plane.close()
    return out


@pytest.mark.parametrize("zero_copy", [True, False], ids=["zero-copy", "receiver-declines"])
def test_zero_copy_bit_exact(spawn: Any, zero_copy: bool) -> None:
    left, right = spawn.ctx.Pipe()
    spawn(_send, 0, left, zero_copy)
    spawn(_recv, 1, right, zero_copy)
    results = child_results(spawn.queue, 2)
    recv, send = results["_recv"], results["_send"]
    assert recv["slab"] and recv["loose"] and recv["slab-again"], recv
    assert recv["failed"] == {} and send["failed"] == {}
    slab_bytes = sum(SLAB)
    assert recv["offer_zero_copy"] is zero_copy
    assert send["zero_copy"] is zero_copy  # the sender follows the receiver's offer
    # in place: nothing beyond the slab was taken on either end for the slab transfer
    assert recv["slab-held"] == slab_bytes and send["slab-held"] == slab_bytes
    if zero_copy:  # loose layers were staged in pooled registered buffers, which are reused
        assert recv["loose-held"] > slab_bytes and send["loose-held"] > slab_bytes
    else:  # nothing is registered: staging comes from the caching allocator
        assert recv["loose-held"] == slab_bytes and send["loose-held"] == slab_bytes
    assert recv["slab-again-held"] == recv["loose-held"]
    assert send["slab-again-held"] == send["loose-held"]
    assert recv["after-release"] == recv["slab-again-held"] - slab_bytes
    assert recv["double-release"] == "refused"
