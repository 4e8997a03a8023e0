"""Receiving half of a peer pair's NCCL traffic: owns the communicator (rank 1) and the framing.

``post_recv`` items are grouped into chunks (:func:`plan_chunks`), numbered, queued for posting and
queued for announcement (the next ``local_info`` to that peer carries the plans, see
:mod:`kvwire.transfer.nccl_messages`). Each chunk is received as one NCCL group (data + 8-byte status)
with its own completion event, so the first chunks are delivered (and scattered by the sink, on the
delivery stream) while later ones are still on the wire. A chunk whose destinations lie back to back
on the device is received in place; otherwise into a staging buffer allocated on the receive stream
and copied out to each destination (device or pinned host) on that stream before the event.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Sequence
from typing import Any

import torch

from kvwire.transfer.nccl_channel import (
    STATUS_MAGIC,
    _Batch,
    _Channel,
    _Work,
    adjacent_ptr,
    log,
    plan_chunks,
)
from kvwire.transfer.nccl_lib import load_nccl
from kvwire.transfer.nccl_messages import ChunkPlan, CommOffer
from kvwire.transfer.types import RecvItem, SendItem

STATUS_RING = 1024  # status slots per channel: bounds the chunks in flight


class RecvChannel(_Channel):
    rank = 1

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.offer = CommOffer(comm_id=secrets.token_hex(8), unique_id=load_nccl().unique_id())
        self.next_seq = 0
        self.pending: list[tuple[ChunkPlan, list[RecvItem]]] = []
        self.unannounced: list[ChunkPlan] = []
        # status words of in-flight chunks: device ring (NCCL writes) + pinned host mirror (we read)
        self._status_dev: torch.Tensor | None = None
        self._status_host: torch.Tensor | None = None
        self._status_np: Any = None

    # --- called by the plane (agent threads) ------------------------------------------------------
    def add_items(self, items: Sequence[RecvItem]) -> None:
        assert self.offer is not None
        with self.cond:
            for group in plan_chunks(items, self.config.chunk_bytes):
                chunk = ChunkPlan(
                    comm_id=self.offer.comm_id,
                    seq=self.next_seq,
                    transfer_id=group[0].transfer_id,
                    layers=[item.layer_index for item in group],
                    num_bytes=sum(item.num_bytes for item in group),
                )
                self.next_seq += 1
                self.pending.append((chunk, group))
                self.unannounced.append(chunk)
            self.last_active = time.monotonic()
            self.cond.notify_all()
        self.launch_inline()  # posted before the GRANT leaves, when the communicator is warm

    def take_announcement(self) -> tuple[CommOffer | None, list[ChunkPlan]]:
        """The offer (until the sender joined) and the chunk plans not yet sent to the peer."""
        with self.cond:
            chunks, self.unannounced = self.unannounced, []
            return (None if self.joined else self.offer), chunks

    # --- issuer -------------------------------------------------------------------------------------
    def _has_work(self) -> bool:
        return bool(self.pending) and len(self.inflight) < self._limit()

    def _limit(self) -> int:
        # a status slot is free again once its chunk completed
        return min(STATUS_RING - 1, self.config.max_inflight_chunks)

    def _take_work(self) -> _Work:
        room = max(0, self._limit() - len(self.inflight))
        work: _Work = [(chunk, items) for chunk, items in self.pending[:room]]
        self.pending = self.pending[room:]
        return work

    def _launch(self, chunk: ChunkPlan, items: list[SendItem] | list[RecvItem] | None) -> _Batch:
        """One chunk as one NCCL group (data + status), staging copies, status D2H, an event; called
        with the receive stream current (see ``launch_pending``)."""
        assert self.comm is not None
        if self._status_dev is None:
            self._status_dev = torch.zeros((STATUS_RING, 2), dtype=torch.int32, device=self.device)
            self._status_host = torch.zeros((STATUS_RING, 2), dtype=torch.int32, pin_memory=True)
            self._status_np = self._status_host.numpy()
        assert self._status_host is not None
        group: list[RecvItem] = items  # type: ignore[assignment]
        sizes = [item.num_bytes for item in group]
        address = adjacent_ptr([item.dest for item in group], sizes, self.device)
        staging = None
        if address is None:
            staging = torch.empty(max(chunk.num_bytes, 1), dtype=torch.uint8, device=self.device)
            address = staging.data_ptr()
            for item in group:
                if item.dest.is_cuda:
                    item.dest.record_stream(self.stream)  # allocator: no reuse before our writes end
        else:
            group[0].dest.record_stream(self.stream)  # one allocation holds them all
        slot = chunk.seq % STATUS_RING
        stream = self.stream.cuda_stream
        with self.comm.group(time.monotonic() + self.config.stall_timeout_s):
            if chunk.num_bytes:
                self.comm.recv(address, chunk.num_bytes, 0, stream)
            self.comm.recv(self._status_dev.data_ptr() + 8 * slot, 8, 0, stream)
        if staging is not None:
            offset = 0
            for item in group:
                item.dest[: item.num_bytes].copy_(
                    staging[offset : offset + item.num_bytes], non_blocking=True
                )
                offset += item.num_bytes
        self._status_host[slot].copy_(self._status_dev[slot], non_blocking=True)
        event = torch.cuda.Event()
        event.record(self.stream)
        keep = [staging] if staging is not None else []
        return _Batch(event, chunk, group, keep, time.monotonic(), status_slot=slot)

    # --- completer ----------------------------------------------------------------------------------
    def _complete(self, batch: _Batch) -> None:
        tid = batch.chunk.transfer_id
        if tid in self.cancelled:
            return
        magic, real = (int(v) for v in self._status_np[batch.status_slot])
        if magic != STATUS_MAGIC or real != 1:
            reason = (
                "protocol: chunk status garbled"
                if magic != STATUS_MAGIC
                else "peer_aborted: sender cancelled"
            )
            self.cancelled.add(tid)  # report once; later chunks of it are ignored
            self.callbacks.on_transfer_failed(tid, reason)
            return
        for item in batch.items or ():
            try:
                self.callbacks.on_received(self.peer_instance, tid, item.layer_index)
            except Exception:  # a sink/callback bug must not kill the channel
                log.exception("on_received callback failed")
