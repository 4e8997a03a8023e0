"""Credit: the receive side grants layers from its memory budget; early grants on both sides.

A receiver grants a layer (a :class:`~kvwire.transfer.control_messages.Grant`) once it posted where the layer
lands: the caller's spans or blocks (in place), or a buffer reserved from the receive budget or the
spill pool. :class:`Credit` keeps the FIFO of transfers waiting for credit and runs the grant pass
(no transfer overtakes one that waits for memory). It also grants every layer *early*, before the
sender's Offer, where that is safe (decision 110), and checks the Offer against that grant.

The send side keeps an early grant of a transfer it has not started yet (:class:`EarlyGrants`),
bounded per receiver and in all, while that receiver renews it. Every method runs with ``core.lock``.
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING

import msgspec
import torch

from kvwire.transfer.buffers import BufferKind
from kvwire.transfer.control_messages import Grant, Renew
from kvwire.transfer.core import Core
from kvwire.transfer.enums import FailReason
from kvwire.transfer.peer_table import PeerTable
from kvwire.transfer.recv_state import RecvState
from kvwire.transfer.stats import ControlLimit
from kvwire.transfer.types import ByteSpans, DeviceConsumer, LayerSpec, PeerRef, RecvItem

if TYPE_CHECKING:
    from kvwire.transfer.receiver import Receiver

_NO_DEST = torch.empty(0, dtype=torch.uint8)
MAX_KEPT_PLANE_INFO = 64 * 1024  # an early Grant with a larger plane handshake is not kept (not needed)


class Credit:
    """The receiver's grants (see the module docstring)."""

    def __init__(self, receiver: Receiver) -> None:
        self.receiver = receiver
        self.core: Core = receiver.core
        self.queue: collections.deque[str] = collections.deque()  # FIFO of transfers wanting credit

    def offered(self, st: RecvState) -> None:
        """The Offer of ``st`` was taken: queue its layers not granted early, and grant what fits."""
        assert st.specs is not None
        if st.early:
            self._check_early(st)
        st.to_grant.extend(i for i in range(len(st.specs)) if i not in st.early)
        self.queue.append(st.transfer_id)
        self.grant_pass()

    def grant_pass(self) -> None:
        """Reserve memory for waiting layers in FIFO order; post buffers, then send Grants."""
        recvs = self.receiver.table
        while self.queue:
            st = recvs.get(self.queue[0])
            if st is None or not st.to_grant or st.specs is None or st.peer is None:
                self.queue.popleft()
                continue
            items = self._grantable(st, st.specs)
            if items and st.transfer_id in recvs:
                self._grant(st, items)
            if st.transfer_id in recvs and st.to_grant:
                return  # out of memory: later transfers wait too (FIFO, no starvation)

    def _grantable(self, st: RecvState, specs: list[LayerSpec]) -> list[RecvItem]:
        """Take layers off ``st.to_grant`` while each has somewhere to land; stop at the first that
        has not (out of memory) or when the transfer failed."""
        memory = self.core.memory
        items: list[RecvItem] = []
        while st.to_grant:
            index = st.to_grant[0]
            num_bytes = specs[index].num_bytes
            in_place = self._in_place(st, index, num_bytes)
            if in_place == "spans" or (
                st.expected and st.scatter_into is not None and self.core.plane.supports_spans
            ):
                item = self._span_item(st, index, num_bytes)
                if item is None:
                    break
                st.to_grant.popleft()
                st.granted[index] = None
                items.append(item)
                continue
            if num_bytes > memory.capacity_bytes:
                reason = f"{FailReason.BUDGET.value}: layer of {num_bytes} bytes never fits"
                self.receiver.fail(st.transfer_id, reason, True)
                break
            buf = memory.reserve(num_bytes)
            if buf is None:
                self.core.stats.add("credit_waits")
                break
            if buf.kind is BufferKind.SPILL:
                self.core.stats.add("spilled_layers")
            st.to_grant.popleft()
            st.granted[index] = buf
            consumer = None
            if in_place == "device" and buf.kind is not BufferKind.SPILL:
                consumer = self._consumer(st)
                st.consumed.add(index)
            dest = buf.tensor[:num_bytes]
            items.append(RecvItem(st.transfer_id, index, num_bytes, dest, on_device=consumer))
        return items

    def _in_place(self, st: RecvState, index: int, num_bytes: int) -> str | None:
        """How layer ``index`` of an ``into_blocks`` transfer lands without a host copy: "spans"
        (the plane writes into the blocks), "device" (the plane's stream scatters behind the receive),
        or None (buffered, then the sink copies)."""
        paged, target = st.paged, st.target
        if not st.expected or paged is None or target is None or st.peer is None:
            return None
        plane = self.core.plane.for_peer(st.peer)  # the plane negotiated with the sender
        if not paged.takes_exactly(target, index, num_bytes):
            return None
        if plane.supports_spans and paged.contiguous:
            return "spans"
        if plane.supports_device_consumers and paged.device_paths():
            return "device"
        return None

    def _consumer(self, st: RecvState) -> DeviceConsumer:
        if st.consumer is None:
            assert st.paged is not None and st.target is not None
            st.consumer = st.paged.consumer(st.target)
        return st.consumer

    def _spans(self, st: RecvState, index: int) -> ByteSpans | None:
        """Where layer ``index`` lands (``scatter_into`` or the target blocks); None: the transfer failed."""
        try:
            if st.scatter_into is not None:
                return st.scatter_into(index)
            assert st.paged is not None and st.target is not None
            return st.paged.spans(index, st.target.block_ids)
        except Exception as exc:
            reason = f"{FailReason.MISMATCH.value}: scatter_into({index}): {exc!r}"
            self.receiver.fail(st.transfer_id, reason, True)
            return None

    def _span_item(self, st: RecvState, index: int, num_bytes: int) -> RecvItem | None:
        spans = self._spans(st, index)
        if spans is None:
            return None
        if spans.num_bytes != num_bytes:
            reason = (
                f"{FailReason.MISMATCH.value}: layer {index} spans hold {spans.num_bytes}, sender {num_bytes}"
            )
            self.receiver.fail(st.transfer_id, reason, True)
            return None
        return RecvItem(st.transfer_id, index, num_bytes, _NO_DEST, dest_spans=spans)

    def _grant(self, st: RecvState, items: list[RecvItem], early: bool = False) -> Grant:
        assert st.peer is not None
        # posted before the Grant leaves: a fast sender finds its buffers
        data_address, plane_info = self.core.plane.post_grant(st.peer, items)
        msg = Grant(
            **self.core.header(st.peer.endpoint, st.transfer_id, st.peer.instance_id),
            layers=[item.layer_index for item in items],
            data_address=data_address,
            plane_info=plane_info,
            early=early,
            sizes=[item.num_bytes for item in items] if early else [],
        )
        self.core.send(st.peer.endpoint, msg)
        return msg

    # --- early grants (decision 110) ---------------------------------------------------------------------

    def grant_early(self, st: RecvState) -> None:
        """Grant every layer now, before the sender's Offer (decision 110), when that is safe: push
        mode with the sender's endpoint given (``expect(sender=...)``) and its epoch known (an
        earlier contact), layers that land in spans (``scatter_into``, or ``into_blocks`` whose
        blocks are whole and contiguous), and a plane negotiated with that sender that takes early
        grants. The sender then starts writing as soon as it has a layer, without the Offer -> Grant
        round trip. The Offer is checked against what was granted when it comes."""
        peer = self._early_peer(st)
        if peer is None or st.num_layers is None:
            return
        plane = self.core.plane.for_peer(peer)
        if not (plane.early_grants and plane.supports_spans):
            return
        items: list[RecvItem] = []
        for index in range(st.num_layers):
            spans = self._spans(st, index)
            if spans is None:
                return  # failed (the target could not say where the layer goes)
            items.append(RecvItem(st.transfer_id, index, spans.num_bytes, _NO_DEST, dest_spans=spans))
        st.peer = peer
        for item in items:
            st.granted[item.layer_index] = None
            st.early[item.layer_index] = item.num_bytes
        st.early_grant = self._grant(st, items, early=True)
        self.core.stats.add("early_grants")

    def _early_peer(self, st: RecvState) -> PeerRef | None:
        """The sender an early grant of ``st`` would go to (None: not safe to grant early)."""
        if not st.expected or st.specs is not None or st.peer is not None or st.sender is None:
            return None
        if st.pull_from is not None or st.num_layers is None:
            return None
        if st.scatter_into is None and (
            st.paged is None or st.target is None or not st.paged.contiguous or st.target.skip_blocks
        ):
            return None
        sender_id = st.sender_id or self.core.peer_ids.get(st.sender)
        return PeerRef(st.sender, sender_id, "") if sender_id else None

    def _check_early(self, st: RecvState) -> None:
        """The Offer of an early-granted transfer. Layers the sizes granted: the grant is sent again
        as an ordinary one (a sender that did not keep it gets it now; one that used it finds
        nothing new in it). Other sizes (P sends more blocks than D takes, say): the sender did not
        use the grant (it checks the sizes), so nothing was written under it; the layers are
        granted afresh, the ordinary way, and the new posts replace the early ones."""
        assert st.specs is not None and st.peer is not None
        fits = all(
            index < len(st.specs) and st.specs[index].num_bytes == num_bytes
            for index, num_bytes in st.early.items()
        )
        if not fits:
            self.forget_early(st)
            return
        grant, st.early_grant = st.early_grant, None
        if grant is not None:
            self.core.send(st.peer.endpoint, msgspec.structs.replace(grant, early=False, sizes=[]))

    def forget_early(self, st: RecvState) -> None:
        """Drop a transfer's early grant (its layers are granted again the ordinary way, on the
        Offer); counted in ``early_grants_unused``."""
        for index in st.early:
            st.granted.pop(index, None)
        st.early.clear()
        st.early_grant = None
        self.core.stats.add("early_grants_unused")


