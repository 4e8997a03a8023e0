"""The table of destinations peers granted a sender (one-copy writes): capped per peer and in all.

A peer's ``plane_info`` names destinations for any transfer id it likes and an entry leaves only when
its layer is sent, its transfer cancelled or its peer dropped, so a peer that names transfers this
sender never sends must not grow the table, nor take another peer's place in it.
"""

from __future__ import annotations

from kvwire.supervision import HealthBoard
from kvwire.transfer.config import TransferConfig
from kvwire.transfer.memory import PeerRef
from kvwire.transfer.planes.base import GRANTED_FULL, GrantedDests
from kvwire.transfer.planes.common.link_config import DataLinkConfig
from kvwire.transfer.planes.shm.plane import ShmPlane
from kvwire.transfer.planes.shm.send import ShmDest, encode_direct
from support.plane_callbacks import RecordingCallbacks


def test_each_peer_has_its_share_and_the_total_holds() -> None:
    board = HealthBoard()
    links = DataLinkConfig(max_granted_dests_per_peer=3, max_granted_dests=5)
    table: GrantedDests[str] = GrantedDests(board, links)
    assert board.limit_hits()[GRANTED_FULL] == 0  # exported before the first hit
    assert table.put("a", [((f"t{i}", 0), f"a{i}") for i in range(5)]) == 2  # a's share is 3
    assert table.put("b", [(("u", i), f"b{i}") for i in range(3)]) == 1  # the total is 5
    assert len(table) == 5 and board.limit_hits()[GRANTED_FULL] == 3
    assert table.put("a", [(("t0", 0), "a0-again")]) == 0  # a key it holds: replaced, no new room taken
    assert table.take("b", ("t0", 0)) is None  # another peer's destination is not b's to take
    assert table.take("a", ("t0", 0)) == "a0-again" and table.take("a", ("t0", 0)) is None
    table.drop_transfer("t1")
    table.drop_peer("b")
    assert len(table) == 1  # a's t2
    assert table.put("b", [(("u", 9), "b9")]) == 0  # room again once entries left
    table.clear()
    assert len(table) == 0 and table.put("a", [(("t", i), "x") for i in range(3)]) == 0


def _dests(transfer: str, count: int) -> bytes:
    return encode_direct([ShmDest(transfer, layer, 1, 0, 0, 7, ((0, 64),)) for layer in range(count)])


def test_shm_grants_of_transfers_never_sent_stop_at_the_cap() -> None:
    """Grants naming many transfers (none of which this sender sends) fill only their peer's share:
    the rest is refused, counted and reported; another peer's grant still lands and is taken."""
    links = DataLinkConfig(max_granted_dests_per_peer=40)
    plane = ShmPlane(TransferConfig(recv_budget_bytes=1 << 20, links=links), "p-instance")
    plane.callbacks = callbacks = RecordingCallbacks()
    hostile, honest = PeerRef("tcp://h:1", "hostile", ""), PeerRef("tcp://d:1", "honest", "")
    try:
        for i in range(10):
            plane.on_peer_info(hostile, _dests(f"never-{i}", 16))
        assert len(plane.dests) == 40
        assert plane.board.limit_hits()[GRANTED_FULL] == 10 * 16 - 40
        assert len(callbacks.protocol_errors) == 8  # the third grant on: one report each
        assert callbacks.protocol_errors[0].endswith("8 destination(s) over the cap")
        plane.on_peer_info(honest, _dests("real", 4))
        assert plane.take_dest("honest", "real", 3) is not None
        plane.drop_peer("hostile")
        assert len(plane.dests) == 3
    finally:
        plane.close()
