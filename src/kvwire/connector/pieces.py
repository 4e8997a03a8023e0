"""Which KV heads each tensor-parallel rank holds, which P rank sends which heads to which D rank, and
one worker rank's share of a transfer (its *pieces*).

The map (pure functions; the built-in engine's TP sharding and the vLLM plugin use it too):
Ownership (Megatron-style, as vLLM and the built-in engine shard attention): with ``H`` KV heads and
TP size ``N``, rank ``r`` holds heads ``[r*H/N, (r+1)*H/N)`` when ``N`` divides ``H``; when ``H``
divides ``N`` (fewer KV heads than ranks) each head is *replicated* on ``N/H`` consecutive ranks and
rank ``r`` holds the single head ``r*H // N``.

A transfer from a P instance of TP size ``Np`` to a D instance of TP size ``Nd`` is a set of
:class:`Piece` s: for each D rank, the heads it owns, each taken from one P rank that holds it
(among replicas, the one with index ``d_rank % replicas``: spreads the reads over the replicas).
Consecutive heads from the same P rank form one piece. Every D rank receives exactly its heads, no
rank receives bytes it throws away, and the sum of the pieces' heads is ``Nd``'s KV size.

MLA layouts have no head dimension (one latent per token, the same on every rank): each D rank gets
the whole layer from P rank ``d % Np`` (``num_kv_heads=None``).

One rank's share: the pieces it sends or receives for a request (each an agent-level transfer with its
own id, derived from the request's one transfer id), the head slice of a layer a piece carries, and the
bookkeeping that turns piece outcomes into the request's outcome on this rank (finished when every
piece is; failed as soon as one piece fails). In the symmetric plan there is one piece per rank,
under the request's own transfer id, carrying the whole layer: exactly the transfer of before.
"""

from __future__ import annotations

import dataclasses

from kvwire.errors import ConfigError
from kvwire.transfer.memory import PullSlice, head_slice

__all__ = ["head_slice"]  # re-exported: the view lives with the other paged-KV helpers

PIECE_SEPARATOR = "~"  # transfer id of a piece: "<request transfer id>~p<P rank>d<D rank>"


@dataclasses.dataclass(frozen=True)
class Piece:
    """P rank ``p_rank`` sends the KV heads ``src`` (local head indices on P) to D rank ``d_rank``,
    which writes them at its local heads ``dst``. ``src``/``dst`` are ``None`` for the whole layer
    (MLA, or every head of both ranks)."""

    p_rank: int
    d_rank: int
    src: range | None
    dst: range | None

    @property
    def num_heads(self) -> int | None:
        return None if self.src is None else len(self.src)


def check_tp(tp_size: int, num_kv_heads: int | None, what: str = "tensor-parallel size") -> None:
    """Raise ConfigError unless ``tp_size`` divides ``num_kv_heads`` or is a multiple of it."""
    if not isinstance(tp_size, int) or tp_size < 1:
        raise ConfigError(f"{what} must be a positive integer, got {tp_size!r}")
    if num_kv_heads is None:
        return
    if num_kv_heads < 1:
        raise ConfigError(f"num_kv_heads must be >= 1, got {num_kv_heads}")
    if num_kv_heads % tp_size and tp_size % num_kv_heads:
        raise ConfigError(
            f"{what} {tp_size} must divide the model's {num_kv_heads} KV heads or be a multiple of them"
        )


def owned_heads(rank: int, tp_size: int, num_kv_heads: int) -> range:
    """The global KV heads rank ``rank`` of ``tp_size`` holds (one replicated head when H < N)."""
    check_tp(tp_size, num_kv_heads)
    if not 0 <= rank < tp_size:
        raise ConfigError(f"rank {rank} out of range for tensor-parallel size {tp_size}")
    if num_kv_heads >= tp_size:
        per = num_kv_heads // tp_size
        return range(rank * per, (rank + 1) * per)
    head = rank * num_kv_heads // tp_size
    return range(head, head + 1)


