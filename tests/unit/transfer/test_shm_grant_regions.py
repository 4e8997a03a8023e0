"""Grant regions (decision 127): each sending peer's one-copy grants live in a grant table of its
own, which only that peer's links are handed; a peer writing into its table cannot touch another
peer's grants; a region is freed once its peer has no link and nothing granted or quarantined in
it; at most ``max_connections`` regions are made for peers that have not linked yet."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

from kvwire.transfer import TransferConfig
from kvwire.transfer.memory import ByteSpans, PeerRef, RecvItem, shared_tensors
from kvwire.transfer.planes.common.link_config import DataLinkConfig
from kvwire.transfer.planes.shm.plane import REGIONS_FULL, GrantTable, ShmPlane
from kvwire.transfer.planes.shm.send import GrantView, lock_slot

A = PeerRef("tcp://127.0.0.1:1", "peer-a", "@nowhere-a")
B = PeerRef("tcp://127.0.0.1:2", "peer-b", "@nowhere-b")
LAYER_BYTES = 4096


@pytest.fixture
def plane() -> Iterator[ShmPlane]:
    p = ShmPlane(TransferConfig(recv_budget_bytes=1 << 20), "d-instance")
    try:
        yield p
    finally:
        p.close()


@pytest.fixture
def cache() -> torch.Tensor:
    return shared_tensors([(8, LAYER_BYTES)], torch.uint8)[0]  # D's KV cache, in shared memory


def _grant(plane: ShmPlane, peer: PeerRef, tid: str, dest: torch.Tensor) -> bool:
    """Post a receive of one layer into ``dest``: whether it was granted one copy."""
    spans = ByteSpans(dest, ((0, LAYER_BYTES),))
    plane.post_recv(peer, [RecvItem(tid, 0, LAYER_BYTES, torch.empty(0, dtype=torch.uint8), spans)])
    return tid in plane._granted


def _region(plane: ShmPlane, peer: PeerRef) -> GrantTable:
    table = plane.grants.table(peer.instance_id)
    assert table is not None
    return table


def test_each_peer_is_granted_in_a_region_of_its_own(plane: ShmPlane, cache: torch.Tensor) -> None:
    assert _grant(plane, A, "a-1", cache[0]) and _grant(plane, B, "b-1", cache[1])
    table_a, table_b = _region(plane, A), _region(plane, B)
    assert os.fstat(table_a.fd).st_ino != os.fstat(table_b.fd).st_ino  # two memfds
    grant_a, grant_b = plane._granted["a-1"], plane._granted["b-1"]
    assert int(table_a.tokens[grant_a.slot]) == grant_a.token
    assert int(table_b.tokens[grant_b.slot]) == grant_b.token
    assert grant_a.token not in table_b.tokens.tolist()  # B's table carries nothing of A's
    # a link's setup hands over its own peer's region, the one its grants were claimed in
    assert plane.grant_region_for_link(A.instance_id) is table_a
    assert plane.grant_region_for_link(B.instance_id) is table_b
    assert len(plane.grants) == 2


def test_a_peer_writing_into_its_region_cannot_affect_another_peers_grant(
    plane: ShmPlane, cache: torch.Tensor
) -> None:
    assert _grant(plane, A, "a-1", cache[0]) and _grant(plane, B, "b-1", cache[1])
    table_a, table_b = _region(plane, A), _region(plane, B)
    hostile = GrantView(os.dup(table_b.fd), table_b.size)  # B maps what it was handed, as B does
    try:
        assert all(lock_slot(hostile.fd, slot, 0.0) for slot in range(hostile.tokens.size))
        hostile.tokens[:] = 0  # every slot of B's table locked and revoked by B
        grant = plane._granted["a-1"]
        assert int(table_a.tokens[grant.slot]) == grant.token  # A's grant untouched
        view_a = GrantView(os.dup(table_a.fd), table_a.size)  # A's sender still writes under it
        try:
            with view_a.holding(grant.slot, grant.token, 5.0) as granted:
                assert granted()
        finally:
            view_a.close()
        plane.cancel("a-1")  # and A's revoke is confirmed at once: nothing quarantined
        assert plane.unsettled() == {}
        plane.cancel("b-1")  # B's own grant: B holds its slot, so it is quarantined
        assert plane.unsettled() == {"b-1": LAYER_BYTES}
    finally:
        hostile.close()  # B lets go (its description closed: the kernel drops its locks)
    assert plane.unsettled() == {}


def test_a_region_is_freed_when_its_link_closes_and_nothing_is_granted_in_it(
    plane: ShmPlane, cache: torch.Tensor
) -> None:
    table = plane.grant_region_for_link(A.instance_id)  # a link's setup, no grant yet
    plane.link_closed(A.instance_id)
    assert plane.grants.table(A.instance_id) is None  # nothing in it: freed with the link
    assert _grant(plane, A, "a-1", cache[0])  # granted before A linked: a new region
    table = _region(plane, A)
    assert plane.grant_region_for_link(A.instance_id) is table  # A's link gets that one
    plane.link_closed(A.instance_id)
    assert plane.grants.table(A.instance_id) is table  # a grant is outstanding in it: kept
    plane.cancel("a-1")
    assert plane.grants.table(A.instance_id) is None  # revoked, no link: freed
    assert len(plane.grants) == 0


def test_regions_for_peers_not_linked_yet_are_capped(cache: torch.Tensor) -> None:
    plane = ShmPlane(TransferConfig(recv_budget_bytes=1 << 20, links=DataLinkConfig(max_connections=1)), "d")
    try:
        assert _grant(plane, A, "a-1", cache[0])
        assert not _grant(plane, B, "b-1", cache[1])  # at the cap: B's transfer takes the ring
        assert plane.grants.table(B.instance_id) is None
        assert plane.board.limit_hits()[REGIONS_FULL] == 1
        # a link's setup still gets its region (live links are capped by the listener itself)
        table_b = plane.grant_region_for_link(B.instance_id)
        assert _grant(plane, B, "b-2", cache[2]) and _region(plane, B) is table_b
    finally:
        plane.close()
