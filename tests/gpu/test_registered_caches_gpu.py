"""The serving path's device code on one GPU: the agent's device producers (one-launch gathers from
the registered paged caches into a pooled slab) and device consumers (gated one-launch scatters into
D's blocks) run for real on CUDA tensors, through the in-process device-plane stand-in (no NCCL:
two NCCL ranks cannot share a GPU). Bit-exact; a cancelled receive's gate stays closed."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import torch

from kvwire.transfer import TransferAgent, TransferConfig
from kvwire.transfer.enums import KVLayout
from kvwire.transfer.memory import BlockTarget
from support.loopback_plane import LoopbackPlane

pytestmark = pytest.mark.gpu

LAYERS, BLOCKS, SHAPE = 8, 64, (2, 64, 16, 8, 128)  # Llama-3-8B-shaped blocks


def _wait(cond: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"{what} not reached within {timeout_s}s"
        time.sleep(0.002)


_SEEN: dict[str, set[str]] = {"sent": set(), "recvd": set()}


def _finished(p: TransferAgent, d: TransferAgent, tid: str) -> bool:
    _SEEN["sent"] |= p.poll().finished_sending
    _SEEN["recvd"] |= d.poll().finished_recving
    return tid in _SEEN["sent"] and tid in _SEEN["recvd"]


def _caches(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(SHAPE, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(LAYERS)]


def test_device_producers_and_consumers_move_blocks_bit_exact() -> None:
    cfg = TransferConfig(device="cuda:0")
    with TransferAgent(cfg, plane_factory=LoopbackPlane) as p, TransferAgent(
        cfg, plane_factory=LoopbackPlane
    ) as d:
        src, dst = _caches(1), _caches(2)
        p.register_kv_caches(src, KVLayout.KV_FIRST)
        d.register_kv_caches(dst, KVLayout.KV_FIRST)
        for round_ in range(3):  # the slab is pooled: the same address serves later transfers
            p_ids = torch.randperm(BLOCKS, device="cuda")[:20]
            d_ids = torch.randperm(BLOCKS)[:20].tolist()
            tid = f"g{round_}"
            d.expect(tid, num_layers=LAYERS, into_blocks=BlockTarget(tuple(d_ids)))
            p.start_send(tid, d.endpoint, p.block_layers(20))
            for index in range(LAYERS):
                event = torch.cuda.Event()
                event.record()
                p.send_blocks(tid, index, p_ids, event)
            _wait(lambda tid=tid: _finished(p, d, tid), f"transfer {tid}")
            torch.cuda.synchronize()
            want = torch.stack([layer[:, p_ids.cpu()] for layer in src])
            got = torch.stack([layer[:, d_ids] for layer in dst])
            assert torch.equal(got.view(torch.int16), want.view(torch.int16))
        p_plane, d_plane = p._core.plane, d._core.plane
        assert isinstance(p_plane, LoopbackPlane) and isinstance(d_plane, LoopbackPlane)
        assert p_plane.producer_calls >= 3 and d_plane.consumer_calls == 3 * LAYERS
