"""Sending half of a peer pair's NCCL traffic (rank 0 of the receiver-owned communicator).

The receiver's chunk plans are the law: chunk ``seq`` is launched once every layer it names is ready
(or its transfer was cancelled: then dummy bytes of the same size keep the stream in step, and the
chunk's status message says so). Chunks launch strictly in ``seq`` order, each as one NCCL group
(data + 8-byte status) on the communicator of its plan's lane, with its own completion event. Before
the group, on the send stream: a wait for each layer's ``ready_event``, then the chunk's device
producers (``SendItem.on_device``, e.g. the gather that fills the layers). With more than one lane
the NCCL groups go on the lanes' own streams, each behind the send stream's work for its chunk, so
the next chunk's gather never waits for a send in flight. Layers that lie back to back in memory
are sent in place; otherwise they are copied into one staging buffer first. On a zero-copy
communicator (the receiver's offer says so) every message's memory must be registrable: in place
only from the plane's zero-copy memory, else staged in a pooled registered buffer.

Once the channel is connected, a run of one transfer's chunks that can be captured (every chunk's
layers back to back, every producer a :class:`~kvwire.transfer.memory.CapturableProducer`) is
launched as one CUDA graph replay when the same run was seen before
(:mod:`kvwire.transfer.planes.nccl.graphs`): the same GPU work, without ~100-300 us of Python per message.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Container, Hashable, Sequence

import torch

from kvwire.errors import PeerLostError
from kvwire.transfer.memory import DeviceProducer, RecvItem, SendItem
from kvwire.transfer.planes.common.group_kernels import copy_share
from kvwire.transfer.planes.nccl.bindings import NcclComm
from kvwire.transfer.planes.nccl.channel import STATUS_MAGIC, _Batch, _Channel, _Work, adjacent_ptr, log
from kvwire.transfer.planes.nccl.config import NcclPlaneConfig
from kvwire.transfer.planes.nccl.device_signal import DeviceSignal, wait_ready
from kvwire.transfer.planes.nccl.graphs import CaptureAborted, SendGraphs, producer_key
from kvwire.transfer.planes.nccl.memory import NcclBuffer
from kvwire.transfer.planes.nccl.plane_info import ChunkPlan, CommOffer

_MAX_SIGNALS = 4096  # transfers' device signals remembered per channel (oldest forgotten first)

# one chunk of a capturable run: (chunk, items, source address, [(producer, its items)])
_Part = tuple[ChunkPlan, list[SendItem], int, list[tuple[DeviceProducer, list[SendItem]]]]


class SendChannel(_Channel):
    rank = 0

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.plans: dict[int, ChunkPlan] = {}
        self.next_seq = 0
        self.ready: dict[tuple[str, int], SendItem] = {}
        self._scratch: torch.Tensor | None = None
        self._scratch_buffer: NcclBuffer | None = None  # the scratch's registered buffer (zero-copy)
        self._capture_lanes: list[torch.cuda.Stream] = []  # lanes 1.. while capturing a graph
        self._status: dict[bool, torch.Tensor] = {}  # real data? -> [magic, flag] on the device
        self.graphs = SendGraphs(self.device, self.config.send_graphs)
        # device signals of transfers handed over: abandoned on cancel and before the comm goes
        self._signals: collections.OrderedDict[str, DeviceSignal] = collections.OrderedDict()
        self._ordinals: collections.OrderedDict[str, int] = collections.OrderedDict()  # plans per transfer
        self._slack: set[int] = set()  # seqs whose gather has slack (see NcclPlaneConfig.slack_copy_share)

    # --- called by the plane (agent threads) ------------------------------------------------------
    def set_offer(self, offer: CommOffer) -> None:
        with self.cond:
            if self.offer is None:
                self.offer = offer
                self.cond.notify_all()

    def lanes(self) -> int:
        """Lanes of the communicator offered (1 before an offer)."""
        with self.cond:
            return len(self.offer.unique_ids) if self.offer is not None else 1

    def add_plans(self, chunks: Sequence[ChunkPlan]) -> bool:
        """Keep the receiver's chunk plans (agent thread, from a peer's plane_info). Only plans within
        ``max_plans`` of the next message to launch are kept, which bounds the table: a receiver
        plans only layers it granted, so a plan further ahead means a broken or hostile peer. False
        then: that plan and the rest are dropped and the channel is *broken*, which the plane's
        janitor turns into the channel's failure (its transfers fail ``peer_lost``)."""
        with self.cond:
            if self.broken is not None:
                return False
            limit = self.next_seq + self.config.max_plans
            for chunk in chunks:
                if chunk.seq >= limit:
                    self.broken = (
                        f"chunk plan {chunk.seq} is {chunk.seq - self.next_seq} messages ahead of the "
                        f"channel (max_plans {self.config.max_plans})"
                    )
                    return False
                if chunk.seq >= self.next_seq:
                    self.plans[chunk.seq] = chunk
                    # the gather of a transfer's third message on has slack: two leave before it
                    ordinal = self._ordinals.get(chunk.transfer_id, 0)
                    self._ordinals[chunk.transfer_id] = ordinal + 1
                    self._ordinals.move_to_end(chunk.transfer_id)
                    if ordinal >= 2:
                        self._slack.add(chunk.seq)
            while len(self._ordinals) > _MAX_SIGNALS:
                self._ordinals.popitem(last=False)
            self.last_active = time.monotonic()
        self._launch_then_wake()
        return True

    def add_items(self, items: Sequence[SendItem]) -> None:
        cancelled = {tid for tid in {item.transfer_id for item in items} if tid in self.cancelled}
        with self.cond:
            for item in items:
                if item.transfer_id not in cancelled:
                    self.ready[(item.transfer_id, item.layer_index)] = item
                    if isinstance(item.ready_signal, DeviceSignal):
                        self._signals[item.transfer_id] = item.ready_signal
            while len(self._signals) > _MAX_SIGNALS:
                self._signals.popitem(last=False)
            self.last_active = time.monotonic()
        self._launch_then_wake()

    def _launch_then_wake(self) -> None:
        """Launch what this thread may (graph replays, see ``launch_inline``), then wake the issuer
        for the rest: woken first, it would compete with this launch for the GIL."""
        try:
            self.launch_inline()
        finally:
            with self.cond:
                self.cond.notify_all()

    def _forget(self, transfer_id: str) -> None:
        for key in [k for k in self.ready if k[0] == transfer_id]:
            del self.ready[key]
        signal = self._signals.pop(transfer_id, None)
        if signal is not None:  # a wait already on the stream goes on; its chunks say "not real"
            signal.abandon()

    def _idle_limit_s(self) -> float:
        # the receiver owns the communicator and closes it first; we follow well after
        return 2 * self.config.idle_close_s

    # --- issuer -------------------------------------------------------------------------------------
    def _launchable(self, chunk: ChunkPlan) -> bool:
        if chunk.transfer_id in self.cancelled:
            return True
        return all((chunk.transfer_id, layer) in self.ready for layer in chunk.layers)

    def _has_work(self) -> bool:
        chunk = self.plans.get(self.next_seq)
        room = len(self.inflight) < self.config.max_inflight_chunks
        return room and chunk is not None and self._launchable(chunk)

    def _take_work(self) -> _Work:
        work: _Work = []
        while self._has_work() and len(self.inflight) + len(work) < self.config.max_inflight_chunks:
            chunk = self.plans.pop(self.next_seq)
            self.next_seq += 1
            if chunk.transfer_id in self.cancelled:
                work.append((chunk, None))
            else:
                items = [self.ready.pop((chunk.transfer_id, layer)) for layer in chunk.layers]
                work.append((chunk, items))
        return work

    def _new_lane_streams(self, count: int) -> list[torch.cuda.Stream]:
        # one lane: the send stream itself (gathers and sends in one queue, as before lanes); more:
        # every lane its own stream, so the send stream runs the producers back to back
        if count == 1:
            return [self.stream]
        return [torch.cuda.Stream(device=self.device) for _ in range(count)]

    def _source(
        self, chunk: ChunkPlan, items: list[SendItem] | None, pooled: list[NcclBuffer], comm: NcclComm
    ) -> tuple[int, torch.Tensor | None, bool]:
        """(device address, buffer to keep alive, real data?) of one chunk, on the send stream (the
        current stream). Not real: dummy bytes, and the chunk's status message says so. Layers back
        to back are sent in place (with zero-copy only from registrable memory); otherwise they are
        copied into a staging buffer (with zero-copy a pooled one, added to ``pooled``)."""
        if items is not None:
            sizes = [item.tensor.numel() * item.tensor.element_size() for item in items]
            if sum(sizes) == chunk.num_bytes:
                self._wait_inputs(items)
                self.mark()
                if not self._produce(chunk, items):
                    return self._dummy(chunk, comm)
                self.mark()
                address = adjacent_ptr([item.tensor for item in items], sizes, self.device)
                self.mark()
                if address is not None and (
                    not self.zero_copy or self._registered(address, chunk.num_bytes, comm)
                ):
                    return address, None, True
                staging = self._staging(chunk.num_bytes, pooled, comm)
                offset = 0
                for item, size in zip(items, sizes, strict=True):
                    flat = item.tensor.reshape(-1).view(torch.uint8)
                    staging[offset : offset + size].copy_(flat, non_blocking=True)
                    offset += size
                return staging.data_ptr(), staging, True
            reason = f"mismatch: layers of {sum(sizes)} bytes, receiver planned {chunk.num_bytes}"
            self.callbacks.on_transfer_failed(chunk.transfer_id, reason)
        return self._dummy(chunk, comm)

    def _wait_inputs(self, items: Sequence[SendItem]) -> None:
        """Order the send stream after the items' ready events and their transfer's device signal."""
        waited: set[int] = set()
        for item in items:
            for ready in (item.ready_event, item.ready_signal):
                if ready is not None and id(ready) not in waited:
                    waited.add(id(ready))
                    if isinstance(ready, DeviceSignal):
                        wait_ready(self.stream, ready)
                    else:
                        self.stream.wait_event(ready)

    def _dummy(self, chunk: ChunkPlan, comm: NcclComm) -> tuple[int, torch.Tensor | None, bool]:
        """Scratch bytes of the chunk's size: keeps the stream in step when there is no real data
        (with zero-copy a buffer registered with ``comm``, kept by the channel: chunks in flight may
        still read a smaller one it outgrew, which stays in the plane's memory until the plane
        closes)."""
        if self._scratch is None or self._scratch.numel() < chunk.num_bytes:
            if self.zero_copy:
                self._scratch_buffer = self._take_registered(max(chunk.num_bytes, 1), comm)
                self._scratch = self._scratch_buffer.tensor
            else:
                self._scratch = torch.empty(max(chunk.num_bytes, 1), dtype=torch.uint8, device=self.device)
        if self._scratch_buffer is not None and self.memory is not None:
            self.memory.register(comm, self._scratch_buffer)  # once per communicator
        return self._scratch.data_ptr(), self._scratch, False

    def _share(self, chunk: ChunkPlan) -> float | None:
        """The SM share the chunk's producers may copy on (None: all; see group_kernels.copy_share)."""
        return self.config.slack_copy_share if chunk.seq in self._slack else None

    def _produce(self, chunk: ChunkPlan, items: list[SendItem]) -> bool:
        """Run the chunk's device producers (distinct ones, in first-use order) on the send stream.
        False when one raised: the transfer is failed and the chunk goes out as dummy bytes."""
        for producer, its_items in _producers(items):
            try:
                with copy_share(self._share(chunk)):
                    producer(its_items)
            except Exception:  # a producer bug fails its transfer, not the channel
                log.exception("device producer of transfer %s failed", chunk.transfer_id)
                self.callbacks.on_transfer_failed(chunk.transfer_id, "mismatch: device producer failed")
                return False
        return True

    def _status_word(self, real: bool) -> torch.Tensor:
        if not self._status:
            for flag in (True, False):
                value = [STATUS_MAGIC, int(flag)]
                self._status[flag] = torch.tensor(value, dtype=torch.int32, device=self.device)
        return self._status[real]

    def _fresh_status(self) -> torch.Tensor:
        """A status word of its own, ``[magic, real=1]``, written on the send stream (no sync)."""
        status = torch.empty_like(self._status_word(True))
        status.copy_(self._status[True], non_blocking=True)
        return status

    def _launch(self, chunk: ChunkPlan, items: list[SendItem] | list[RecvItem] | None) -> _Batch:
        """One chunk as one NCCL group (data + status) on its lane and an event; called with the send
        stream current (see ``launch_pending``)."""
        comm, lane = self._lane(chunk)
        self._status_word(True)
        pooled: list[NcclBuffer] = []
        address, keep, real = self._source(chunk, items, pooled, comm)  # type: ignore[arg-type]
        keepalive = [keep] if keep is not None else []
        status = self._status[real]
        signal = _signal_of(items) if real else None  # type: ignore[arg-type]
        if signal is not None:  # real unless the transfer is abandoned by the time the wait passes
            status = self._fresh_status()
            status[1:2].copy_(signal.real, non_blocking=True)
            keepalive.append(status)
        if lane is not self.stream:
            lane.wait_stream(self.stream)  # the chunk's inputs, producers, staging and status word
        stream = lane.cuda_stream
        with comm.group(time.monotonic() + self.config.stall_timeout_s):
            if chunk.num_bytes:
                comm.send(address, chunk.num_bytes, 1, stream)
            comm.send(status.data_ptr(), 8, 1, stream)
        self.mark()
        self._slack.discard(chunk.seq)
        event = torch.cuda.Event()
        event.record(lane)
        return _Batch(event, chunk, items if real else None, keepalive, time.monotonic(), pooled=pooled)

    # --- captured runs (nccl_graphs) ------------------------------------------------------------------
    def _launch_next(self, work: _Work, hits_only: bool = False) -> list[_Batch]:
        if self.warmed and self.config.send_graphs:
            run = _leading_run(work, self.cancelled)
            planned = self._capturable(run) if run else None
            if planned is not None:
                batches = self._launch_graph(*planned, capture=not hits_only)
                if batches is None and not hits_only:  # not captured (yet): the run from Python,
                    batches = [self._launch(chunk, items) for chunk, items in run]  # as one sighting
                if batches:
                    del work[: len(batches)]
                return batches or []
        return super()._launch_next(work, hits_only)

    def _untake(self, work: _Work) -> None:
        for chunk, items in work:
            self.plans[chunk.seq] = chunk
            for item in items or ():
                self.ready[(item.transfer_id, item.layer_index)] = item  # type: ignore[assignment]
        if work:
            self.next_seq = work[0][0].seq

    def _replays(self, config: NcclPlaneConfig) -> bool:
        # no graph yet: no hit possible, so the caller's thread does not pay a take-and-give-back of
        # the work (senders whose shapes never repeat, e.g. per-layer hand-overs, never do)
        return config.send_graphs > 0 and len(self.graphs) > 0

    def _capturable(self, run: list[tuple[ChunkPlan, list[SendItem]]]) -> tuple[Hashable, list[_Part]] | None:
        """(graph key, parts) of a run that a graph can carry, else None (the Python path sends it)."""
        key: list[Hashable] = []
        parts: list[_Part] = []
        for chunk, items in run:
            sizes = [item.tensor.nbytes for item in items]
            if sum(sizes) != chunk.num_bytes:
                return None  # the Python path reports the mismatch
            address = adjacent_ptr([item.tensor for item in items], sizes, self.device)
            if address is None:
                return None  # staged: the Python path copies it
            if self.zero_copy:
                if not self._registered(address, chunk.num_bytes, self._lane(chunk)[0]):
                    return None  # not registrable: staged
            elif self.memory is not None and self.memory.find(address, chunk.num_bytes) is not None:
                # NCCL registers registrable memory by itself while capturing (NCCL_GRAPH_REGISTER),
                # and a receiver that declined zero-copy does not: the two kernels would disagree
                return None
            producers = _producers(items)
            keys = [producer_key(producer, its_items) for producer, its_items in producers]
            if any(k is None for k in keys):
                return None
            key.append((tuple(chunk.layers), chunk.num_bytes, address, chunk.lane, tuple(keys)))
            parts.append((chunk, items, address, producers))
        # a signalled run's graph has its own status word, refreshed from the signal before each replay
        return (tuple(key), _signal_of(run[0][1]) is not None), parts

    def _launch_graph(self, key: Hashable, parts: list[_Part], capture: bool = True) -> list[_Batch] | None:
        """Replay the run's graph (capturing it when its key was seen before, if ``capture``) on the
        send stream, the current stream. None: no graph (first sighting, or the capture gave up
        before NCCL, or not ``capture``)."""
        captured, seen = self.graphs.find(key, count=capture)
        if captured is None:
            if not seen or not capture:
                return None
            status = self._fresh_status()
            try:
                captured = self.graphs.capture(
                    key,
                    lambda: _produce_all(parts, self._share),
                    self._captured_sends(parts, status.data_ptr()),
                    status,
                )
            except CaptureAborted as exc:
                log.info("send graph not captured (%s); launching from Python", exc)
                return None
        self._wait_inputs([item for _, items, _, _ in parts for item in items])
        signal = _signal_of(parts[0][1])
        if signal is not None:
            captured.status[1:2].copy_(signal.real, non_blocking=True)
        self.mark()
        if not self.graphs.replay(captured):
            raise PeerLostError("the channel closed")
        self.mark()
        for chunk, _, _, _ in parts:
            self._slack.discard(chunk.seq)
        event = torch.cuda.Event()
        event.record(self.stream)
        now = time.monotonic()
        return [_Batch(event, chunk, items, [], now) for chunk, items, _, _ in parts]

    def _captured_sends(
        self, parts: list[_Part], status: int
    ) -> Callable[[torch.cuda.Stream, list[torch.cuda.Event]], None]:
        def send(stream: torch.cuda.Stream, produced: list[torch.cuda.Event]) -> None:
            # lane 0 on the capture stream, the others on side streams forked from it and joined
            # back before the capture ends
            while len(self._capture_lanes) < len(self.comms) - 1:
                self._capture_lanes.append(torch.cuda.Stream(device=self.device))
            lanes = [stream, *self._capture_lanes[: len(self.comms) - 1]]
            for lane in lanes[1:]:
                lane.wait_stream(stream)
            for (chunk, _, address, _), event in zip(parts, produced, strict=True):
                comm, lane = self.comms[chunk.lane], lanes[chunk.lane]
                lane.wait_event(event)
                with comm.group(time.monotonic() + self.config.stall_timeout_s):
                    if chunk.num_bytes:
                        comm.send(address, chunk.num_bytes, 1, lane.cuda_stream)
                    comm.send(status, 8, 1, lane.cuda_stream)
            for lane in lanes[1:]:
                stream.wait_stream(lane)

        return send

    def _release_comm(self) -> None:
        with self.cond:
            signals = list(self._signals.values())
            self._signals.clear()
        for signal in signals:  # no send stream left waiting on a word nobody will write
            signal.abandon()
        self.graphs.close()  # NCCL does not abort or destroy a communicator that a live graph holds

    # --- completer ----------------------------------------------------------------------------------
    def _coalesce(self, batch: _Batch, following: _Batch) -> bool:
        return following.event is batch.event  # one graph replay: its chunks complete together

    def _deliver(self, batches: list[_Batch]) -> None:
        runs: list[tuple[str, list[int]]] = []  # (transfer, layers) in order
        for batch in batches:
            tid = batch.chunk.transfer_id
            if batch.items is None or tid in self.cancelled:
                continue
            layers = [item.layer_index for item in batch.items]
            if runs and runs[-1][0] == tid:
                runs[-1][1].extend(layers)
            else:
                runs.append((tid, layers))
        for tid, layers in runs:
            try:
                self.callbacks.on_sent(self.peer_instance, tid, layers)
            except Exception:  # a callback bug must not kill the channel
                log.exception("on_sent callback failed")


