"""Revoke is safe (decision 114): a one-copy grant whose sender still holds its slot when the
receiver cancels is quarantined: the transfer stays unsettled, its slot and destination memory out
of use, until the holder (a real second process here) lets go or dies."""

from __future__ import annotations

import gc
import os
import selectors
import signal
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch

from kvwire.transfer import TransferConfig
from kvwire.transfer.memory import ByteSpans, PeerRef, RecvItem, shared_tensors
from kvwire.transfer.planes.shm import plane as shm_plane_module
from kvwire.transfer.planes.shm.plane import GrantTable, ShmPlane
from kvwire.transfer.planes.shm.send import halves
from support.waiting import wait_for

PEER = PeerRef("tcp://127.0.0.1:1", "p-instance", "@nowhere")
LAYER_BYTES = 4096

# The holder: maps the receiver's grant table as a sender does, takes the slot's lock as a sender
# writing a layer does, says so, and lets go when told (or never, when killed).
_HOLDER = """
import sys
from kvwire.transfer.planes.shm.send import GrantView
fd, size, slot, token = map(int, sys.argv[1:5])
view = GrantView(fd, size)
with view.holding(slot, token, 10.0) as granted:
    print("held", granted(), flush=True)
    sys.stdin.readline()
print("released", flush=True)
sys.stdin.readline()
"""


class Holder:
    """A second process holding one grant slot's lock (a sender in the middle of a layer)."""

    def __init__(self, plane: ShmPlane, slot: int, token: int) -> None:
        fd, size = _region(plane).fd, _region(plane).size
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _HOLDER, str(fd), str(size), str(slot), str(token)],
            pass_fds=[fd], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert self.line(60.0) == "held True"

    def line(self, timeout_s: float) -> str:
        """The holder's next line of output, waited for at most ``timeout_s``."""
        assert self.proc.stdout is not None
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            if not sel.select(timeout_s):
                raise AssertionError(f"the holder said nothing for {timeout_s} s")
        return self.proc.stdout.readline().strip()

    def let_go(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("release\n")
        self.proc.stdin.flush()
        assert self.line(30.0) == "released"

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30.0)
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()


@pytest.fixture
def plane(monkeypatch: pytest.MonkeyPatch) -> Iterator[ShmPlane]:
    monkeypatch.setattr(shm_plane_module, "CANCEL_WAIT_S", 0.05)  # the revoke wait runs out quickly
    p = ShmPlane(TransferConfig(recv_budget_bytes=1 << 20), "d-instance")
    try:
        yield p
    finally:
        p.close()


def _region(plane: ShmPlane) -> GrantTable:
    """The grant region of PEER on ``plane`` (it must have one)."""
    table = plane.grants.table(PEER.instance_id)
    assert table is not None
    return table


def _grant(plane: ShmPlane, tid: str, dest: torch.Tensor) -> tuple[int, int]:
    """Post a one-copy receive of one layer into ``dest`` (shared memory): its (slot, token)."""
    spans = ByteSpans(dest, ((0, LAYER_BYTES),))
    plane.post_recv(PEER, [RecvItem(tid, 0, LAYER_BYTES, torch.empty(0, dtype=torch.uint8), spans)])
    assert plane._pending[PEER.instance_id][-1].transfer_id == tid, "a one-copy destination"
    grant = plane._granted[tid]
    return grant.slot, grant.token


