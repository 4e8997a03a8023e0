"""One worker rank's share of a transfer when P and D run different tensor-parallel sizes.

``tp_map`` says which P rank sends which KV heads to which D rank; this module applies it to one
rank: the pieces it sends or receives for a request (each an agent-level transfer with its own id,
derived from the request's one transfer id), the head slice of a layer a piece carries, and the
bookkeeping that turns piece outcomes into the request's outcome on this rank (finished when every
piece is; failed as soon as one piece fails). In the symmetric plan there is one piece per rank,
under the request's own transfer id, carrying the whole layer: exactly the transfer of before.
"""

from __future__ import annotations

import dataclasses

from kvwire.connector.tp_map import (
    PIECE_SEPARATOR,
    is_identity,
    owned_heads,
    piece_transfer_id,
    plan_pieces,
    received_by,
    sent_by,
)
from kvwire.transfer.memory import PullSlice, head_slice

__all__ = ["head_slice"]  # re-exported: the view lives with the other paged-KV helpers

@dataclasses.dataclass(frozen=True)
class RankPiece:
    transfer_id: str  # the piece's agent-level transfer id
    peer_rank: int  # the other side's rank
    heads: range | None  # this rank's local heads the piece carries (None: the whole layer)
    # D, pull: a piece of a P rank's held layer (what to ask that rank for); None: its whole layer
    source: PullSlice | None = None


def send_pieces(
    transfer_id: str, rank: int, p_tp: int, d_tp: int, num_kv_heads: int | None
) -> tuple[RankPiece, ...]:
    """P rank ``rank``'s pieces (possibly none: a replica another rank sends for it)."""
    pieces = plan_pieces(p_tp, d_tp, num_kv_heads)
    identity = is_identity(pieces)
    return tuple(
        RankPiece(piece_transfer_id(transfer_id, p, identity), p.d_rank, p.src) for p in sent_by(pieces, rank)
    )


def recv_pieces(
    transfer_id: str, rank: int, p_tp: int, d_tp: int, num_kv_heads: int | None
) -> tuple[RankPiece, ...]:
    """D rank ``rank``'s pieces (at least one: every D rank needs its heads)."""
    pieces = plan_pieces(p_tp, d_tp, num_kv_heads)
    identity = is_identity(pieces)
    return tuple(
        RankPiece(piece_transfer_id(transfer_id, p, identity), p.p_rank, p.dst)
        for p in received_by(pieces, rank)
    )


def pull_piece_id(transfer_id: str, p_rank: int, p_tp: int) -> str:
    """Pull mode: P rank ``p_rank`` holds its whole layer under this id (the request's own id when
    P has one rank; suffixed otherwise, so one D rank can pull several P ranks' layers)."""
    return transfer_id if p_tp == 1 else f"{transfer_id}{PIECE_SEPARATOR}p{p_rank}"


def held_pieces(transfer_id: str, rank: int, p_tp: int) -> tuple[RankPiece, ...]:
    """P in pull mode holds each rank's whole layer for D to pull (whole, or in pieces: D's size
    may be unknown to P; see :func:`pull_pieces`)."""
    return (RankPiece(pull_piece_id(transfer_id, rank, p_tp), -1, None),)


def pull_pieces(
    transfer_id: str, rank: int, p_tp: int, d_tp: int, num_kv_heads: int | None
) -> tuple[RankPiece, ...]:
    """D rank ``rank``'s pieces in pull mode. Each P rank holds its whole layer under its pull id
    (P need not know D's size). A P rank whose layer goes whole to this D rank alone is pulled whole,
    as with equal sizes (the wire of before). Otherwise (a split: several D ranks take heads of one
    P rank's layer, or the same replicated heads) this rank pulls a *piece* under its own id: a
    :class:`PullSlice` naming the P rank's held id, the P heads it owns and how many pieces that P
    rank serves in all, so P frees once every piece it served was acknowledged (decision 087)."""
    pieces = plan_pieces(p_tp, d_tp, num_kv_heads)
    out = []
    for piece in received_by(pieces, rank):
        held = pull_piece_id(transfer_id, piece.p_rank, p_tp)
        served = sent_by(pieces, piece.p_rank)
        whole = piece.src is None or (
            num_kv_heads is not None and len(piece.src) == len(owned_heads(piece.p_rank, p_tp, num_kv_heads))
        )
        if len(served) == 1 and whole:
            out.append(RankPiece(held, piece.p_rank, piece.dst))
        else:
            source = PullSlice(held, piece.src, len(served))
            out.append(RankPiece(f"{held}{PIECE_SEPARATOR}d{rank}", piece.p_rank, piece.dst, source))
    return tuple(out)


