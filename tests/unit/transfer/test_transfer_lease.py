"""Transfer deadlines as liveness leases (decision 051): a slow but alive peer keeps a transfer
alive up to its limit; a dead or silent one still fails it within one lease."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch

from kvwire.transfer import LayerSpec, TransferAgent, TransferConfig
from kvwire.transfer.config import ControlLimits
from kvwire.transfer.core import Tombstones, renew_interval
from kvwire.transfer.sender import FIRST_PROMISE_RENEW_S, Promises
from kvwire.transfer.wire import Renew
from support.agent_helpers import _layers, _send, poll_until

LEASE_S = 0.3


@pytest.fixture
def pair() -> Iterator[tuple[TransferAgent, TransferAgent]]:
    with TransferAgent(TransferConfig()) as a, TransferAgent(TransferConfig()) as b:
        yield a, b


def _quiet_for(agent: TransferAgent, seconds: float) -> None:
    """Assert that ``agent`` reports nothing for ``seconds`` (several leases)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        ev = agent.poll()
        assert not (ev.failed or ev.finished_recving or ev.finished_sending), ev
        time.sleep(0.01)


def test_receiver_waits_for_a_slow_but_alive_sender(pair: tuple[TransferAgent, TransferAgent]) -> None:
    a, b = pair
    a.promise("slow", b.endpoint, deadline_s=LEASE_S, limit_s=30)  # P accepted the request
    b.expect("slow", num_layers=3, deadline_s=LEASE_S, sender=a.endpoint, limit_s=30)
    _quiet_for(b, 5 * LEASE_S)  # P's prefill is "queued": no offer yet, but P renews the lease
    layers = _layers()
    _send(a, "slow", b.endpoint, layers, deadline_s=LEASE_S)
    poll_until(b, lambda ev: "slow" in ev["recvd"])
    poll_until(a, lambda ev: "slow" in ev["sent"])
    got = b.take_layers("slow")
    assert all(torch.equal(got[i], t) for i, t in enumerate(layers))


def test_dead_sender_fails_within_one_lease(pair: tuple[TransferAgent, TransferAgent]) -> None:
    a, b = pair
    a.promise("dead", b.endpoint, deadline_s=LEASE_S, limit_s=30)
    b.expect("dead", num_layers=3, deadline_s=LEASE_S, sender=a.endpoint, limit_s=30)
    _quiet_for(b, 2 * LEASE_S)
    a.close()  # the sender's process is gone: no more renewals
    start = time.monotonic()
    reason = poll_until(b, lambda ev: "dead" in ev["failed"])["failed"]["dead"]
    assert time.monotonic() - start < LEASE_S + 0.5
    # the lease, or sooner the closed endpoint refusing the reconnect (transfer/peer_watch.py)
    assert reason.startswith(("deadline", "peer_lost: tcp://")), reason


def test_silent_endpoint_fails_at_the_first_deadline(pair: tuple[TransferAgent, TransferAgent]) -> None:
    _, b = pair
    start = time.monotonic()
    b.expect("silent", num_layers=1, deadline_s=LEASE_S, sender="tcp://127.0.0.1:9", limit_s=30)
    poll_until(b, lambda ev: "silent" in ev["failed"])
    assert time.monotonic() - start < LEASE_S + 0.5


def test_alive_sender_that_never_got_the_request_renews_only_for_the_admission_wait() -> None:
    """a is alive and answers renewals "unknown" (P never got the request): its word renews D's lease
    for ``max_admission_wait_s`` after ``expect`` (decision 128), no longer."""
    wait_s = 4 * LEASE_S
    config = TransferConfig(limits=ControlLimits(max_admission_wait_s=wait_s))
    with TransferAgent(TransferConfig()) as a, TransferAgent(config) as b:
        start = time.monotonic()
        b.expect("lost", num_layers=1, deadline_s=LEASE_S, sender=a.endpoint, limit_s=30)
        poll_until(b, lambda ev: "lost" in ev["failed"], timeout_s=20)
        waited = time.monotonic() - start
        assert waited >= wait_s, waited  # renewed past several leases ...
        assert b.stats().admission_renewals >= 1
    # ... and failed within one lease of the admission wait's end (generous slack: a loaded box)
    assert waited < wait_s + LEASE_S + 2.0, waited


def test_no_admission_wait_renews_nothing_on_unknown() -> None:
    config = TransferConfig(limits=ControlLimits(max_admission_wait_s=0.0))
    with TransferAgent(TransferConfig()) as a, TransferAgent(config) as b:
        start = time.monotonic()
        b.expect("lost", num_layers=1, deadline_s=LEASE_S, sender=a.endpoint, limit_s=30)
        poll_until(b, lambda ev: "lost" in ev["failed"])
        assert time.monotonic() - start < LEASE_S + 0.5
        assert b.stats().admission_renewals == 0


