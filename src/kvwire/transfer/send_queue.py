"""Send side, after the grant: granted layers handed to the data plane, and how long it was busy.

An ordered plane (NCCL) takes a receiver's layers in the order it granted them: they wait in that
order, per receiver epoch, and a layer not handed over yet holds the later ones back. Every method
runs with ``core.lock`` held.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable

from kvwire.transfer.core import Core
from kvwire.transfer.send_state import SendState
from kvwire.transfer.types import PeerRef, SendItem, TransferTiming


class SendQueue:
    """Hands the send side's granted layers to the plane (see the module docstring)."""

    def __init__(self, core: Core, sends: dict[str, SendState]) -> None:
        self.core = core
        self.sends = sends
        # ordered planes: per receiver epoch, granted (transfer, layer) in grant order
        self.order: dict[str, collections.deque[tuple[str, int]]] = {}

    def granted(self, st: SendState, new: Iterable[int]) -> None:
        """Layers ``new`` of ``st`` were granted (once each), in grant order."""
        assert st.peer is not None
        if self.core.plane.ordered:
            queue = self.order.setdefault(st.peer.instance_id, collections.deque())
            queue.extend((st.transfer_id, i) for i in new)

    def dispatch(self, st: SendState) -> None:
        """Hand the plane every layer of ``st`` that is granted and handed over, not yet dispatched."""
        if st.peer is None:
            return
        if self.core.plane.ordered:
            self.dispatch_ordered(st.peer)
            return
        ready = sorted(i for i in st.granted if i in st.items and i not in st.dispatched)
        if ready:
            plane = self.core.plane.for_peer(st.peer)
            items = [st.item(i, plane) for i in ready]
            self._handed(st, len(ready))
            st.dispatched.update(ready)
            self.core.plane.send(st.peer, items)

    def dispatch_ordered(self, peer: PeerRef) -> None:
        queue = self.order.get(peer.instance_id)
        batch: list[SendItem] = []
        while queue:
            tid, index = queue[0]
            st = self.sends.get(tid)
            if st is not None and index not in st.items:
                break  # the plane needs this layer next: hold the later ones
            queue.popleft()
            if st is not None:
                self._handed(st, 1)
                st.dispatched.add(index)
                batch.append(st.item(index, self.core.plane.for_peer(peer)))
        if queue is not None and not queue:
            del self.order[peer.instance_id]  # one entry per receiver epoch with granted work, no more
        if batch:
            self.core.plane.send(peer, batch)

    def _handed(self, st: SendState, count: int) -> None:
        now = self.core.now()
        if st.first_dispatch is None:
            st.first_dispatch = now
        if st.in_plane == 0:
            st.busy_since = now
        st.in_plane += count

    def on_sent(self, transfer_id: str, index: int) -> None:
        st = self.sends.get(transfer_id)
        if st is not None and st.in_plane > 0:
            st.in_plane -= 1
            if st.in_plane == 0:
                st.busy_s += self.core.now() - st.busy_since

    def drop_peer(self, peer_id: str) -> None:
        self.order.pop(peer_id, None)

    def timing(self, st: SendState) -> TransferTiming | None:
        if st.first_dispatch is None:
            return None
        num_bytes = sum(spec.num_bytes for spec in st.layers)
        return TransferTiming(num_bytes, self.core.now() - st.first_dispatch, st.busy_s)