def pull_releases(
    transfer_id: str, rank: int, p_tp: int, d_tp: int, num_kv_heads: int | None
) -> tuple[tuple[int, str], ...]:
    """Pull mode, KV heads replicated on P: the P ranks whose held layer no D rank needs (another
    replica serves those heads), as (P rank, held id), that D rank ``rank`` releases (rank
    ``p % d_tp`` releases P rank ``p``), so they free their blocks at once."""
    pieces = plan_pieces(p_tp, d_tp, num_kv_heads)
    return tuple(
        (p, pull_piece_id(transfer_id, p, p_tp))
        for p in range(p_tp)
        if p % d_tp == rank and not sent_by(pieces, p)
    )


def pullers(rank: int, p_tp: int, d_endpoints: tuple[str, ...], num_kv_heads: int | None) -> tuple[str, ...]:
    """Pull mode, P knows D (the router named it): the endpoints of the D ranks that pull from P rank
    ``rank``, the only agents its held layer is served to; empty when that rank serves nothing (a
    replica of heads another rank serves: it frees at once)."""
    pieces = plan_pieces(p_tp, len(d_endpoints), num_kv_heads)
    return tuple(sorted({d_endpoints[p.d_rank] for p in sent_by(pieces, rank)}))


@dataclasses.dataclass
class PieceGroup:
    """This rank's pieces of one request's transfer (one side)."""

    request_id: str
    pending: set[str]  # piece transfer ids not finished yet
    failed: bool = False
    first_token: int | None = None  # D, push: P's first token, from the first piece's trailer


class PieceBook:
    """Request transfer id -> this rank's piece group; piece id -> request transfer id."""

    def __init__(self) -> None:
        self._groups: dict[str, PieceGroup] = {}
        self._owner: dict[str, str] = {}

    def add(self, transfer_id: str, request_id: str, piece_ids: list[str]) -> None:
        self._groups[transfer_id] = PieceGroup(request_id, set(piece_ids))
        for pid in piece_ids:
            self._owner[pid] = transfer_id

    def owner(self, piece_id: str) -> str | None:
        return self._owner.get(piece_id)

    def group_of(self, piece_id: str) -> PieceGroup | None:
        tid = self._owner.get(piece_id)
        return None if tid is None else self._groups.get(tid)

    def pieces(self, transfer_id: str) -> set[str]:
        group = self._groups.get(transfer_id)
        return set() if group is None else set(group.pending)

    def finish(self, piece_id: str, failed: bool = False) -> PieceGroup | None:
        """Mark a piece done; the group once its last piece is done (then forgotten), else None.
        A failed piece makes the group failed (the caller ends the other pieces)."""
        tid = self._owner.pop(piece_id, None)
        group = self._groups.get(tid) if tid is not None else None
        if group is None:
            return None
        group.pending.discard(piece_id)
        group.failed |= failed
        if group.pending:
            return None
        del self._groups[tid]  # type: ignore[arg-type]
        return group

    def drop(self, transfer_id: str) -> PieceGroup | None:
        """Forget a request's group (abort); its remaining piece ids are returned in ``pending``."""
        group = self._groups.pop(transfer_id, None)
        if group is not None:
            for pid in group.pending:
                self._owner.pop(pid, None)
        return group

    def __len__(self) -> int:
        return len(self._groups)