def test_a_request_still_in_the_senders_http_server_keeps_its_receive(
    pair: tuple[TransferAgent, TransferAgent],
) -> None:
    """The default: P's HTTP server holds the request for several of D's leases before P's agent
    hears of it (a slow or throttled P, decision 128); D keeps the receive and the data lands."""
    a, b = pair
    b.expect("late", num_layers=3, deadline_s=LEASE_S, sender=a.endpoint, limit_s=30)
    _quiet_for(b, 5 * LEASE_S)
    layers = _layers()
    _send(a, "late", b.endpoint, layers, deadline_s=LEASE_S)
    poll_until(b, lambda ev: "late" in ev["recvd"])
    got = b.take_layers("late")
    assert all(torch.equal(got[i], t) for i, t in enumerate(layers))
    assert b.stats().admission_renewals >= 1


def test_a_sender_restarted_before_taking_the_request_up_fails_the_receive() -> None:
    """The admission wait trusts one epoch: a new process at P's endpoint never had the request."""
    with TransferAgent(TransferConfig()) as probe:
        port = int(probe.endpoint.rsplit(":", 1)[1])
    with TransferAgent(TransferConfig()) as b:
        first = TransferAgent(TransferConfig(control_port=port))
        try:
            b.expect("gone", num_layers=1, deadline_s=LEASE_S, sender=first.endpoint, limit_s=30)
            poll_until(b, lambda ev: b.stats().admission_renewals >= 1 or "gone" in ev["failed"])
        finally:
            first.close()
        with TransferAgent(TransferConfig(control_port=port)):
            reason = poll_until(b, lambda ev: "gone" in ev["failed"], timeout_s=20)["failed"]["gone"]
        # D saw the new epoch ("sender restarted"), or the new P aborted it on D's renewal
        assert "peer_lost" in reason or reason.startswith("deadline"), reason


def test_renewals_stop_at_the_limit(pair: tuple[TransferAgent, TransferAgent]) -> None:
    a, b = pair
    start = time.monotonic()
    a.promise("capped", b.endpoint, deadline_s=0.2, limit_s=30)
    b.expect("capped", num_layers=1, deadline_s=0.2, sender=a.endpoint, limit_s=1.0)
    poll_until(b, lambda ev: "capped" in ev["failed"])
    assert 0.9 <= time.monotonic() - start < 1.6


def test_a_callers_lease_and_limit_are_cut_to_the_agents_limit() -> None:
    """``deadline_s`` and ``limit_s`` come from kv_transfer_params (a client's): a receive asking for
    a billion seconds, from a sender that renews, still ends at the agent's own limit."""
    with TransferAgent(TransferConfig()) as a, \
            TransferAgent(TransferConfig(default_deadline_s=0.2, default_limit_s=1.0)) as b:
        start = time.monotonic()
        a.promise("greedy", b.endpoint, deadline_s=0.2, limit_s=30)  # renews b's lease
        b.expect("greedy", num_layers=1, deadline_s=1e9, sender=a.endpoint, limit_s=1e9)
        reason = poll_until(b, lambda ev: "greedy" in ev["failed"], timeout_s=10.0)["failed"]["greedy"]
        assert time.monotonic() - start < 5.0 and reason.startswith("deadline"), reason


def test_failed_sender_answers_renewals_with_an_abort(pair: tuple[TransferAgent, TransferAgent]) -> None:
    a, b = pair
    layers = _layers()
    _send(a, "gone", "tcp://127.0.0.1:9", layers, deadline_s=0.1)  # fails on a: nobody grants
    poll_until(a, lambda ev: "gone" in ev["failed"])
    b.expect("gone", num_layers=3, deadline_s=5.0, sender=a.endpoint, limit_s=30)
    start = time.monotonic()
    reason = poll_until(b, lambda ev: "gone" in ev["failed"])["failed"]["gone"]
    assert time.monotonic() - start < 2.0  # the first renewal's answer, not the 5 s lease
    assert reason.startswith("peer_aborted")


def test_missing_trailer_completes_without_it(pair: tuple[TransferAgent, TransferAgent]) -> None:
    a, b = pair
    layers = _layers()
    b.expect("notrailer", num_layers=3, deadline_s=LEASE_S, limit_s=LEASE_S)
    a.start_send("notrailer", b.endpoint, [LayerSpec.of(t) for t in layers], with_trailer=True)
    for i, t in enumerate(layers):
        a.send_layer("notrailer", i, t)  # ... and P never sends its first token
    events = poll_until(b, lambda ev: "notrailer" in ev["recvd"] or "notrailer" in ev["failed"])
    assert "notrailer" in events["recvd"], events
    assert b.take_trailer("notrailer") is None
    assert b.stats().trailers_missing == 1
    poll_until(a, lambda ev: "notrailer" in ev["sent"])  # P learns D is done: blocks freed


