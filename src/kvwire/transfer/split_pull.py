"""Pull mode, one held transfer served in pieces to several receivers (docs/decisions/087).

P and D of different tensor-parallel sizes: in pull mode P holds each rank's whole layer (its
registered paged cache, blocks pinned) without knowing D's size; every D rank that needs heads of it
pulls its own *piece*: a :class:`~kvwire.transfer.control_messages.Pull` naming the held transfer, its own
transfer id for the piece, the head range it owns and how many pieces the held transfer serves in
all. Each piece becomes a *child* send (a :class:`Piece`: a
:class:`~kvwire.transfer.send_state.SendState` bound to that receiver: offer, credit, leases, acks as
any send) whose layers are the held blocks narrowed to the piece's heads, so no receiver gets bytes
it throws away.

The held transfer (the *parent*) is reported to the caller once: finished when every one of its
``pieces`` children was acknowledged; failed as soon as one child fails (the other children are
then failed too, their receivers told), or when not every piece was pulled by the parent's lease.
Once all pieces are pulled, the children's leases (renewed by their receivers) bound the wait.

A release (``pieces == 0``) ends a held transfer nobody needs (a replica of KV heads another P rank
serves) as finished at once. Every method runs with ``core.lock`` held (the sender's caller).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from kvwire.transfer.block_copy import HEAD_DIM
from kvwire.transfer.control_messages import Pull
from kvwire.transfer.enums import FailReason, KVLayout
from kvwire.transfer.lease import Lease
from kvwire.transfer.peer_table import PeerTable
from kvwire.transfer.send_state import HeldBlocks, SendState
from kvwire.transfer.stats import ControlLimit
from kvwire.transfer.types import LayerSpec, TransferTiming

if TYPE_CHECKING:
    from kvwire.transfer.sender import Sender

SIDE = "send"
MISMATCH = FailReason.MISMATCH.value
NOT_BLOCKS = f"{MISMATCH}: only a transfer of blocks can be pulled in pieces"


@dataclasses.dataclass
class Split:
    """A held transfer's pieces (on the parent ``SendState``)."""

    pieces: int  # how many pulls it serves in all (from its first pull)
    children: set[str] = dataclasses.field(default_factory=set)  # started pieces' transfer ids
    done: set[str] = dataclasses.field(default_factory=set)
    num_bytes: int = 0
    busy_s: float = 0.0
    first_dispatch: float | None = None
    waiting: list[Pull] = dataclasses.field(default_factory=list)  # came before any layer

    @property
    def all_pulled(self) -> bool:
        return len(self.children) >= self.pieces


@dataclasses.dataclass
class Piece(SendState):
    """One piece of a held transfer: a send to the receiver that pulled it."""

    parent: str = ""  # the held transfer's id
    heads: range | None = None  # the KV heads of the held layers it carries


