"""NCCL point-to-point data plane between GPUs (see :mod:`kvwire.transfer.planes.base` for the contract).

Per peer epoch (``PeerRef.instance_id``) and direction there is one channel: two-rank communicators
(``NcclPlaneConfig.lanes`` of them, see :mod:`kvwire.transfer.planes.nccl.channel`) created lazily by the
**receiver**, whose NCCL unique ids travel to the sender in the agent's ``plane_info`` (with the
GRANT that follows the first ``post_recv``). The receiver also decides how
layers are coalesced into NCCL messages and announces those *chunk plans* the same way, so matched
send/recv sizes always agree whatever the timing on either side
(:mod:`kvwire.transfer.planes.nccl.plane_info`).

Guarantees asked of the agent (all hold for :class:`~kvwire.transfer.agent.TransferAgent`):

* on the receiver, ``post_recv(peer, items)`` happens before ``local_info(peer)`` is taken for the
  GRANT that grants those items;
* on the sender, ``on_peer_info`` of a GRANT is called before ``send`` of the layers it grants;
* ``cancel`` is called for every transfer the agent gives up (the plane then sends dummy bytes for
  its announced chunks so the stream stays in step).

Communicators: at most ``max_comms`` receive channels (an idle one is closed to make room);
a receive channel unused for ``idle_close_s`` is destroyed (the sender drops its side after twice
that, or as soon as a new offer replaces it); ``drop_peer`` (peer restarted / lost), a stalled
operation (``stall_timeout_s``) or an asynchronous NCCL error abort its communicators
(``ncclCommAbort``, all lanes at once). Channel
count (``min_ctas``/``max_ctas``) is configurable; see docs/decisions/061-nccl-data-plane.md for the
GPU memory each communicator costs.
"""

from __future__ import annotations

import collections
import functools
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

from kvwire.errors import ProtocolError, TransferError
from kvwire.supervision import HealthBoard, SupervisedThread, guarded
from kvwire.transfer.config import TransferConfig
from kvwire.transfer.memory import PeerRef, RecvItem, SendItem
from kvwire.transfer.planes.base import DataPlane, PlaneCallbacks
from kvwire.transfer.planes.nccl import device_signal
from kvwire.transfer.planes.nccl.bindings import NcclUnavailableError, load_nccl, run_together
from kvwire.transfer.planes.nccl.channel import CancelledSet, _Channel
from kvwire.transfer.planes.nccl.config import NcclPlaneConfig
from kvwire.transfer.planes.nccl.memory import ZeroCopyMemory
from kvwire.transfer.planes.nccl.plane_info import NcclInfo, decode_info, encode_info
from kvwire.transfer.planes.nccl.recv import RecvChannel
from kvwire.transfer.planes.nccl.send import SendChannel

__all__ = ["NcclPlane", "NcclPlaneConfig"]

log = logging.getLogger("kvwire.transfer.planes.nccl.plane")

# kvwire_limit_hits_total{limit}: a peer's chunk plan past NcclPlaneConfig.max_plans (its channel fails)
PLANS_FULL = "nccl_plans_full"


def _close_all(channels: Sequence[_Channel], timeout_s: float = 20.0) -> None:
    """Close (abort) ``channels`` at once, each on a thread of its own, joined by ``timeout_s``: one
    channel's abort can wait for another's kernels still spinning on a dead peer (see
    ``nccl_lib.abort_all``), so one after the other could deadlock."""
    closes = [functools.partial(channel.close, abort=True) for channel in channels]
    if not run_together(closes, "kvwire-nccl-close", timeout_s):
        log.warning("NCCL channels did not close within %.0f s", timeout_s)


