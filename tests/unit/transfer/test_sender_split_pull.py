"""Pull mode, one held transfer served in pieces (a head range each) to several receivers
(transfer/sender.py): three in-process agents on loopback, one P and two D ranks."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest
import torch

from kvwire.transfer import TransferAgent, TransferConfig
from kvwire.transfer.memory import (
    BlockTarget,
    KVLayout,
    LayerSpec,
    PullSlice,
    block_ids_tensor,
    gathered_shape,
)
from support.agent_helpers import poll_until

LAYOUT = KVLayout.KV_FIRST
NUM_LAYERS = 2
P_BLOCKS = (3, 5, 7)
D_BLOCKS = (0, 1, 2)


@pytest.fixture
def agents() -> Iterator[tuple[TransferAgent, TransferAgent, TransferAgent]]:
    cfg = TransferConfig()
    with TransferAgent(cfg) as p, TransferAgent(cfg) as d0, TransferAgent(cfg) as d1:
        yield p, d0, d1


def caches(heads: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 8, 4, heads, 8, generator=gen) for _ in range(NUM_LAYERS)]


def register(
    agents: tuple[TransferAgent, TransferAgent, TransferAgent], p_heads: int
) -> list[list[torch.Tensor]]:
    """Caches for P (``p_heads`` KV heads) and the two D ranks (one head each), registered."""
    made = [caches(p_heads, 1), caches(1, 2), caches(1, 3)]
    for agent, cache in zip(agents, made, strict=True):
        agent.register_kv_caches(cache, LAYOUT)
    return made


def hold(p: TransferAgent, p_cache: list[torch.Tensor], tid: str, **kw: object) -> None:
    """P holds its whole layer of ``P_BLOCKS`` for a pull (as the connector does in pull mode)."""
    layers = [LayerSpec(gathered_shape(c, len(P_BLOCKS), LAYOUT), c.dtype) for c in p_cache]
    p.start_send(tid, None, layers, **kw)  # type: ignore[arg-type]
    for index in range(NUM_LAYERS):
        p.send_blocks(tid, index, block_ids_tensor(P_BLOCKS, "cpu"))


def pull(d: TransferAgent, p: TransferAgent, piece_id: str, held: str, heads: range | None, pieces: int,
         deadline_s: float = 10.0) -> None:  # fmt: skip
    d.expect(piece_id, num_layers=NUM_LAYERS, pull_from=p.endpoint, into_blocks=BlockTarget(D_BLOCKS),
             pull_slice=PullSlice(held, heads, pieces), deadline_s=deadline_s)  # fmt: skip


def wait_for(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.002)


def test_each_rank_gets_its_heads_and_p_finishes_on_the_last_ack(
    agents: tuple[TransferAgent, TransferAgent, TransferAgent],
) -> None:
    p, d0, d1 = agents
    p_cache, d0_cache, d1_cache = register(agents, p_heads=2)
    hold(p, p_cache, "t", pull_by=[d0.endpoint, d1.endpoint])
    pull(d0, p, "t~d0", "t", range(0, 1), 2)
    poll_until(d0, lambda ev: "t~d0" in ev["recvd"])
    wait_for(lambda: "t~d0" not in p._sender.table)  # P took D0's acknowledgement
    assert "t" in p._sender.table and not p.poll(), "P ended the held transfer before its second piece"
    pull(d1, p, "t~d1", "t", range(1, 2), 2)
    poll_until(d1, lambda ev: "t~d1" in ev["recvd"])
    events = p.poll()
    deadline = time.monotonic() + 10
    while not events.finished_sending:
        assert time.monotonic() < deadline
        events = p.poll()
    assert events.finished_sending == {"t"} and not events.failed  # one event, for the held id
    ids = torch.tensor(P_BLOCKS)
    for index in range(NUM_LAYERS):
        want = p_cache[index].index_select(1, ids)
        assert torch.equal(d0_cache[index][:, list(D_BLOCKS)], want[..., 0:1, :])
        assert torch.equal(d1_cache[index][:, list(D_BLOCKS)], want[..., 1:2, :])
    # Each piece moved only its heads: the held layer's bytes once, not once per receiver.
    assert events.timings["t"].num_bytes == sum(c.index_select(1, ids).numel() * 4 for c in p_cache)


def test_a_failed_piece_fails_the_held_transfer_and_its_other_pieces(
    agents: tuple[TransferAgent, TransferAgent, TransferAgent],
) -> None:
    p, d0, d1 = agents
    p_cache = register(agents, p_heads=2)[0]
    layers = [LayerSpec(gathered_shape(c, len(P_BLOCKS), LAYOUT), c.dtype) for c in p_cache]
    p.start_send("t", None, layers)
    # one layer only: the piece stays in flight (a whole held transfer may be acknowledged before
    # the test looks, and then there is nothing left to fail)
    p.send_blocks("t", 0, block_ids_tensor(P_BLOCKS, "cpu"))
    # D1's piece is pulled, then D1 gives up on it: P fails the held transfer at once
    pull(d1, p, "t~d1", "t", range(1, 2), 2)
    wait_for(lambda: "t~d1" in p._sender.table)
    d1.abort("t~d1", "decode rank lost")
    failed = poll_until(p, lambda ev: "t" in ev["failed"])["failed"]
    assert failed["t"].startswith("peer_aborted: decode rank lost") and not p._sender.table
    # the other D rank's pull of the failed transfer is refused at once (no wait for its deadline)
    pull(d0, p, "t~d0", "t", range(0, 1), 2, deadline_s=30.0)
    assert "t~d0" in poll_until(d0, lambda ev: "t~d0" in ev["failed"], timeout_s=5.0)["failed"]


def test_release_wrong_puller_and_piece_count_mismatch(
    agents: tuple[TransferAgent, TransferAgent, TransferAgent],
) -> None:
    p, d0, d1 = agents
    p_cache = register(agents, p_heads=1)[0]
    # a release (a replica nobody pulls) ends the held transfer as finished at once
    hold(p, p_cache, "r")
    d0.release_pull("r", p.endpoint)
    assert poll_until(p, lambda ev: "r" in ev["sent"])["sent"] == {"r": ""}
    # only the named D ranks may pull a piece; the held transfer stays for them
    hold(p, p_cache, "w", pull_by=[d0.endpoint])
    pull(d1, p, "w~d1", "w", None, 2, deadline_s=30.0)
    assert "w~d1" in poll_until(d1, lambda ev: "w~d1" in ev["failed"], timeout_s=5.0)["failed"]
    assert "w" in p._sender.table and p.stats().offers_refused == 1
    # pulls that disagree on how many pieces there are fail the held transfer (a config mismatch)
    pull(d0, p, "w~d0", "w", None, 2)
    # the named rank's piece is served (seen on D: on P it may come and go between two looks)
    poll_until(d0, lambda ev: "w~d0" in ev["recvd"])
    hold(p, p_cache, "m")
    pull(d0, p, "m~d0", "m", None, 2, deadline_s=30.0)
    pull(d1, p, "m~d1", "m", None, 3, deadline_s=30.0)
    failed = poll_until(p, lambda ev: "m" in ev["failed"])["failed"]
    assert failed["m"].startswith("mismatch: pulls disagree on the piece count")
