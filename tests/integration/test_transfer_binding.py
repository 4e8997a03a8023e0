"""A transfer is bound to the pair the router named: a third agent that knows (or guessed) the
transfer id can neither offer into a receive nor pull a lease. Real agents: D in this process, P and
the intruders in child processes, TCP on loopback, all with the shared secret unless said otherwise."""

from __future__ import annotations

import logging
import secrets
from collections.abc import Iterator

import pytest
from transfer_helpers import PeerProcess, digest, expected_digests, has_all, poll_until

from kvwire.errors import TransferError
from kvwire.transfer import TransferAgent, TransferConfig
from kvwire.transfer.stats import TransferStats

SECRET = "binding-test-secret"
SPECS = [([2, 3, 4, 8], "float32"), ([2, 3, 4, 8], "float16")]


@pytest.fixture(scope="module")
def peers() -> Iterator[dict[str, PeerProcess]]:
    procs = {"p": PeerProcess("--secret", SECRET), "intruder": PeerProcess("--secret", SECRET),
             "outsider": PeerProcess()}  # the outsider lacks the secret
    try:
        for proc in procs.values():
            proc.hello()
        yield procs
    finally:
        for proc in procs.values():
            proc.kill()


@pytest.fixture
def d_agent() -> Iterator[TransferAgent]:
    with TransferAgent(TransferConfig(secret=SECRET.encode())) as agent:
        yield agent


def _send(peer: PeerProcess, tid: str, to: str, seed: int) -> None:
    peer.call("send", tid=tid, peer=to, seed=seed, specs=SPECS, order=[0, 1], deadline_s=10.0)


def _stats_reach(agent: TransferAgent, done: object, timeout_s: float = 10.0) -> TransferStats:
    def check(_: object) -> bool:
        return bool(done(agent.stats()))  # type: ignore[operator]

    poll_until(agent, check, timeout_s)
    return agent.stats()


def test_offers_from_other_agents_are_refused_and_the_pair_completes(
    peers: dict[str, PeerProcess], d_agent: TransferAgent, caplog: pytest.LogCaptureFixture
) -> None:
    tid = secrets.token_hex(16)
    d_agent.expect(tid, num_layers=len(SPECS), accept_from=peers["p"].endpoint)
    # Both intruders know the id and offer first: with the secret -> refused as the wrong peer (the
    # intruder tries twice); without it -> the message itself is rejected.
    with caplog.at_level(logging.WARNING, logger="kvwire.transfer.core"):
        _send(peers["intruder"], tid, d_agent.endpoint, seed=666)
        _send(peers["outsider"], tid, d_agent.endpoint, seed=667)
        stats = _stats_reach(d_agent, lambda s: s.offers_refused >= 1 and s.messages_rejected >= 1)
        intruder = peers["intruder"].call("wait", tids=[tid], timeout_s=10.0)
        assert "not this transfer's peer" in intruder["events"]["failed"][tid]
        _send(peers["intruder"], tid, d_agent.endpoint, seed=668)
        stats = _stats_reach(d_agent, lambda s: s.offers_refused >= 2)
    assert sum("refused transfer message" in r.getMessage() for r in caplog.records) == 1  # not per offer
    # The real prefill's offer still goes through, with its own bytes.
    _send(peers["p"], tid, d_agent.endpoint, seed=42)
    poll_until(d_agent, has_all("recvd", [tid]), timeout_s=20)
    layers = d_agent.take_layers(tid)
    assert {i: digest(t) for i, t in layers.items()} == expected_digests(42, SPECS)
    assert peers["p"].call("wait", tids=[tid])["events"]["sent"] == {tid: ""}
    assert d_agent.stats().offers_refused == stats.offers_refused == 2


def test_an_offer_that_came_before_expect_from_another_agent_fails_the_transfer(
    peers: dict[str, PeerProcess], d_agent: TransferAgent
) -> None:
    tid = secrets.token_hex(16)
    _send(peers["intruder"], tid, d_agent.endpoint, seed=5)
    _stats_reach(d_agent, lambda s: s.bytes_received > 0)  # the intruder's offer is in, unexpected
    with pytest.raises(TransferError, match="not by its peer"):
        d_agent.expect(tid, num_layers=len(SPECS), accept_from=peers["p"].endpoint)
    assert d_agent.stats().offers_refused == 1
    assert "refused" in d_agent.poll().failed[tid]  # nothing of it is ever delivered
    # The agent keeps serving: the next transfer from the real peer completes.
    tid2 = secrets.token_hex(16)
    d_agent.expect(tid2, num_layers=len(SPECS), accept_from=peers["p"].endpoint)
    _send(peers["p"], tid2, d_agent.endpoint, seed=9)
    poll_until(d_agent, has_all("recvd", [tid2]), timeout_s=20)


def test_a_pull_lease_goes_only_to_the_named_receiver(
    peers: dict[str, PeerProcess], d_agent: TransferAgent
) -> None:
    tid = secrets.token_hex(16)
    p = peers["p"]
    p.call("send", tid=tid, peer=None, seed=77, specs=SPECS, order=[0, 1], deadline_s=10.0,
           pull_by=d_agent.endpoint)
    refused_before = p.call("stats")["offers_refused"]
    intruder = peers["intruder"]
    intruder.call("expect", tid=tid, num_layers=len(SPECS), pull_from=p.endpoint, deadline_s=10.0)
    failed = intruder.call("wait", tids=[tid], timeout_s=10.0)["events"]["failed"]
    assert "not this transfer's peer" in failed[tid]
    assert p.call("stats")["offers_refused"] == refused_before + 1
    # The lease is intact: the receiver the router named pulls it.
    d_agent.expect(tid, num_layers=len(SPECS), pull_from=p.endpoint)
    poll_until(d_agent, has_all("recvd", [tid]), timeout_s=20)
    assert {i: digest(t) for i, t in d_agent.take_layers(tid).items()} == expected_digests(77, SPECS)