def _signal_of(items: Sequence[SendItem] | None) -> DeviceSignal | None:
    """The device signal the items' transfer waits on (one per transfer), if any."""
    signal = items[0].ready_signal if items else None
    return signal if isinstance(signal, DeviceSignal) else None


def _producers(items: Sequence[SendItem]) -> list[tuple[DeviceProducer, list[SendItem]]]:
    """The distinct device producers of ``items`` in first-use order, each with its items."""
    producers: dict[int, tuple[DeviceProducer, list[SendItem]]] = {}
    for item in items:
        if item.on_device is not None:
            producers.setdefault(id(item.on_device), (item.on_device, []))[1].append(item)
    return list(producers.values())


def _leading_run(work: _Work, cancelled: Container[str]) -> list[tuple[ChunkPlan, list[SendItem]]]:
    """The chunks at the front of ``work`` that carry real data of the same (not cancelled) transfer."""
    run: list[tuple[ChunkPlan, list[SendItem]]] = []
    for chunk, items in work:
        if items is None or (run and chunk.transfer_id != run[0][0].transfer_id):
            break
        run.append((chunk, items))  # type: ignore[arg-type]
    if run and run[0][0].transfer_id in cancelled:
        return []
    return run


def _produce_all(parts: list[_Part], share: Callable[[ChunkPlan], float | None]) -> list[torch.cuda.Event]:
    """Every part's producers on the current stream (each within ``share(chunk)`` of the SMs), and an
    event after each part's."""
    events = []
    for chunk, _, _, producers in parts:
        for producer, its_items in producers:
            with copy_share(share(chunk)):
                producer(its_items)
        event = torch.cuda.Event()
        event.record()
        events.append(event)
    return events
