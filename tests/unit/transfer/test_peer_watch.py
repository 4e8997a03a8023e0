"""A peer whose control endpoint refuses connections (its process is gone) fails its transfers at
once, not at their leases (transfer/peer_watch.py); a peer that is merely slow is left alone."""

from __future__ import annotations

import time

import torch

from kvwire.transfer import LayerSpec, TransferAgent, TransferConfig
from support.agent_helpers import _layers, _send, poll_until
from support.waiting import free_port

LEASE_S = 30.0  # far longer than the poll below: a failure within it came from the watch


def test_a_send_to_a_dead_endpoint_fails_before_its_lease() -> None:
    gone = f"tcp://127.0.0.1:{free_port()}"  # nothing listens there
    with TransferAgent(TransferConfig()) as a:
        start = time.monotonic()
        _send(a, "s", gone, _layers(), deadline_s=LEASE_S)
        # Well inside the 30 s lease even on a loaded box: a failure this early came from the watch.
        reason = poll_until(a, lambda ev: "s" in ev["failed"], timeout_s=20.0)["failed"]["s"]
        assert reason == f"peer_lost: {gone} refuses connections" and time.monotonic() - start < LEASE_S


def test_a_peer_that_closes_mid_transfer_fails_the_pull_and_a_live_one_still_serves() -> None:
    """D pulls from P; P's agent goes away before serving (as a killed process would: its Abort
    never comes because the transfer is not P's yet); D's pull fails at once. A second P, alive,
    serves the same kind of pull normally afterwards (the watch re-arms, nothing else is failed)."""
    cfg = TransferConfig()
    with TransferAgent(cfg) as d, TransferAgent(cfg) as live:
        p = TransferAgent(cfg)
        p_endpoint = p.endpoint
        d.expect("warm", num_layers=3, pull_from=p_endpoint, deadline_s=LEASE_S)  # connects to P
        p.close()
        reason = poll_until(d, lambda ev: "warm" in ev["failed"], timeout_s=20.0)["failed"]["warm"]
        assert reason == f"peer_lost: {p_endpoint} refuses connections", reason
        layers = _layers()
        _send(live, "ok", None, layers, deadline_s=LEASE_S)
        d.expect("ok", num_layers=3, pull_from=live.endpoint, deadline_s=LEASE_S)
        poll_until(d, lambda ev: "ok" in ev["recvd"])
        got = d.take_layers("ok")
        assert all(torch.equal(got[i], t) for i, t in enumerate(layers))
        assert [LayerSpec.of(t) for t in got.values()] == [LayerSpec.of(t) for t in layers]
