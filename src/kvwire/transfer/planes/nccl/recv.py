"""Receiving half of a peer pair's NCCL traffic: owns the communicator (rank 1) and the framing.

``post_recv`` items are grouped into chunks (:func:`plan_chunks`), numbered, queued for posting and
queued for announcement (the next ``local_info`` to that peer carries the plans, see
:mod:`kvwire.transfer.planes.nccl.plane_info`). Each chunk is received as one NCCL group
(data + 8-byte status)
with its own completion event, so the first chunks are delivered while later ones are still on the
wire. A chunk whose destinations lie back to back on the device is received in place; otherwise into
a staging buffer allocated on the receive stream and copied out to each destination (device or pinned
host). A zero-copy communicator (``NcclPlaneConfig.zero_copy``, announced in the offer) receives in
place only into the plane's registrable memory, else into a pooled registered staging buffer.
Those copies, the device consumers and then the status word's copy to the host run on a consumer
stream behind the receive's event (consecutive chunks alternate between two, so one message's
scatter never waits for the previous one's): the receive stream carries only the receives, back to
back.

Device consumers (``RecvItem.on_device``, see :data:`kvwire.transfer.memory.DeviceConsumer`) are
enqueued when the chunk is *posted*, on its consumer stream behind the receive's event, so the GPU
runs them (e.g. a scatter into paged KV blocks) the moment the bytes land: no host wake-up per chunk.
Each such chunk has a *gate* in the status ring, ``[magic, real, armed, 0]``: the arm (``[0, 0, 1, 0]``)
is written on the gate stream (which never waits for anything) before the receive, the receive writes
``magic, real`` from the sender's status message, and ``cancel`` writes ``armed = 0`` on the same gate
stream (so a disarm always lands after its arm), waits for it, and then waits for the consumers whose
data had already landed (they may have read the gate before). A consumer whose data lands later sees
``armed = 0``; one whose communicator is aborted sees ``magic = 0``. Either way it writes nothing.
"""

from __future__ import annotations

import collections
import secrets
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

from kvwire.transfer.memory import DeviceConsumer, RecvItem, SendItem
from kvwire.transfer.planes.common.group_kernels import copy_share
from kvwire.transfer.planes.nccl.bindings import load_nccl
from kvwire.transfer.planes.nccl.channel import (
    STATUS_MAGIC,
    _Batch,
    _Channel,
    _Work,
    adjacent_ptr,
    log,
)
from kvwire.transfer.planes.nccl.framing import plan_chunks
from kvwire.transfer.planes.nccl.memory import NcclBuffer
from kvwire.transfer.planes.nccl.plane_info import ChunkPlan, CommOffer

STATUS_RING = 1024  # status slots per channel: bounds the chunks in flight
_MAX_ORDINALS = 4096  # transfers whose message count is remembered (for their lanes)
_ARMED = (0, 0, 1, 0)  # a gate before its receive: no data yet, armed


