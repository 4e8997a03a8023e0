"""CUDA IPC data plane: the sender copies straight into the receiver's GPU memory (same host).

Flow (push and pull alike, after the agents negotiated ``ipc``, decision 077)::

    receiver  post_recv: export the allocation under each destination (CUDA IPC handle, cached),
              queue Dest(transfer, layer, handle, spans relative to the allocation base)
              local_info -> the Grant's plane_info carries those Dests
    sender    on_peer_info: remember the Dests; send(): map the handle once per peer epoch
              (cuIpcOpenMemHandle), copy the source byte runs straight into the mapped blocks
              (paged -> paged, no staging: coalesced runs, one Triton launch per group of layers,
              behind a launch gate), batch the queued layers; a completer thread waits for each
              batch on the GPU, then DONE(transfer, layers) on the link
    receiver  link reader: DONE -> on_received

The link is an abstract Unix socket (as the shared-memory plane's: same hello and secret); it
carries only DONE frames and shows a dead peer as EOF (``peer_lost``). The sender closes every
mapping of a peer when the peer is dropped (loss, restart, close). An exporter that dies never
crashes the importer: the driver keeps a mapped allocation alive until the importer unmaps it.

Limits (decision 077): completion costs a host wait per batch
(no interprocess CUDA events yet); destinations must be device memory (a host spill buffer fails the
transfer: size ``recv_budget_bytes`` to hold what is in flight, or receive into paged spans); a
receiver-side cancel cannot stop a copy the sender has already enqueued (at most one batch lands
after it); PyTorch's ``expandable_segments`` memory has no IPC handle.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Sequence

import msgspec
import numpy as np
import torch

from kvwire.supervision import HealthBoard
from kvwire.transfer.config import TransferConfig
from kvwire.transfer.memory import PeerRef, RecvItem, SendItem
from kvwire.transfer.planes.base import GrantedDests, UnixLinkPlane, take_granted
from kvwire.transfer.planes.common.runs import spans_array
from kvwire.transfer.planes.common.wire import shutdown
from kvwire.transfer.planes.ipc.copy import CopyTuning
from kvwire.transfer.planes.ipc.grants import Dest, GrantInfo, ImportTable, Target
from kvwire.transfer.planes.ipc.link import IpcInbound, IpcOutbound

_JOIN_S = 5.0
_NO_SPANS = np.empty((0, 2), dtype=np.int64)


class _PendingGrant:
    """Destinations posted for one peer since its last Grant; layers with the same spans (the same
    block ids in caches of one geometry: ``block_spans`` hands out one tuple) share one span set."""

    def __init__(self) -> None:
        self.dests: list[Dest] = []
        self._sets: list[tuple[tuple[int, int], ...]] = []
        self._index: dict[int, int] = {}  # id(spans tuple) -> span set (the tuples stay referenced)

    def span_set(self, spans: tuple[tuple[int, int], ...]) -> int:
        index = self._index.get(id(spans))
        if index is None:
            index = self._index[id(spans)] = len(self._sets)
            self._sets.append(spans)
        return index

    def info(self) -> GrantInfo:
        return GrantInfo(self.dests, [spans_array(s).astype("<i8").tobytes() for s in self._sets])


class IpcPlane(UnixLinkPlane[IpcOutbound]):
    """CUDA IPC data plane for GPU tensors of processes on one host."""

    ordered = False
    supports_spans = True

    link_kind = "ipc"

    def __init__(self, config: TransferConfig, instance_id: str, board: HealthBoard | None = None) -> None:
        super().__init__(config, instance_id, board)
        device = torch.device(config.device)
        if device.type == "cuda" and device.index is None:  # "cuda": the process's current device
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.posted: dict[tuple[str, int], str] = {}  # receiver: (transfer, layer) -> peer id
        self.dests: GrantedDests[Target] = GrantedDests(self.board, config.links)  # sender: granted
        self._pending: dict[str, _PendingGrant] = {}  # receiver: what the next Grant to a peer carries
        self._exported: dict[int, bytes] = {}  # allocation base -> its IPC handle
        self.imports = ImportTable(self._open, self._close)
        self.tuning = CopyTuning()

    # --- lifecycle (start, close, accepting links: UnixLinkPlane) --------------------------------

    def _inbound_link(self, conn: socket.socket) -> IpcInbound:
        return IpcInbound(self, conn)

    def _closed(self) -> None:
        with self.lock:
            self.imports.close_all()

    def allocate(self, num_bytes: int) -> torch.Tensor:
        return torch.empty(num_bytes, dtype=torch.uint8, device=self.device)

    # --- handles -----------------------------------------------------------------------------------

    def _open(self, handle: bytes) -> int:
        from kvwire.transfer.planes.ipc.cuda_ipc import open_handle

        torch.cuda.set_device(self.device)
        return open_handle(handle)

    def _close(self, address: int) -> None:
        from kvwire.transfer.planes.ipc.cuda_ipc import close_handle

        torch.cuda.set_device(self.device)
        close_handle(address)

    def _dest(self, item: RecvItem, grant: _PendingGrant) -> Dest:
        """Export the allocation under ``item``'s destination (once) and describe the spans."""
        from kvwire.transfer.planes.ipc.cuda_ipc import allocation_of, export_handle

        if item.dest_spans is not None:
            base, spans = item.dest_spans.base, item.dest_spans.spans
        else:
            base, spans = item.dest, ((0, item.num_bytes),)
        if base.device.type != "cuda":
            return Dest(item.transfer_id, item.layer_index, b"", 0, -1)  # the sender fails it
        torch.cuda.set_device(base.device)
        alloc, _ = allocation_of(base)
        handle = self._exported.get(alloc)
        if handle is None:
            handle = self._exported[alloc] = export_handle(alloc)
        shift = base.data_ptr() - alloc
        return Dest(item.transfer_id, item.layer_index, handle, shift, grant.span_set(spans))

    # --- receiver side -----------------------------------------------------------------------------

    def post_recv(self, peer: PeerRef, items: Sequence[RecvItem]) -> None:
        with self.lock:
            grant = self._pending.setdefault(peer.instance_id, _PendingGrant())
            for item in items:
                try:
                    dest = self._dest(item, grant)
                except Exception:  # no handle (e.g. VMM memory): the sender fails the layer
                    dest = Dest(item.transfer_id, item.layer_index, b"", 0, -1)
                grant.dests.append(dest)
                self.posted[(item.transfer_id, item.layer_index)] = peer.instance_id

    def local_info(self, peer: PeerRef) -> bytes:
        with self.lock:
            grant = self._pending.pop(peer.instance_id, None)
        return msgspec.msgpack.encode(grant.info()) if grant is not None and grant.dests else b""

    def done(self, peer_id: str, transfer_id: str, layer: int) -> bool:
        """A DONE frame arrived: True when it completes a layer posted for that peer."""
        with self.lock:
            if self.posted.get((transfer_id, layer)) != peer_id:
                return False  # none, or another peer's: left as it is (decision 126)
            del self.posted[(transfer_id, layer)]
            return True

    # --- sender side -------------------------------------------------------------------------------

    def on_peer_info(self, peer: PeerRef, info: bytes) -> None:
        try:
            grant = msgspec.msgpack.decode(info, type=GrantInfo)
            arrays = grant.arrays()
            targets = [
                (d, Target(d.handle, d.shift, arrays[d.span_set] if d.handle else _NO_SPANS))
                for d in grant.dests
            ]
        except (msgspec.DecodeError, ValueError, IndexError, RecursionError):
            self.callbacks.on_protocol_error(f"IPC plane info from {peer.endpoint} does not decode")
            return
        with self.lock:
            refused = self.dests.put(peer.instance_id, [((d.transfer_id, d.layer), t) for d, t in targets])
        if refused:  # those layers fail: no destination granted
            self.callbacks.on_protocol_error(f"IPC plane info from {peer.endpoint}: {refused} destination(s) "
                                             "over the cap")

    def send(self, peer: PeerRef, items: Sequence[SendItem]) -> None:
        with self.lock:
            if self.closing.is_set():
                return
            out = self.outbound.get(peer.instance_id)
            if out is None or out.dead:
                out = IpcOutbound(self, peer)
                self.outbound[peer.instance_id] = out
                out.thread.start()
        for item in items:
            out.queue.put(item)

    def take_dest(self, peer_id: str, transfer_id: str, layer: int) -> Target | None:
        return take_granted(self.lock, self.dests, peer_id, (transfer_id, layer))

    def cancel(self, transfer_id: str) -> None:
        with self.lock:
            self._note_cancelled(transfer_id)
            for key in [k for k in self.posted if k[0] == transfer_id]:
                del self.posted[key]
            self.dests.drop_transfer(transfer_id)

    def drop_peer(self, peer_instance_id: str) -> None:
        with self.lock:
            out = self.outbound.pop(peer_instance_id, None)
            inbound = [c for c, pid in self.inbound.items() if pid == peer_instance_id]
            for key in [k for k, pid in self.posted.items() if pid == peer_instance_id]:
                del self.posted[key]
            self.dests.drop_peer(peer_instance_id)
            self._pending.pop(peer_instance_id, None)
        if out is not None:
            out.stop()  # its thread unmaps the peer's allocations when it ends
        else:
            with self.lock, contextlib.suppress(Exception):
                self.imports.close_peer(peer_instance_id)
        for conn in inbound:
            shutdown(conn)
