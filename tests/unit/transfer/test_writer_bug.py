"""A data plane's writer thread that raises something no link failure raises (a bug in the writer)
fails its peer's transfers itself, at once, ``peer_lost`` naming the error, the layer it had taken off
its queue included; the thread's guard logs and counts it. Before, only OSError-like errors were
reported there: the sender learned of it only from the receiver, which saw the link close and aborted
(``peer_aborted: ... link from peer broke``, naming no bug), or, had that Abort been lost, from its
lease running out (``deadline: 0/N layers acknowledged``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from kvwire.transfer import TransferAgent, TransferConfig
from kvwire.transfer.enums import FailReason
from kvwire.transfer.planes.shm.send import Outbound
from kvwire.transfer.planes.tcp.send import TcpOutbound
from support.agent_helpers import _layers, _send, poll_until

LEASE_S = 60.0  # a failure by the lease would come far past the polls' 10 s


def _raise(*args: Any, **kwargs: Any) -> None:
    raise RuntimeError("a bug in the writer")


@pytest.fixture(params=["auto", "tcp"])
def pair(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[TransferAgent, TransferAgent]]:
    """Two agents on shared memory (negotiated) or forced TCP, whose writer raises on its first layer
    (after taking it off the queue)."""
    if request.param == "tcp":
        monkeypatch.setattr(TcpOutbound, "_write", _raise)
    else:
        monkeypatch.setattr(Outbound, "_batch", _raise)
    cfg = TransferConfig(transport=request.param, default_deadline_s=LEASE_S)
    with TransferAgent(cfg) as a, TransferAgent(cfg) as b:
        yield a, b


def test_a_writer_that_raises_fails_the_transfer_on_both_ends_at_once(
    pair: tuple[TransferAgent, TransferAgent],
) -> None:
    a, b = pair
    layers = _layers(1)  # one layer: the writer holds it, nothing is left on its queue to fail
    b.expect("bug", num_layers=1)
    _send(a, "bug", b.endpoint, layers)
    sent = poll_until(a, lambda ev: "bug" in ev["failed"])["failed"]["bug"]
    assert FailReason.of(sent) is FailReason.PEER_LOST, sent
    assert "its writer failed (RuntimeError: a bug in the writer)" in sent
    recvd = poll_until(b, lambda ev: "bug" in ev["failed"])["failed"]["bug"]
    assert FailReason.of(recvd) in (FailReason.PEER_LOST, FailReason.PEER_ABORTED), recvd
    errors = a.board.worker_errors()  # the guard logged and counted the thread's error
    assert sum(count for name, count in errors.items() if name.endswith("-send")) == 1, errors