class RecvChannel(_Channel):
    rank = 1

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        lib = load_nccl()
        zero_copy = self.config.zero_copy and self.memory is not None and lib.has_registration
        self.offer = CommOffer(
            comm_id=secrets.token_hex(8),
            unique_id=lib.unique_id(),
            zero_copy=zero_copy,
            lane_ids=[lib.unique_id() for _ in range(self.config.lanes - 1)],
        )
        self.zero_copy = zero_copy
        self.next_seq = 0
        self.pending: list[tuple[ChunkPlan, list[RecvItem]]] = []
        self.unannounced: list[ChunkPlan] = []
        # status words of in-flight chunks: device ring (NCCL writes) + pinned host mirror (we read)
        self._status_dev: torch.Tensor | None = None  # [STATUS_RING, 4] int32: magic, real, armed, 0
        self._status_host: torch.Tensor | None = None
        self._status_np: Any = None
        self._armed: torch.Tensor | None = None
        self._disarmed: torch.Tensor | None = None  # the 0 a cancel writes over a gate's ``armed``
        # staging copies, status copies and device consumers; consecutive chunks alternate between
        # two streams, so a message's scatter starts as soon as its bytes land, beside the previous
        # message's scatter (one stream made the last, exposed scatter wait for the one before it)
        self.consumer_streams = (torch.cuda.Stream(device=self.device), torch.cuda.Stream(device=self.device))
        self.gate_stream = torch.cuda.Stream(device=self.device)  # gate arm/disarm copies only
        self._gate_lock = threading.Lock()  # orders arm and disarm enqueues of a gate
        self._gated: dict[int, tuple[str, _Batch | None]] = {}  # status slot -> (transfer, batch)
        self._slack: set[int] = set()  # seqs whose consumers have slack (NcclPlaneConfig.slack_copy_share)
        # messages planned per transfer (bounded, oldest first out): a transfer's messages take turns
        # on the lanes from lane 0, whatever came before, so its sender's captured graphs repeat
        self._ordinals: collections.OrderedDict[str, int] = collections.OrderedDict()

    # --- called by the plane (agent threads) ------------------------------------------------------
    def add_items(self, items: Sequence[RecvItem]) -> None:
        assert self.offer is not None
        lanes = len(self.offer.unique_ids)
        cfg = self.config
        with self.cond:
            groups = plan_chunks(items, cfg.chunk_bytes, cfg.edge_bytes, cfg.ramp, lanes)
            for index, group in enumerate(groups):
                # the scatter of a message has slack when two more of its transfer land after it
                later = groups[index + 1 : index + 3]
                slack = len(later) == 2 and all(g[0].transfer_id == group[0].transfer_id for g in later)
                if slack:
                    self._slack.add(self.next_seq)
                tid = group[0].transfer_id
                ordinal = self._ordinals.get(tid, 0)
                self._ordinals[tid] = ordinal + 1
                self._ordinals.move_to_end(tid)
                chunk = ChunkPlan(
                    comm_id=self.offer.comm_id,
                    seq=self.next_seq,
                    transfer_id=tid,
                    layers=[item.layer_index for item in group],
                    num_bytes=sum(item.num_bytes for item in group),
                    lane=ordinal % lanes,
                )
                self.next_seq += 1
                self.pending.append((chunk, group))
                self.unannounced.append(chunk)
            while len(self._ordinals) > _MAX_ORDINALS:
                self._ordinals.popitem(last=False)
            self.last_active = time.monotonic()
            self.cond.notify_all()
        # Posted by the issuer thread, never inline: posting may block on the GPU (a kernel's first
        # launch loads a module, which waits for running kernels, e.g. earlier receives), and those
        # receives may wait for a sender that needs the GRANT this caller is about to send.

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
        """One chunk as one NCCL group (data + status) on its lane, staging copies, status D2H, an event,
        and the chunk's device consumers behind it; called with the receive stream current."""
        comm, lane = self._lane(chunk)
        if self._status_dev is None:
            self._status_dev = torch.zeros((STATUS_RING, 4), dtype=torch.int32, device=self.device)
            self._status_host = torch.zeros((STATUS_RING, 4), dtype=torch.int32, pin_memory=True)
            self._status_np = self._status_host.numpy()
            self._armed = torch.tensor(_ARMED, dtype=torch.int32, device=self.device)
            self._disarmed = torch.zeros(1, dtype=torch.int32, device=self.device)
            torch.cuda.current_stream().synchronize()  # once: the gate stream reads these
        assert self._status_host is not None
        group: list[RecvItem] = items  # type: ignore[assignment]
        slot = chunk.seq % STATUS_RING
        consumers = _consumers(group)
        if consumers and not self._arm(slot, chunk.transfer_id, lane):
            consumers = []  # cancelled already: the bytes still come (dummy), nobody consumes them
        self.mark()
        sizes = [item.num_bytes for item in group]
        address = adjacent_ptr([item.dest for item in group], sizes, self.device)
        if address is not None and self.zero_copy and not self._registered(address, chunk.num_bytes, comm):
            address = None  # a zero-copy communicator moves only registered memory: staged
        staging = None
        pooled: list[NcclBuffer] = []
        if address is None:
            with torch.cuda.stream(lane):  # allocated on the stream that writes it
                staging = self._staging(max(chunk.num_bytes, 1), pooled, comm)
            address = staging.data_ptr()
            for item in group:
                if item.dest.is_cuda:
                    item.dest.record_stream(lane)  # allocator: no reuse before our writes end
        else:
            group[0].dest.record_stream(lane)  # one allocation holds them all
        stream = lane.cuda_stream
        with comm.group(time.monotonic() + self.config.stall_timeout_s):
            if chunk.num_bytes:
                comm.recv(address, chunk.num_bytes, 0, stream)
            comm.recv(self._status_dev.data_ptr() + 16 * slot, 8, 0, stream)
        self.mark()
        landed = torch.cuda.Event()
        landed.record(lane)
        # Everything after the receive runs on a consumer stream, so the receive stream holds only
        # the receives, back to back: a copy between two receives delays the next one by its latency
        # (~10 us per message boundary on H200).
        after = self.consumer_streams[chunk.seq % 2]
        after.wait_event(landed)
        with torch.cuda.stream(after):
            if staging is not None:
                if not pooled:  # a pooled buffer goes back to the pool only after the batch's event
                    staging.record_stream(after)
                offset = 0
                for item in group:
                    if item.dest.is_cuda:
                        item.dest.record_stream(after)
                    item.dest[: item.num_bytes].copy_(
                        staging[offset : offset + item.num_bytes], non_blocking=True
                    )
                    offset += item.num_bytes
            if not consumers:  # else after them (they read the gate on the device, not this copy)
                self._status_host[slot].copy_(self._status_dev[slot], non_blocking=True)
            event = torch.cuda.Event()
            event.record(after)
        keep = [staging] if staging is not None else []
        batch = _Batch(
            event, chunk, group, keep, time.monotonic(), status_slot=slot, recv_event=landed, pooled=pooled
        )
        self.mark()
        share = self.config.slack_copy_share if chunk.seq in self._slack else None
        self._slack.discard(chunk.seq)
        if consumers:
            self._enqueue_consumers(batch, consumers, slot, after, share)
            self.mark()
        return batch

    def _arm(self, slot: int, transfer_id: str, lane: torch.cuda.Stream) -> bool:
        """Arm the chunk's gate before its receive is enqueued (the receive's ``lane`` stream waits for
        the arm); False when the transfer is cancelled already."""
        assert self._status_dev is not None and self._armed is not None
        with self._gate_lock:
            if transfer_id in self.cancelled:
                return False
            self._gated[slot] = (transfer_id, None)
            with torch.cuda.stream(self.gate_stream):
                self._status_dev[slot].copy_(self._armed, non_blocking=True)
        lane.wait_stream(self.gate_stream)
        return True

    def _enqueue_consumers(
        self,
        batch: _Batch,
        consumers: list[tuple[DeviceConsumer, list[RecvItem]]],
        slot: int,
        stream: torch.cuda.Stream,
        share: float | None = None,
    ) -> None:
        """The consumers of a chunk on its consumer ``stream``, right behind its receive, then the copy of
        its status word to the host; the batch's event becomes their end (the completer reports the
        layers only after it). The last message's scatter is the transfer's tail, so nothing goes
        before it. Under the gate lock, so a concurrent cancel sees the chunk either before (its
        disarm then lands first) or after (it then waits for the consumers if their data is in)."""
        assert self._status_dev is not None and self._status_host is not None
        gate = self._status_dev[slot]
        failed = False
        with self._gate_lock:  # the consumer stream is already behind the receive
            with torch.cuda.stream(stream), copy_share(share):
                for consumer, its_items in consumers:
                    for item in its_items:
                        item.dest.record_stream(stream)
                    try:
                        consumer(its_items, gate)
                    except Exception:  # a consumer bug fails its transfer, not the channel
                        log.exception("device consumer of transfer %s failed", batch.chunk.transfer_id)
                        failed = True
                self._status_host[slot].copy_(gate, non_blocking=True)
                done = torch.cuda.Event()
                done.record(stream)
            batch.event = done
            if batch.status_slot in self._gated:
                self._gated[batch.status_slot] = (batch.chunk.transfer_id, batch)
        if failed:  # outside the gate lock: the agent's failure path cancels, and cancel takes it
            self.callbacks.on_transfer_failed(batch.chunk.transfer_id, "mismatch: device consumer failed")

    def _forget(self, transfer_id: str) -> None:
        """Cancel (cond held): disarm the gates of the transfer's posted chunks, then wait for the
        consumers that may have read a gate before (their data was in); see the module docstring."""
        if not self._gated or self._status_dev is None or self._disarmed is None:
            return
        with self._gate_lock:
            slots = [slot for slot, (tid, _) in self._gated.items() if tid == transfer_id]
            if not slots:
                return
            with torch.cuda.device(self.device), torch.cuda.stream(self.gate_stream):
                for slot in slots:
                    # a 4-byte copy (cudaMemcpyAsync), not fill_: a first fill_ would load a CUDA
                    # module, which waits for the running kernels, i.e. the posted receives, whose
                    # sender may be waiting for this very cancel (seen as a hang in the GPU suite)
                    self._status_dev[slot, 2:3].copy_(self._disarmed, non_blocking=True)
                disarmed = torch.cuda.Event()
                disarmed.record(self.gate_stream)
            disarmed.synchronize()  # the gate stream never waits for anything: microseconds
            started = [b for slot in slots if (b := self._gated[slot][1]) is not None]
        for batch in started:
            assert batch.recv_event is not None
            if batch.recv_event.query():
                batch.event.synchronize()  # only its consumers (and earlier work on their stream)

    # --- completer ----------------------------------------------------------------------------------
    def _coalesce(self, batch: _Batch, following: _Batch) -> bool:
        # consumed on the GPU (no host delivery to overlap with the wire): a transfer's chunks are
        # reported together once its last chunk in flight landed
        same = following.chunk.transfer_id == batch.chunk.transfer_id
        return same and batch.recv_event is not None and following.recv_event is not None

    def _needs_order(self, batch: _Batch) -> bool:
        return batch.recv_event is None  # no device consumers: the agent's host sink may copy out

    def _deliver(self, batches: list[_Batch]) -> None:
        run_tid = ""  # the run of consecutive real chunks of one transfer, and its layers
        run_layers: list[int] = []
        for batch in batches:
            if batch.recv_event is not None:
                with self._gate_lock:
                    if self._gated.get(batch.status_slot, ("", None))[1] is batch:
                        del self._gated[batch.status_slot]
            tid = batch.chunk.transfer_id
            if tid in self.cancelled:
                continue
            magic, real = (int(v) for v in self._status_np[batch.status_slot][:2])
            if magic != STATUS_MAGIC or real != 1:
                self._report(run_tid, run_layers)  # what landed before goes first
                run_tid, run_layers = "", []
                reason = (
                    "protocol: chunk status garbled"
                    if magic != STATUS_MAGIC
                    else "peer_aborted: sender cancelled"
                )
                self.cancelled.add(tid)  # report once; later chunks of it are ignored
                self.callbacks.on_transfer_failed(tid, reason)
                continue
            if tid != run_tid:
                self._report(run_tid, run_layers)
                run_tid, run_layers = tid, []
            run_layers.extend(item.layer_index for item in batch.items or ())
        self._report(run_tid, run_layers)

    def _report(self, transfer_id: str, layers: list[int]) -> None:
        if not layers:
            return
        try:
            self.callbacks.on_received(self.peer_instance, transfer_id, layers)
        except Exception:  # a sink/callback bug must not kill the channel
            log.exception("on_received callback failed")


def _consumers(items: Sequence[RecvItem]) -> list[tuple[DeviceConsumer, list[RecvItem]]]:
    """The distinct device consumers of a chunk's items (first-use order) with their items, in order.
    Host destinations never get one (a consumer reads device memory)."""
    out: dict[int, tuple[DeviceConsumer, list[RecvItem]]] = {}
    for item in items:
        if item.on_device is not None and item.dest.is_cuda:
            out.setdefault(id(item.on_device), (item.on_device, []))[1].append(item)
    return list(out.values())