class SplitPulls:
    """The sender's piece pulls (see the module docstring)."""

    def __init__(self, sender: Sender) -> None:
        self.sender = sender
        self.core = sender.core
        limits = self.core.config.limits
        # piece pulls before start_send: (held id, piece id) -> (pull, until); bounded per puller and in all
        self.early: PeerTable[tuple[str, str], tuple[Pull, float]] = PeerTable(
            limits.max_pending_per_peer, limits.max_pending_pulls, ControlLimit.PENDING_PER_PEER,
            ControlLimit.PENDING_PULLS,
        )  # fmt: skip

    # --- pulls -------------------------------------------------------------------------------------------

    def on_pull(self, msg: Pull) -> None:
        parent = self.sender.sends.get(msg.held)
        if parent is None:
            self._unheld(msg)
            return
        refusal = self._refusal(parent, msg)
        if refusal is not None:
            self._refuse(msg, refusal)
            return
        if msg.pieces == 0:
            self._release(parent)
            return
        split = parent.split = parent.split or Split(msg.pieces)
        if msg.pieces != split.pieces:
            reason = f"{MISMATCH}: pulls disagree on the piece count ({split.pieces}, {msg.pieces})"
            self._refuse(msg, reason)
            self.sender.fail(parent.transfer_id, reason, notify=True)
            return
        if not parent.items:
            if len(split.waiting) + len(split.children) >= split.pieces:
                self._refuse(msg, "every piece was pulled already")  # (waiting: no more than it serves)
                return
            split.waiting.append(msg)  # the layout is known from the first layer handed over
            return
        self._start_child(parent, split, msg)

    def _refusal(self, parent: SendState, msg: Pull) -> str | None:
        if parent.endpoint is not None or isinstance(parent, Piece):
            return "already pulled by another peer"
        if parent.pull_by is not None and msg.src_endpoint not in parent.pull_by:
            self.core.stats.add("offers_refused")
            self.core.refusals.refused("wrong_peer", f"pull of {msg.held} from {msg.src_endpoint}")
            return "not this transfer's peer"
        if parent.with_trailer:
            return f"{MISMATCH}: a transfer with a trailer cannot be pulled in pieces"
        split = parent.split
        if split is not None and msg.pieces and split.all_pulled:
            return "every piece was pulled already"
        if split is not None and split.children and msg.pieces == 0:
            return f"{MISMATCH}: released after pieces were pulled"
        taken = msg.transfer_id in self.sender.sends or self.core.tombstones.get(SIDE, msg.transfer_id)
        if msg.pieces and (taken or msg.transfer_id == msg.held):
            return "piece transfer id already in use"
        return None

    def _refuse(self, msg: Pull, reason: str) -> None:
        if msg.pieces:  # a release has no transfer on the puller's side
            self.core.send_abort(msg.src_endpoint, msg.transfer_id, reason, msg.src_id)

    def _unheld(self, msg: Pull) -> None:
        ended = self.core.tombstones.get(SIDE, msg.held)
        if ended is not None:
            self._refuse(msg, ended if ended != "done" else "already pulled by another peer")
            return
        key = (msg.held, msg.transfer_id)
        limit = self.early.admit(key, msg.src_endpoint)
        if limit is not None:
            self.core.stats.limit_hit(limit)
            self._refuse(msg, f"too many pending pulls ({limit.value})")
            return
        # the pull overtook start_send: hold it until the puller's (clamped) deadline
        until = self.core.now() + self.core.peer_deadline(msg.deadline_s)
        self.early.put(key, msg.src_endpoint, (msg, until))

    def started(self, parent: SendState) -> None:
        """``start_send`` of a held transfer: serve the piece pulls that came before it."""
        if not len(self.early):
            return
        for key, (msg, _) in self.early.items():
            if key[0] == parent.transfer_id:
                self.early.pop(key)
                self.on_pull(msg)

    def _release(self, parent: SendState) -> None:
        """Nobody needs this held transfer: it ends as finished (its blocks can be freed)."""
        del self.sender.sends[parent.transfer_id]
        self.core.events.sent(parent.transfer_id, None)
        self.core.stats.add("sends_completed")
        self.core.tombstones.add(SIDE, parent.transfer_id, "done")

    # --- children ----------------------------------------------------------------------------------------

    def _start_child(self, parent: SendState, split: Split, msg: Pull) -> None:
        first = next(iter(parent.items.values()))
        blocks = all(isinstance(i, HeldBlocks) for i in parent.items.values())
        if not isinstance(first, HeldBlocks) or not blocks:
            self._refuse(msg, NOT_BLOCKS)
            return
        layout = first.paged.layout
        heads = range(msg.heads[0], msg.heads[1]) if msg.heads else None
        layers = _narrowed(parent.layers, layout, heads)
        if layers is None:
            self._refuse(msg, f"{MISMATCH}: heads {msg.heads} not held ({layout.value})")
            return
        now = self.core.now()
        lease_s = min(self.core.peer_deadline(msg.deadline_s), parent.lease.lease_s)
        lease = Lease.start(now, lease_s, max(parent.lease.limit - now, 0.0))
        child = Piece(
            msg.transfer_id, lease, layers, False, msg.src_endpoint, parent=parent.transfer_id,
            heads=heads, last_progress=now,
        )  # fmt: skip
        split.children.add(child.transfer_id)
        self.sender.sends[child.transfer_id] = child
        self.core.stats.add("sends_started")
        self._copy_layers(parent, child)
        self.sender.offer(child)

    def layer_added(self, parent: SendState) -> None:
        """A layer of a held transfer was handed over: its pieces get it too; pulls that waited for
        the first layer start now."""
        split = parent.split
        if split is None:
            return
        for child_id in list(split.children):
            child = self.sender.sends.get(child_id)
            if child is not None:
                self._copy_layers(parent, child)
            if child_id in self.sender.sends:  # (copying fails the held transfer if it cannot be split)
                self.sender.dispatch(self.sender.sends[child_id])
        waiting, split.waiting = split.waiting, []
        for msg in waiting:
            if parent.transfer_id in self.sender.sends:
                self._start_child(parent, split, msg)

    def _copy_layers(self, parent: SendState, child: SendState) -> None:
        assert isinstance(child, Piece)
        for index, item in parent.items.items():
            if index in child.items:
                continue
            if not isinstance(item, HeldBlocks):
                reason = NOT_BLOCKS
                self.sender.fail(parent.transfer_id, reason, notify=True)
                return
            child.items[index] = HeldBlocks(item.paged.heads(child.heads), item.block_ids, item.ready_event)
            child.last_progress = self.core.now()

    def piece_done(self, child: Piece, timing: TransferTiming | None) -> None:
        """A piece completed: count it (its held transfer reports once all its pieces are done)."""
        parent = self.sender.sends.get(child.parent)
        split = parent.split if parent is not None else None
        if parent is not None and split is not None:
            self._count_piece(parent, split, child, timing)

    def _count_piece(
        self, parent: SendState, split: Split, child: Piece, timing: TransferTiming | None
    ) -> None:
        split.done.add(child.transfer_id)
        if timing is not None:
            split.num_bytes += timing.num_bytes
            split.busy_s += timing.busy_seconds or 0.0
        if child.first_dispatch is not None:
            split.first_dispatch = min(split.first_dispatch or child.first_dispatch, child.first_dispatch)
        if len(split.done) < split.pieces:
            return
        del self.sender.sends[parent.transfer_id]
        total = None
        if split.first_dispatch is not None:
            total = TransferTiming(split.num_bytes, self.core.now() - split.first_dispatch, split.busy_s)
        self.core.events.sent(parent.transfer_id, total)
        self.core.stats.add("sends_completed")
        self.core.tombstones.add(SIDE, parent.transfer_id, "done")

    def failed(self, st: SendState, reason: str) -> None:
        """A send failed. A piece: the held transfer fails (its other pieces with it). A held
        transfer: every piece still in flight ends, its receiver told."""
        if isinstance(st, Piece):
            self.sender.fail(st.parent, f"{reason} (piece {st.transfer_id})", notify=False)
        if st.split is None:
            return
        for child_id in sorted(st.split.children - st.split.done):
            self.sender.fail(child_id, reason, notify=True)

    # --- time --------------------------------------------------------------------------------------------

    @staticmethod
    def keeps_lease(parent: SendState) -> bool:
        """A held transfer whose every piece was pulled no longer expires itself: its pieces'
        leases (renewed by their receivers) bound it."""
        return parent.split is not None and parent.split.all_pulled

    def expire(self, now: float) -> None:
        for key, (msg, until) in self.early.items():
            if until <= now:
                self.early.pop(key)
                self._refuse(msg, FailReason.UNKNOWN.value)


def _narrowed(layers: list[LayerSpec], layout: KVLayout, heads: range | None) -> list[LayerSpec] | None:
    """The held layers' payload restricted to ``heads`` (None when it has no such heads)."""
    if heads is None:
        return list(layers)
    dim = HEAD_DIM.get(layout)
    if dim is None:
        return None
    out = []
    for spec in layers:
        if len(spec.shape) <= dim or heads.stop > spec.shape[dim]:
            return None
        shape = list(spec.shape)
        shape[dim] = len(heads)
        out.append(LayerSpec(tuple(shape), spec.dtype))
    return out