@pytest.mark.parametrize("end", ["lets_go", "dies"])
def test_cancel_quarantines_a_grant_held_by_another_process_until_it_lets_go_or_dies(
    plane: ShmPlane, end: str
) -> None:
    cache = shared_tensors([(4, LAYER_BYTES)], torch.uint8)[0]  # D's KV cache, in shared memory
    slot, token = _grant(plane, "stalled", cache[1])
    holder = Holder(plane, slot, token)
    region = _region(plane)
    try:
        plane.cancel("stalled")  # the revoke wait runs out: the holder may still be writing
        assert plane.unsettled() == {"stalled": LAYER_BYTES}  # the blocks must not be reused
        assert int(region.tokens[slot]) == 0  # no new write starts under the grant
        assert slot not in region._free
        assert plane.grants.table(PEER.instance_id) is region  # the quarantined slot keeps its region
        # the stalled sender gets no new one-copy grant (the ring puts no block at risk) ...
        spans = ByteSpans(cache[2], ((0, LAYER_BYTES),))
        plane.post_recv(PEER, [RecvItem("next", 0, LAYER_BYTES, torch.empty(0, dtype=torch.uint8), spans)])
        assert "next" not in plane._granted
        # ... and asking again changes nothing while it holds the slot
        assert plane.unsettled() == {"stalled": LAYER_BYTES}
        if end == "lets_go":
            holder.let_go()
        else:
            os.kill(holder.proc.pid, signal.SIGKILL)  # the kernel drops a dead holder's lock
            holder.proc.wait(timeout=30.0)
        wait_for(lambda: not plane.unsettled(), 10.0, "the quarantine to end")
        assert slot in region._free
        assert plane.grants.table(PEER.instance_id) is None  # no link, nothing granted: region freed
        slot2, _ = _grant(plane, "after", cache[3])  # that sender is granted one-copy again
        assert plane._granted["after"].slot == slot2
    finally:
        holder.close()


def test_a_quarantined_receive_buffer_is_not_handed_out_again(plane: ShmPlane) -> None:
    """A receive buffer of the shared arena returns to the arena with its last tensor: the
    quarantine keeps it, so a late write cannot land in a buffer given to another transfer."""
    assert plane.arena is not None
    gc.collect()
    free = plane.arena.free_bytes()
    buf = plane.allocate(LAYER_BYTES)
    slot, token = _grant(plane, "stalled", buf)
    holder = Holder(plane, slot, token)
    try:
        plane.cancel("stalled")
        del buf
        gc.collect()
        assert plane.arena.free_bytes() < free  # still out of the arena: a late write may land
        holder.let_go()
        wait_for(lambda: not plane.unsettled(), 10.0, "the quarantine to end")
        gc.collect()
        assert plane.arena.free_bytes() == free
    finally:
        holder.close()


def test_cancel_with_the_slot_free_settles_at_once(plane: ShmPlane) -> None:
    """The fast path: nobody holds the slot, the revoke is confirmed, nothing is quarantined."""
    cache = shared_tensors([(2, LAYER_BYTES)], torch.uint8)[0]
    slot, _ = _grant(plane, "quick", cache[0])
    region = _region(plane)
    plane.cancel("quick")
    assert plane.unsettled() == {}
    assert slot in region._free
    assert plane.grants.table(PEER.instance_id) is None  # nothing left in it, no link: freed


def test_halves_cut_runs_at_half_their_bytes() -> None:
    """The test hook's stop in the middle of a layer: every byte copied once, half before."""
    runs = [(0, 100, 10), (50, 0, 7), (20, 30, 5)]
    first, rest = halves(runs)
    assert sum(n for *_, n in first) == 11 and sum(n for *_, n in rest) == 11
    assert first == [(0, 100, 10), (50, 0, 1)] and rest == [(51, 1, 6), (20, 30, 5)]
    assert halves([(0, 0, 9)]) == ([(0, 0, 4)], [(4, 4, 5)])


def test_a_quarantined_slot_keeps_its_region_after_the_link_closed(plane: ShmPlane) -> None:
    """Decision 127 with 114: a sender's region outlives its link while a slot in it is quarantined
    (a late write may still land), and is freed once the holder ends."""
    cache = shared_tensors([(2, LAYER_BYTES)], torch.uint8)[0]
    region = plane.grant_region_for_link(PEER.instance_id)  # PEER's link is set up
    slot, token = _grant(plane, "stalled", cache[0])
    holder = Holder(plane, slot, token)
    try:
        plane.cancel("stalled")
        assert plane.unsettled() == {"stalled": LAYER_BYTES}
        plane.link_closed(PEER.instance_id)  # the link ends; the stalled process lives on
        assert plane.grants.table(PEER.instance_id) is region
        assert plane.unsettled() == {"stalled": LAYER_BYTES}  # still quarantined, in that region
        os.kill(holder.proc.pid, signal.SIGKILL)
        holder.proc.wait(timeout=30.0)
        wait_for(lambda: not plane.unsettled(), 10.0, "the quarantine to end")
        assert plane.grants.table(PEER.instance_id) is None  # settled: the region is freed
    finally:
        holder.close()
