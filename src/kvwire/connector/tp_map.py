"""Which KV heads each tensor-parallel rank holds, and which P rank sends which heads to which D rank.

Pure functions, no torch: the built-in engine's TP connector and the vLLM plugin use the same map.

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
"""

from __future__ import annotations

import dataclasses

from kvwire.errors import ConfigError

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