def holders(head: int, tp_size: int, num_kv_heads: int) -> range:
    """The ranks that hold global KV head ``head`` (several when it is replicated)."""
    if num_kv_heads >= tp_size:
        per = num_kv_heads // tp_size
        return range(head // per, head // per + 1)
    replicas = tp_size // num_kv_heads
    return range(head * replicas, (head + 1) * replicas)


def plan_pieces(p_tp: int, d_tp: int, num_kv_heads: int | None) -> tuple[Piece, ...]:
    """Every piece of one transfer from P (TP ``p_tp``) to D (TP ``d_tp``), ordered by (D rank, head)."""
    check_tp(p_tp, num_kv_heads, "prefill tensor-parallel size")
    check_tp(d_tp, num_kv_heads, "decode tensor-parallel size")
    if num_kv_heads is None:
        return tuple(Piece(d % p_tp, d, None, None) for d in range(d_tp))
    pieces: list[Piece] = []
    for d in range(d_tp):
        mine = owned_heads(d, d_tp, num_kv_heads)
        run: list[int] = []  # consecutive heads from one P rank
        source = -1
        for head in mine:
            candidates = holders(head, p_tp, num_kv_heads)
            p = candidates[d % len(candidates)]
            if run and p != source:
                pieces.append(_piece(source, d, run, p_tp, mine, num_kv_heads))
                run = []
            source = p
            run.append(head)
        pieces.append(_piece(source, d, run, p_tp, mine, num_kv_heads))
    return tuple(pieces)


def _piece(p: int, d: int, heads: list[int], p_tp: int, d_heads: range, num_kv_heads: int) -> Piece:
    p_heads = owned_heads(p, p_tp, num_kv_heads)
    src = range(heads[0] - p_heads.start, heads[-1] + 1 - p_heads.start)
    dst = range(heads[0] - d_heads.start, heads[-1] + 1 - d_heads.start)
    if len(src) == len(p_heads) and len(dst) == len(d_heads):
        return Piece(p, d, None, None)  # both ranks' whole layer: no slicing
    return Piece(p, d, src, dst)


def is_identity(pieces: tuple[Piece, ...]) -> bool:
    """True for the symmetric plan (rank r sends its whole layer to rank r): pieces keep the
    request's transfer id, exactly as before heterogeneous TP existed."""
    return all(p.p_rank == p.d_rank and p.src is None for p in pieces) and (
        len({p.p_rank for p in pieces}) == len(pieces)
    )


def piece_transfer_id(transfer_id: str, piece: Piece, identity: bool) -> str:
    """The agent-level transfer id of one piece (the request's own id in the identity plan)."""
    if identity:
        return transfer_id
    return f"{transfer_id}{PIECE_SEPARATOR}p{piece.p_rank}d{piece.d_rank}"


def sent_by(pieces: tuple[Piece, ...], p_rank: int) -> tuple[Piece, ...]:
    return tuple(p for p in pieces if p.p_rank == p_rank)


def received_by(pieces: tuple[Piece, ...], d_rank: int) -> tuple[Piece, ...]:
    return tuple(p for p in pieces if p.d_rank == d_rank)


# --- one rank's share --------------------------------------------------------------------------------


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

    def pieces(self, transfer_id: str) -> set[str]:
        group = self._groups.get(transfer_id)
        return set() if group is None else set(group.pending)

    def finish(self, piece_id: str, failed: bool = False) -> PieceGroup | None:
        """Mark a piece done; its group (None when the piece is unknown), forgotten once its last
        piece is done: the request is done on this rank when ``pending`` is empty. A failed piece
        makes the group failed (the caller ends the other pieces)."""
        tid = self._owner.pop(piece_id, None)
        group = self._groups.get(tid) if tid is not None else None
        if group is None:
            return None
        group.pending.discard(piece_id)
        group.failed |= failed
        if not group.pending:
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