class NcclPlane(DataPlane):
    """The GPU data plane. One per :class:`~kvwire.transfer.agent.TransferAgent` (one per GPU)."""

    ordered = True
    supports_device_consumers = True
    supports_device_producers = True
    supports_device_signals = True  # cuStreamWaitValue32: CUDA drivers >= 11.7 (checked at start)

    def __init__(
        self,
        config: TransferConfig,
        instance_id: str,
        plane_config: NcclPlaneConfig | None = None,
        board: HealthBoard | None = None,
    ) -> None:
        self.config = config
        self.board = board if board is not None else HealthBoard()
        self.board.limit_hit(PLANS_FULL, 0)  # exported at 0 before the first hit
        self.instance_id = instance_id
        self.plane_config = plane_config or config.nccl
        self.device = torch.device(config.device)
        self._lock = threading.Lock()
        self._senders: dict[str, SendChannel] = {}  # peer instance id -> channel
        self._receivers: dict[str, RecvChannel] = {}
        self._callbacks: PlaneCallbacks | None = None
        self._alloc_stream: torch.cuda.Stream | None = None
        self.memory: ZeroCopyMemory | None = None  # registrable memory (NCCL >= 2.19), see allocate_zero_copy
        self._cancelled = CancelledSet()
        self._retired_graph_stats: collections.Counter[str] = collections.Counter()  # of closed senders
        self._closed = False
        self._stop = threading.Event()
        self._janitor: SupervisedThread | None = None

    def start(self, callbacks: PlaneCallbacks) -> None:
        if not torch.cuda.is_available():
            raise NcclUnavailableError("the NCCL data plane needs CUDA")
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        lib = load_nccl()
        version = ".".join(map(str, lib.version()))
        log.info("NCCL data plane on %s: %s, NCCL %s", self.device, lib.path, version)
        self._callbacks = callbacks
        with torch.cuda.device(self.device):
            device_signal.prepare(self.device)  # raises TransferError without cuStreamWaitValue32
        self._alloc_stream = torch.cuda.Stream(device=self.device)
        if lib.has_registration:
            self.memory = ZeroCopyMemory(self.device)
        self._janitor = SupervisedThread(
            "kvwire-nccl-janitor", self._janitor_loop, self._stop, board=self.board
        ).start()

    @property
    def address(self) -> str:
        return f"nccl://{self.config.host}/{self.device}"

    # --- handshake ------------------------------------------------------------------------------------
    def local_info(self, peer: PeerRef) -> bytes:
        with self._lock:
            channel = self._receivers.get(peer.instance_id)
        if channel is None:
            return b""
        offer, chunks = channel.take_announcement()
        if offer is None and not chunks:
            return b""
        return encode_info(NcclInfo(offers=[offer] if offer else [], chunks=chunks))

    def on_peer_info(self, peer: PeerRef, info: bytes) -> None:
        try:
            decoded = decode_info(info)
        except ProtocolError as exc:
            self._cb().on_protocol_error(f"from {peer.endpoint}: {exc}")
            return
        channel = self._sender(peer.instance_id)
        for offer in decoded.offers:
            if channel.offer is not None and channel.offer.comm_id != offer.comm_id:
                channel = self._replace_sender(peer.instance_id, channel)
            channel.set_offer(offer)
        known = channel.offer.comm_id if channel.offer is not None else None
        chunks = [c for c in decoded.chunks if c.comm_id == known]
        if len(chunks) != len(decoded.chunks):
            self._cb().on_protocol_error(f"from {peer.endpoint}: chunk plan for an unknown communicator")
        lanes = channel.lanes()
        if any(c.lane >= lanes for c in chunks):
            chunks = [c for c in chunks if c.lane < lanes]
            self._cb().on_protocol_error(f"from {peer.endpoint}: chunk plan on a lane the offer lacks")
        was_broken = channel.broken is not None
        if not channel.add_plans(chunks) and not was_broken:  # the janitor fails the channel
            self.board.limit_hit(PLANS_FULL)
            log.error("NCCL send channel with %s broken: %s", peer.endpoint, channel.broken)

    # --- memory -----------------------------------------------------------------------------------------
    def allocate(self, num_bytes: int) -> torch.Tensor:
        """Receive buffers come from a dedicated stream; the channel that writes one marks it with
        ``record_stream`` so the caching allocator never hands it out while a receive is pending."""
        assert self._alloc_stream is not None, "start() first"
        with torch.cuda.stream(self._alloc_stream):
            return torch.empty(num_bytes, dtype=torch.uint8, device=self.device)

    def allocate_zero_copy(self, num_bytes: int) -> torch.Tensor:
        """A flat ``uint8`` buffer that NCCL moves in place on a zero-copy communicator (sender: the
        slab a producer gathers a transfer into; receiver: the slab its layers land in): no staging
        copy on either end, and NCCL writes straight into the receiver's slab. Allocate once per
        shape (e.g. per prompt-length bucket) and reuse: it costs an ``ncclMemAlloc`` now and an IPC
        mapping per communicator at first use. Kept until :meth:`release_zero_copy` or :meth:`close`.
        Ordinary device memory when this NCCL cannot register buffers (< 2.19)."""
        if self.memory is None:
            return self.allocate(num_bytes)
        return self.memory.allocate(num_bytes)

    def release_zero_copy(self, tensor: torch.Tensor) -> None:
        """Free a buffer from :meth:`allocate_zero_copy` once no transfer uses it any more. It is
        deregistered from each live communicator first, which waits for a communicator busy inside
        an NCCL call (at most until the janitor aborts a stalled one, ``stall_timeout_s``). Raises
        ``ValueError`` for a tensor that did not come from :meth:`allocate_zero_copy`."""
        if self.memory is not None:
            self.memory.release(tensor)

    @property
    def zero_copy_bytes(self) -> int:
        """GPU memory held as zero-copy memory: the slabs and the pooled staging buffers (kept until
        :meth:`close`; the pool holds at most what was staged in flight at once)."""
        return self.memory.num_bytes if self.memory is not None else 0

    # --- data -------------------------------------------------------------------------------------------
    def send(self, peer: PeerRef, items: Sequence[SendItem]) -> None:
        self._sender(peer.instance_id).add_items(items)

    def post_recv(self, peer: PeerRef, items: Sequence[RecvItem]) -> None:
        try:
            channel = self._receiver(peer.instance_id)
        except TransferError as exc:
            for transfer_id in {item.transfer_id for item in items}:
                self._cb().on_transfer_failed(transfer_id, f"peer_lost: {exc}")
            return
        channel.add_items(items)

    def cancel(self, transfer_id: str) -> None:
        self._cancelled.add(transfer_id)
        for channel in self._channels():
            channel.cancel(transfer_id)

    def drop_peer(self, peer_instance_id: str) -> None:
        with self._lock:
            dropped = [
                c
                for c in (
                    self._senders.pop(peer_instance_id, None),
                    self._receivers.pop(peer_instance_id, None),
                )
                if c is not None
            ]
            for channel in dropped:
                self._retire(channel)
        _close_all(dropped)

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            self._closed = True
            channels = [*self._senders.values(), *self._receivers.values()]
            self._senders.clear()
            self._receivers.clear()
        _close_all(channels)
        if self._janitor is not None and self._janitor.ident != threading.get_ident():
            self._janitor.stop(5.0)
        if self.memory is not None:
            self.memory.close()

    def chunk_trace(self) -> list[tuple[Any, ...]]:
        """Recent chunks of every channel: (direction, peer, seq, bytes, launch start, launch end,
        completion seen: ``time.perf_counter`` seconds; CPU microseconds the launching thread spent in
        the launch; the launch's step marks, microseconds after its start). For benchmarks and
        debugging: sender marks follow the ready-event waits, the producers, the source address and
        the NCCL group; receiver marks the gate arm, the NCCL group, status copy + event, consumers."""
        with self._lock:
            channels: list[tuple[str, _Channel]] = [("send", c) for c in self._senders.values()]
            channels += [("recv", c) for c in self._receivers.values()]
        return [(kind, c.peer_instance, *row) for kind, c in channels for row in list(c.trace)]

    def send_graph_stats(self) -> dict[str, int]:
        """Captured sends over the open send channels (see :mod:`kvwire.transfer.planes.nccl.graphs`): graphs
        held, captures, replays, and captures given up (a producer raised, or the channel closed)."""
        with self._lock:
            stores = [c.graphs for c in self._senders.values()]
            retired = self._retired_graph_stats.copy()
        return {
            "graphs": sum(len(g) for g in stores),
            "captures": retired["captures"] + sum(g.captures for g in stores),
            "replays": retired["replays"] + sum(g.replays for g in stores),
            "aborted": retired["aborted"] + sum(g.aborted for g in stores),
        }

    def _retire(self, channel: _Channel) -> None:
        """Keep the graph counts of a send channel leaving the tables (``_lock`` held)."""
        if isinstance(channel, SendChannel):
            self._retired_graph_stats["captures"] += channel.graphs.captures
            self._retired_graph_stats["replays"] += channel.graphs.replays
            self._retired_graph_stats["aborted"] += channel.graphs.aborted

    def num_communicators(self) -> int:
        """Open channels (each holds ``lanes`` communicators once joined)."""
        return len(self._channels())

    # --- internals --------------------------------------------------------------------------------------
    def _cb(self) -> PlaneCallbacks:
        assert self._callbacks is not None, "start() first"
        return self._callbacks

    def _channels(self) -> list[_Channel]:
        with self._lock:
            return [*self._senders.values(), *self._receivers.values()]

    def _channel_args(self, peer_instance: str) -> tuple[Any, ...]:
        """What a channel of either direction with ``peer_instance`` is built from."""
        return (peer_instance, self.device, self.plane_config, self._cb(), self._dead, self._cancelled)

    def _sender(self, peer_instance: str) -> SendChannel:
        with self._lock:
            if self._closed:
                raise TransferError("NCCL plane is closed")
            channel = self._senders.get(peer_instance)
            if channel is None:
                channel = SendChannel(*self._channel_args(peer_instance), memory=self.memory)
                self._senders[peer_instance] = channel
                channel.start()
            return channel

    def _replace_sender(self, peer_instance: str, old: SendChannel) -> SendChannel:
        """The receiver started a new communicator (it closed the old one when idle)."""
        old.close(abort=False)
        with self._lock:
            if self._senders.get(peer_instance) is old:
                del self._senders[peer_instance]
                self._retire(old)
        return self._sender(peer_instance)

    def _receiver(self, peer_instance: str) -> RecvChannel:
        evict: _Channel | None = None
        with self._lock:
            if self._closed:
                raise TransferError("NCCL plane is closed")
            channel = self._receivers.get(peer_instance)
            if channel is not None:
                return channel
            if len(self._receivers) >= self.plane_config.max_comms:
                idle = [c for c in self._receivers.values() if not c.inflight and not c.pending]
                if not idle:
                    raise TransferError(f"{self.plane_config.max_comms} NCCL receive channels busy")
                evict = min(idle, key=lambda c: c.last_active)
                del self._receivers[evict.peer_instance]
            channel = RecvChannel(*self._channel_args(peer_instance), memory=self.memory)
            self._receivers[peer_instance] = channel
            channel.start()
        if evict is not None:
            evict.close(abort=False)
        return channel

    def _janitor_loop(self) -> None:
        """Every 50 ms: fail stalled channels (abort), close idle ones. The only thread that never
        waits on NCCL or CUDA, so a channel stuck inside NCCL is still cut off.

        The fail/close of a channel runs on a short-lived daemon helper (not joined): it ends with
        ``channel.close``, which aborts the communicator and joins the channel's threads with a
        timeout, so it is bounded and does not outlive the channel it closes."""
        while not self._stop.wait(timeout=0.05):
            now = time.monotonic()
            for channel in self._channels():
                verdict = channel.check(now)
                if verdict == "idle":
                    target = guarded("kvwire-nccl-close", channel.close_idle, self.board)
                    threading.Thread(target=target, name="kvwire-nccl-close", daemon=True).start()
                elif verdict is not None:
                    log.error("NCCL channel with %s fails (%s)", channel.peer_instance, verdict)
                    target = guarded("kvwire-nccl-fail", channel.fail, self.board)
                    helper = threading.Thread(target=target, args=(verdict,), name="kvwire-nccl-fail")
                    helper.daemon = True
                    helper.start()

    def _dead(self, channel: _Channel, reason: str | None) -> None:
        """A channel closed itself: idle (``reason`` None) or broken (peer failed)."""
        with self._lock:
            for table in (self._senders, self._receivers):
                if table.get(channel.peer_instance) is channel:
                    del table[channel.peer_instance]
                    self._retire(channel)
        if reason is not None:
            self._cb().on_peer_failed(channel.peer_instance, f"peer_lost: NCCL {reason}")
