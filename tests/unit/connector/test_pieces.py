"""The TP head map: every D rank gets exactly its heads, once, from a P rank that holds them."""

from __future__ import annotations

import itertools

import pytest

from kvwire.connector.pieces import (
    Piece,
    check_tp,
    is_identity,
    owned_heads,
    piece_transfer_id,
    plan_pieces,
    received_by,
    sent_by,
)
from kvwire.errors import ConfigError


def _global(rng: range | None, base: range) -> list[int]:
    return list(base) if rng is None else [base.start + i for i in rng]


def test_owned_heads_split_and_replicated() -> None:
    assert [owned_heads(r, 2, 8) for r in range(2)] == [range(0, 4), range(4, 8)]
    assert [owned_heads(r, 4, 2) for r in range(4)] == [range(0, 1), range(0, 1), range(1, 2), range(1, 2)]
    assert owned_heads(0, 1, 3) == range(0, 3)


def test_split_one_p_rank_over_two_d_ranks() -> None:
    pieces = plan_pieces(1, 2, 4)
    assert pieces == (Piece(0, 0, range(0, 2), range(0, 2)), Piece(0, 1, range(2, 4), range(0, 2)))
    assert not is_identity(pieces)


def test_merge_two_p_ranks_into_one_d_rank() -> None:
    pieces = plan_pieces(2, 1, 4)
    assert pieces == (Piece(0, 0, range(0, 2), range(0, 2)), Piece(1, 0, range(0, 2), range(2, 4)))


def test_replicated_heads_are_read_from_different_replicas() -> None:
    # 1 KV head, D TP=2: both D ranks need head 0; P TP=2 holds it twice -> one piece from each replica.
    assert plan_pieces(2, 2, 1) == (Piece(0, 0, None, None), Piece(1, 1, None, None))
    assert is_identity(plan_pieces(2, 2, 1))
    # P TP=1 -> D TP=2 with one head: P sends its whole (single-head) layer to both.
    assert plan_pieces(1, 2, 1) == (Piece(0, 0, None, None), Piece(0, 1, None, None))
    # P TP=4 (2 heads, each on 2 ranks) -> D TP=1: one replica of each head, nothing twice.
    assert plan_pieces(4, 1, 2) == (
        Piece(0, 0, range(0, 1), range(0, 1)),
        Piece(2, 0, range(0, 1), range(1, 2)),
    )


def test_mla_is_sent_whole() -> None:
    assert plan_pieces(2, 4, None) == tuple(Piece(d % 2, d, None, None) for d in range(4))


@pytest.mark.parametrize("heads", [1, 2, 4, 8])
def test_every_plan_covers_each_d_rank_exactly(heads: int) -> None:
    sizes = [n for n in (1, 2, 4, 8) if heads % n == 0 or n % heads == 0]
    for p_tp, d_tp in itertools.product(sizes, sizes):
        pieces = plan_pieces(p_tp, d_tp, heads)
        sent_heads = 0
        for d in range(d_tp):
            mine = owned_heads(d, d_tp, heads)
            got: list[int] = []
            for piece in received_by(pieces, d):
                p_heads = owned_heads(piece.p_rank, p_tp, heads)
                src = _global(piece.src, p_heads)
                assert src == _global(piece.dst, mine)  # P's heads land where D keeps them
                got += src
            assert sorted(got) == list(mine)  # exactly its heads, none twice, none thrown away
            sent_heads += len(got)
        assert sent_heads == d_tp * len(owned_heads(0, d_tp, heads))
        assert sum(len(sent_by(pieces, p)) for p in range(p_tp)) == len(pieces)
        if p_tp == d_tp:
            assert is_identity(pieces)
        elif p_tp < d_tp:
            assert not is_identity(pieces)


def test_piece_ids() -> None:
    piece = Piece(1, 0, range(0, 2), range(2, 4))
    assert piece_transfer_id("abc", piece, identity=False) == "abc~p1d0"
    assert piece_transfer_id("abc", piece, identity=True) == "abc"


@pytest.mark.parametrize(("tp", "heads"), [(3, 2), (0, 2), (2, 3)])
def test_incompatible_sizes_are_refused(tp: int, heads: int) -> None:
    with pytest.raises(ConfigError):
        check_tp(tp, heads)
