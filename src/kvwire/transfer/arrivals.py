"""Receive side, after the grant: layers landing, sink deliveries, acks, completion, finished layers.

Every method runs with ``core.lock`` held; a sink is called by the agent without it (``on_received``
and ``take_held_for_sink`` hand the call out, ``delivered`` takes its return).
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING

import torch

from kvwire.errors import TransferError
from kvwire.transfer.buffers import BufferKind, RecvBuffer
from kvwire.transfer.control_messages import Ack
from kvwire.transfer.core import Core
from kvwire.transfer.recv_state import RecvState
from kvwire.transfer.types import LayerSink, LayerSpec, TransferTiming

if TYPE_CHECKING:
    from kvwire.transfer.receiver import Receiver


@dataclasses.dataclass
class _AckBatch:
    endpoint: str
    dst_id: str
    layers: list[int] = dataclasses.field(default_factory=list)
    trailer: bool = False


class Arrivals:
    """What landed for the receiver's transfers, and what finished transfers left to take."""

    def __init__(self, receiver: Receiver) -> None:
        self.receiver = receiver
        self.core: Core = receiver.core
        self.done_layers: dict[str, dict[int, RecvBuffer]] = {}
        self.done_specs: dict[str, list[LayerSpec]] = {}
        self.done_trailers: dict[str, bytes] = {}
        self.acks: dict[str, _AckBatch] = {}

    # --- landing -----------------------------------------------------------------------------------------

    def on_received(
        self, peer_id: str, transfer_id: str, index: int
    ) -> tuple[LayerSink, torch.Tensor] | None:
        """A layer landed. Returns (sink, tensor) when the caller must call the sink (without the lock)."""
        st = self.receiver.table.get(transfer_id)
        if st is None or st.peer is None or st.peer.instance_id != peer_id or index not in st.granted:
            return None
        buf = st.granted.pop(index)
        # an early-granted layer may land before its Offer is read (decision 110)
        num_bytes = st.specs[index].num_bytes if st.specs is not None else st.early[index]
        self.core.stats.add("bytes_received", num_bytes)
        if st.first_arrival is None:
            st.first_arrival = self.core.now()
        self.ack(st, index)
        if buf is None or index in st.consumed:  # landed in the caller's blocks (spans or consumer)
            if buf is not None:
                buf.release()  # the plane reports a consumed layer only after its scatter finished
            st.arrived.add(index)
            self.maybe_complete(st)
            self.receiver.credit.grant_pass()
            return None
        assert st.specs is not None  # a buffered layer was granted from its Offer
        if st.sink is not None and st.expected:
            st.delivering.add(index)
            st.held[index] = buf
            return st.sink, self.layer_view(buf, st.specs[index], owned=False)
        st.held[index] = buf
        st.arrived.add(index)
        self.maybe_complete(st)
        return None

    def take_held_for_sink(self, transfer_id: str) -> list[tuple[int, LayerSink, torch.Tensor]]:
        st = self.receiver.table.get(transfer_id)
        if st is None or st.sink is None or st.specs is None:
            return []
        out = []
        for index, buf in st.held.items():
            if index not in st.delivering:
                st.delivering.add(index)
                st.arrived.discard(index)
                out.append((index, st.sink, self.layer_view(buf, st.specs[index], owned=False)))
        return out

    def delivered(self, transfer_id: str, index: int) -> None:
        """The sink returned for ``index``: free its buffer, maybe complete, grant more."""
        st = self.receiver.table.get(transfer_id)
        if st is None or index not in st.delivering:
            return
        st.delivering.discard(index)
        st.held.pop(index).release()
        st.arrived.add(index)
        self.maybe_complete(st)
        self.receiver.credit.grant_pass()

    def maybe_complete(self, st: RecvState) -> None:
        recvs = self.receiver.table
        if not st.complete() or st.transfer_id not in recvs:
            return
        assert st.specs is not None
        del recvs[st.transfer_id]
        if st.sink is None:
            self.done_layers[st.transfer_id] = st.held
            self.done_specs[st.transfer_id] = st.specs
        if st.trailer is not None:
            self.done_trailers[st.transfer_id] = st.trailer
        timing = None
        if st.first_arrival is not None:
            num_bytes = sum(spec.num_bytes for spec in st.specs)
            timing = TransferTiming(num_bytes, self.core.now() - st.first_arrival, done_unix_s=time.time())
        self.core.events.recvd(st.transfer_id, timing)
        self.core.stats.add("recvs_completed")
        self.core.tombstones.add(self.receiver.side, st.transfer_id, "done")

    # --- acks --------------------------------------------------------------------------------------------

    def ack(self, st: RecvState, index: int | None, trailer: bool = False) -> None:
        assert st.peer is not None
        batch = self.acks.get(st.transfer_id)
        if batch is None:
            batch = self.acks[st.transfer_id] = _AckBatch(st.peer.endpoint, st.peer.instance_id)
        if index is not None:
            batch.layers.append(index)
        batch.trailer = batch.trailer or trailer

    def flush_acks(self) -> None:
        """Control thread: one Ack per transfer with everything that arrived since the last flush."""
        batches, self.acks = self.acks, {}
        for tid, b in batches.items():
            self.core.send(
                b.endpoint,
                Ack(**self.core.header(b.endpoint, tid, b.dst_id), layers=b.layers, trailer=b.trailer),
            )

    # --- finished transfers ------------------------------------------------------------------------------

    def take_layers(self, transfer_id: str) -> dict[int, torch.Tensor]:
        bufs = self.done_layers.pop(transfer_id, None)
        specs = self.done_specs.pop(transfer_id, None)
        if bufs is None or specs is None:
            raise TransferError(f"no received layers for {transfer_id} (not finished, or taken)", transfer_id)
        out: dict[int, torch.Tensor] = {}
        for index, buf in bufs.items():
            out[index] = self.layer_view(buf, specs[index], owned=True)
            if buf.kind is BufferKind.SPILL:
                buf.release()  # copied out: the spill buffer goes back to the pool
            else:
                buf.hand_over()  # the caller owns this memory now
        self.receiver.credit.grant_pass()
        return out

    def take_trailer(self, transfer_id: str) -> bytes | None:
        return self.done_trailers.pop(transfer_id, None)

    def layer_view(self, buf: RecvBuffer, spec: LayerSpec, owned: bool) -> torch.Tensor:
        view = buf.view(spec.shape, spec.dtype)
        if buf.kind is BufferKind.SPILL:
            # spill buffers go back to the pool: hand out a copy on the agent's device
            device = torch.device(self.core.config.device)
            return view.to(device) if device.type != "cpu" else (view.clone() if owned else view)
        return view

    def drop_done(self, transfer_id: str) -> None:
        for buf in self.done_layers.pop(transfer_id, {}).values():
            buf.release()
        self.done_specs.pop(transfer_id, None)
        self.done_trailers.pop(transfer_id, None)

    def close(self) -> None:
        for tid in list(self.done_layers):
            self.drop_done(tid)
