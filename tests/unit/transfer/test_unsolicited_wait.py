"""An Offer nobody expects is kept at most ``max_unsolicited_wait_s`` from its arrival, whatever its
sender renews (decision 159).

Both agents read one fake lease clock the test moves: each step waits for the Renews of that moment
to go both ways (a lease deadline moved to the step's time plus one lease), which also shows that
each side's control loop ran its deadline scan at that moment."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator

import pytest
import torch

from kvwire.errors import ConfigError, TransferError
from kvwire.transfer import TransferAgent, TransferConfig
from kvwire.transfer.config import ControlLimits
from kvwire.transfer.core import RunningClock
from support.agent_helpers import Events, _layers, _send, poll_until

LEASE_S = 20.0  # longer than the bound: no lease ends anything in these tests
WAIT_S = 12.0  # max_unsolicited_wait_s


class FakeTime:
    """A monotonic source the test sets (ahead of the real one: the loops' schedules were set on it)."""

    def __init__(self) -> None:
        self.t = time.monotonic() + 1000.0

    def __call__(self) -> float:
        return self.t


def wait_for(cond: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for: {what}"
        time.sleep(0.005)


@pytest.fixture
def pair() -> Iterator[tuple[TransferAgent, TransferAgent, FakeTime]]:
    """P and D on one fake clock; D parks a peer's Offers past 300 bytes (two 140-byte layers fit)."""
    limits = ControlLimits(max_unexpected_bytes_per_peer=300, max_unsolicited_wait_s=WAIT_S)
    fake = FakeTime()
    with TransferAgent(TransferConfig()) as p, TransferAgent(TransferConfig(limits=limits)) as d:
        for agent in (p, d):  # no pause detection: the test's jumps are time that ran
            agent._core.clock = RunningClock(fake, pause_gap_s=math.inf)
        yield p, d, fake


def _lease_deadline(agent: TransferAgent, tid: str, side: str) -> float | None:
    with agent._core.lock:
        table = agent._sender.table if side == "send" else agent._receiver.table
        st = table.get(tid)
        return None if st is None else st.lease.deadline


def _renewed_both_ways(p: TransferAgent, d: TransferAgent, tid: str, now: float) -> None:
    """Wait for the Renews of ``now`` on ``tid``: P's send and D's receive each renewed to ``now`` plus
    one lease (D's Renew is sent after D's deadline scan of ``now``, in the same tick)."""
    def renewed() -> bool:
        sent, recv = _lease_deadline(p, tid, "send"), _lease_deadline(d, tid, "recv")
        return sent is not None and recv is not None and min(sent, recv) >= now + LEASE_S

    wait_for(renewed, f"{tid} renewed both ways at {now}")


def _collect(agent: TransferAgent, into: Events, done: Callable[[Events], bool]) -> None:
    got = poll_until(agent, lambda ev: done({k: {**into[k], **ev[k]} for k in into}), timeout_s=30.0)
    for key, value in got.items():
        into[key].update(value)


def test_offers_nobody_expects_end_at_the_bound_though_their_sender_renews(
    pair: tuple[TransferAgent, TransferAgent, FakeTime],
) -> None:
    """A parked Offer (renewed both ways: P ``sending``, D ``receiving``) and one whose every layer
    landed (P's send done, D holding the layers) both end ``max_unsolicited_wait_s`` after their
    arrival, long before any lease or limit; P's send of the parked one fails (its blocks freed);
    an Offer claimed before the bound is unaffected; a later ``expect`` raises at once."""
    p, d, fake = pair
    start = fake.t
    p_events: Events = {"sent": {}, "recvd": {}, "failed": {}}
    d_events: Events = {"sent": {}, "recvd": {}, "failed": {}}
    claimed = _layers(1)
    _send(p, "landed", d.endpoint, _layers(1), deadline_s=LEASE_S)  # 140 bytes, under the cap
    _send(p, "claimed", d.endpoint, claimed, deadline_s=LEASE_S)  # 280 bytes with it
    _collect(p, p_events, lambda ev: {"landed", "claimed"} <= set(ev["sent"]))  # every layer landed on D
    _send(p, "parked", d.endpoint, _layers(3), deadline_s=LEASE_S)  # 420 more bytes: past the cap
    wait_for(lambda: d.stats().limits_hit.get("unexpected_bytes_per_peer") == 1, "parked left waiting")
    unsolicited = d._receiver.unsolicited
    with d._core.lock:
        assert set(unsolicited.arrived) == {"landed", "claimed", "parked"}
        assert unsolicited.parked == {"parked"} and unsolicited.granted_bytes[p.endpoint] == 280

    fake.t = start + 5.0  # a renewal is due (every lease / 4)
    d.expect("claimed", num_layers=1, deadline_s=LEASE_S)  # claimed: its layers all landed, it completes
    _collect(d, d_events, lambda ev: "claimed" in ev["recvd"])
    _renewed_both_ways(p, d, "parked", fake.t)
    fake.t = start + 10.0
    _renewed_both_ways(p, d, "parked", fake.t)
    with d._core.lock:
        assert set(unsolicited.arrived) == {"landed", "parked"}
    assert not d_events["failed"] and not d.poll().failed and not p.poll().failed

    fake.t = start + WAIT_S + 1.0  # past the bound; every lease still runs to start + 30 s
    assert _lease_deadline(p, "parked", "send") == start + 10.0 + LEASE_S
    _collect(d, d_events, lambda ev: {"landed", "parked"} <= set(ev["failed"]))
    _collect(p, p_events, lambda ev: "parked" in ev["failed"])
    for tid in ("landed", "parked"):
        assert d_events["failed"][tid] == "deadline: offer not expected within 12 s of its arrival " \
            "(max_unsolicited_wait_s)", d_events["failed"]
    assert p_events["failed"]["parked"].startswith("peer_aborted: deadline: offer not expected within 12 s")
    assert d.stats().limits_hit["unsolicited_wait"] == 2
    assert "claimed" in d_events["recvd"] and "claimed" not in d_events["failed"]
    assert torch.equal(d.take_layers("claimed")[0], claimed[0])
    with d._core.lock:  # nothing of the two is kept: counts, bytes, the parked entry, memory
        assert not unsolicited.arrived and not unsolicited.counts and not unsolicited.granted_bytes
        assert not unsolicited.parked and not d._receiver.table and not p._sender.table
        assert d._core.memory.budget_in_use == 0
    with pytest.raises(TransferError, match="max_unsolicited_wait_s"):  # the request came too late
        d.expect("parked", num_layers=3, deadline_s=LEASE_S)


def test_an_offer_expected_before_the_bound_is_unaffected(
    pair: tuple[TransferAgent, TransferAgent, FakeTime],
) -> None:
    """A parked Offer claimed just before the bound is granted and arrives whole; the bound passing
    afterwards ends nothing."""
    p, d, fake = pair
    start = fake.t
    layers = _layers(3)
    _send(p, "filler", d.endpoint, _layers(2), deadline_s=LEASE_S)  # 280 bytes: the next one parks
    poll_until(p, lambda ev: "filler" in ev["sent"], timeout_s=30.0)
    _send(p, "late", d.endpoint, layers, deadline_s=LEASE_S)
    wait_for(lambda: d.stats().limits_hit.get("unexpected_bytes_per_peer") == 1, "late left waiting")
    fake.t = start + WAIT_S - 1.0
    d.expect("late", num_layers=3, deadline_s=LEASE_S)
    d.expect("filler", num_layers=2, deadline_s=LEASE_S)
    events = poll_until(d, lambda ev: {"late", "filler"} <= set(ev["recvd"]), timeout_s=30.0)
    poll_until(p, lambda ev: "late" in ev["sent"], timeout_s=30.0)
    got = d.take_layers("late")
    assert all(torch.equal(got[i], t) for i, t in enumerate(layers))
    fake.t = start + 2 * WAIT_S
    _wait_for_scan(d, fake.t)
    assert not events["failed"] and not d.poll().failed and not p.poll().failed
    assert d.stats().limits_hit.get("unsolicited_wait", 0) == 0


def _wait_for_scan(agent: TransferAgent, now: float) -> None:
    """Wait until ``agent``'s control loop ran its deadline scan at the fake time ``now`` (it moves
    its next scan past ``now`` and scans under the lock taken here)."""
    wait_for(lambda: agent._routes._next_expiry > now, f"a deadline scan at {now}")
    with agent._core.lock:
        pass


@pytest.mark.parametrize("wait_s", [0.0, -1.0, math.inf, math.nan])
def test_the_bound_is_finite_and_positive(wait_s: float) -> None:
    with pytest.raises(ConfigError, match="max_unsolicited_wait_s"):
        ControlLimits(max_unsolicited_wait_s=wait_s)
