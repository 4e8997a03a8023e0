"""Helpers of the transfer agent unit tests: layers to send, a send call, polling with a deadline."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from kvwire.transfer import LayerSpec, TransferAgent, TransferEvents


def poll_until(agent: TransferAgent, done: Callable[[Events], bool], timeout_s: float = 10.0) -> Events:
    events: Events = {"sent": {}, "recvd": {}, "failed": {}}
    deadline = time.monotonic() + timeout_s
    while not done(events):
        ev: TransferEvents = agent.poll()
        for tid in ev.finished_sending:
            assert tid not in events["sent"]
            events["sent"][tid] = ""
        for tid in ev.finished_recving:
            assert tid not in events["recvd"]
            events["recvd"][tid] = ""
        for tid, reason in ev.failed.items():
            assert tid not in events["failed"]
            events["failed"][tid] = reason
        assert time.monotonic() < deadline, f"timed out; events: {events}"
        time.sleep(0.002)
    return events


def _layers(n: int = 3, dtype: torch.dtype = torch.float16) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(n)
    return [torch.randn(2, 5, 7, generator=gen).to(dtype) for _ in range(n)]


def _send(a: TransferAgent, tid: str, peer: str | None, layers: list[torch.Tensor], **kw: float) -> None:
    a.start_send(tid, peer, [LayerSpec.of(t) for t in layers], **kw)  # type: ignore[arg-type]
    for i, t in enumerate(layers):
        a.send_layer(tid, i, t)


Events = dict[str, dict[str, str]]
