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
    piece_transfer_id,
    plan_pieces,
    received_by,
    sent_by,
)
from kvwire.errors import ConfigError
from kvwire.transfer.paged import head_slice

__all__ = ["head_slice"]  # re-exported: the view lives with the other paged-KV helpers

@dataclasses.dataclass(frozen=True)
class RankPiece:
    transfer_id: str  # the piece's agent-level transfer id
    peer_rank: int  # the other side's rank
    heads: range | None  # this rank's local heads the piece carries (None: the whole layer)


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
    """P in pull mode does not know D's size: each rank holds its whole layer for D to pull."""
    return (RankPiece(pull_piece_id(transfer_id, rank, p_tp), -1, None),)


def pull_pieces(
    transfer_id: str, rank: int, p_tp: int, d_tp: int, num_kv_heads: int | None
) -> tuple[RankPiece, ...]:
    """D's pieces in pull mode. P held its whole layer under the request's transfer id (it did not
    know D's size), so each piece must be a whole P rank's layer, pulled by one D rank only:
    P's size a multiple of D's, with no KV head replicated on P. Raises ConfigError otherwise."""
    pieces = plan_pieces(p_tp, d_tp, num_kv_heads)
    whole = is_identity(pieces) or (num_kv_heads is not None and p_tp % d_tp == 0 and p_tp <= num_kv_heads)
    if not whole:
        raise ConfigError(
            f"pull mode from TP {p_tp} to TP {d_tp} needs P's size to be a multiple of D's without "
            "replicated KV heads on P (use push mode)"
        )
    # Each piece is then one P rank's whole layer, held under its pull id.
    return tuple(
        RankPiece(pull_piece_id(transfer_id, p.p_rank, p_tp), p.p_rank, p.dst)
        for p in received_by(pieces, rank)
    )


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