class EarlyGrants:
    """The send side's early grants of transfers not started yet: transfer id -> (grant, when its
    receiver was last heard of); bounded per receiver and in all (decision 110)."""

    def __init__(self, core: Core) -> None:
        self.core = core
        limits = core.config.limits
        self.table: PeerTable[str, tuple[Grant, float]] = PeerTable(
            limits.max_early_grants_per_peer, limits.max_early_grants, ControlLimit.EARLY_GRANTS_PER_PEER,
            ControlLimit.EARLY_GRANTS,
        )  # fmt: skip

    def keep(self, msg: Grant, ended: bool) -> bool:
        """Keep an early grant of a transfer not started yet (True), unless it already ``ended``
        here, is not the shape of one (more layers than a transfer has, sizes that do not match them,
        an outsized plane handshake) or too many are kept (False: answered as an unknown transfer;
        the receiver grants again on the Offer)."""
        if ended:
            return False
        shaped = len(msg.layers) == len(msg.sizes) <= self.core.config.max_layers_per_transfer
        if not shaped or len(msg.plane_info) > MAX_KEPT_PLANE_INFO:
            return False
        limit = self.table.admit(msg.transfer_id, msg.src_endpoint)
        if limit is not None:
            self.core.stats.limit_hit(limit)
            return False
        self.table.put(msg.transfer_id, msg.src_endpoint, (msg, self.core.now()))
        return True

    def take(self, transfer_id: str) -> Grant | None:
        """The early grant kept for ``transfer_id`` (which starts now), once."""
        entry = self.table.pop(transfer_id)
        return entry[0] if entry is not None else None

    def heard(self, msg: Renew) -> bool:
        """The receiver of an early grant kept here renews its transfer: it still waits for it."""
        early = self.table.get(msg.transfer_id)
        if early is None or early[0].src_endpoint != msg.src_endpoint:
            return False
        self.table.put(msg.transfer_id, msg.src_endpoint, (early[0], self.core.now()))
        return True

    def aborted(self, transfer_id: str, src_endpoint: str) -> None:
        """The receiver of an early grant gave the transfer up: drop the grant."""
        early = self.table.get(transfer_id)
        if early is not None and early[0].src_endpoint == src_endpoint:
            self.table.pop(transfer_id)

    def expire(self, now: float) -> None:
        """An early grant lives while its receiver renews it (it renews well within its deadline)."""
        quiet = self.core.config.default_deadline_s
        for tid, (_, heard) in self.table.items():
            if now - heard > quiet:
                self.table.pop(tid)

    def clear(self) -> None:
        self.table.clear()

    def __contains__(self, transfer_id: object) -> bool:
        return transfer_id in self.table

    def items(self) -> list[tuple[str, tuple[Grant, float]]]:
        return list(self.table.items())


def early_grant_fits(layers: list[LayerSpec], grant: Grant) -> bool:
    """An early grant (decision 110) is used only if every layer it grants is the size granted."""
    sizes = [layers[i].num_bytes if 0 <= i < len(layers) else -1 for i in grant.layers]
    return sizes == grant.sizes