def test_sender_waits_for_a_slow_but_alive_receiver() -> None:
    layer = torch.ones(1024, dtype=torch.uint8)
    small = TransferConfig(recv_budget_bytes=layer.numel(), spill_budget_bytes=0)
    with TransferAgent(TransferConfig()) as a, TransferAgent(small) as b:
        _send(a, "hog", b.endpoint, [layer])
        b.expect("hog", num_layers=1)
        poll_until(b, lambda ev: "hog" in ev["recvd"])  # its buffer holds all of b's budget
        poll_until(a, lambda ev: "hog" in ev["sent"])
        _send(a, "late", b.endpoint, [layer], deadline_s=LEASE_S, limit_s=30)
        b.expect("late", num_layers=1, deadline_s=LEASE_S, limit_s=30)
        _quiet_for(a, 5 * LEASE_S - 0.2)  # b cannot grant credit yet, but it is alive
        b.take_layers("hog")  # budget freed: b grants
        poll_until(b, lambda ev: "late" in ev["recvd"])
        poll_until(a, lambda ev: "late" in ev["sent"])


def test_aborting_a_promise_tells_the_receiver_at_once(pair: tuple[TransferAgent, TransferAgent]) -> None:
    a, b = pair
    a.promise("gone-early", b.endpoint, deadline_s=5.0, limit_s=30)
    b.expect("gone-early", num_layers=1, deadline_s=5.0, sender=a.endpoint, limit_s=30)
    start = time.monotonic()
    a.abort("gone-early", "request ended before its KV was sent")
    reason = poll_until(b, lambda ev: "gone-early" in ev["failed"])["failed"]["gone-early"]
    assert time.monotonic() - start < 2.0 and "request ended" in reason


def test_a_stuck_sender_renews_nothing(pair: tuple[TransferAgent, TransferAgent]) -> None:
    """Alive but its producer never hands layer 1 over: both sides fail within about one lease."""
    a, b = pair
    layers = _layers()
    b.expect("stuck", num_layers=3, deadline_s=LEASE_S, limit_s=30)
    start = time.monotonic()
    a.start_send("stuck", b.endpoint, [LayerSpec.of(t) for t in layers], deadline_s=LEASE_S, limit_s=30)
    a.send_layer("stuck", 0, layers[0])
    a.send_layer("stuck", 2, layers[2])
    poll_until(b, lambda ev: "stuck" in ev["failed"])
    poll_until(a, lambda ev: "stuck" in ev["failed"])
    assert time.monotonic() - start < 3 * LEASE_S + 0.5


class _PromiseCore:
    """What :class:`Promises` uses of the agent's core: a clock set by the test, the Renews sent."""

    def __init__(self) -> None:
        self.clock = 100.0
        self.config = TransferConfig()
        self.tombstones = Tombstones()
        self.sent: list[tuple[str, Renew]] = []

    def now(self) -> float:
        return self.clock

    def header(self, endpoint: str, transfer_id: str) -> dict[str, str]:
        return {"src_id": "p", "src_endpoint": "tcp://127.0.0.1:1", "dst_id": "d", "transfer_id": transfer_id}

    def send(self, endpoint: str, msg: Renew) -> None:
        self.sent.append((endpoint, msg))


def test_a_promise_renews_after_a_short_wait_not_at_once() -> None:
    """Decision 151: the first Renew of a promise waits FIRST_PROMISE_RENEW_S (a send that starts
    sooner needs none), then the promise renews every ``renew_interval`` until its limit. The agents'
    own test of a long queued prefill: ``test_receiver_waits_for_a_slow_but_alive_sender``."""
    core = _PromiseCore()
    promises = Promises(core)  # type: ignore[arg-type]
    promises.promise("soon", "tcp://d", deadline_s=1.0, limit_s=30, started=False)
    promises.promise("queued", "tcp://d", deadline_s=1.0, limit_s=30, started=False)
    promises.renew(core.clock)
    core.clock += FIRST_PROMISE_RENEW_S / 2
    promises.renew(core.clock)
    promises.started("soon")  # its prefill started the send: no Renew was needed
    assert core.sent == []
    core.clock += FIRST_PROMISE_RENEW_S / 2
    promises.renew(core.clock)
    assert [(e, m.transfer_id, m.state) for e, m in core.sent] == [("tcp://d", "queued", "queued")]
    for _ in range(3):  # a long prefill keeps renewing, far inside D's 1 s lease
        core.clock += renew_interval(1.0)
        promises.renew(core.clock)
    assert len(core.sent) == 4 and FIRST_PROMISE_RENEW_S <= renew_interval(1.0) < 1.0

