"""An agent that advertises another address than it binds (decision 090): peers dial the advertised
control endpoint and TCP data address -- here a relay in front of the real ports -- and transfers
work through it. TCP is forced: on one host the pair would otherwise negotiate shared memory,
which never dials the advertised address."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from kvwire.errors import ConfigError
from kvwire.transfer import TransferAgent, TransferConfig
from support.agent_helpers import _layers, _send, poll_until
from support.fault_relay import FaultRelay, RelayGroup
from support.waiting import free_port

Relayed = tuple[TransferAgent, TransferAgent, RelayGroup]


@pytest.fixture
def relayed() -> Iterator[Relayed]:
    """(sender, receiver, the receiver's relays): the receiver listens on fixed ports and
    advertises the relays' ports."""
    control, data = free_port(), free_port()
    relays = RelayGroup({"control": FaultRelay("127.0.0.1", control), "data": FaultRelay("127.0.0.1", data)})
    receiver_cfg = TransferConfig(
        transport="tcp", control_port=control, data_port=data,  # type: ignore[arg-type]
        advertise_control_port=relays["control"].port, advertise_data_port=relays["data"].port,
    )
    try:
        with TransferAgent(TransferConfig(transport="tcp")) as a, TransferAgent(receiver_cfg) as b:  # type: ignore[arg-type]
            yield a, b, relays
    finally:
        relays.close()


def test_peers_dial_the_advertised_addresses(relayed: Relayed) -> None:
    a, b, relays = relayed
    assert b.endpoint == f"tcp://127.0.0.1:{relays['control'].port}"
    assert b.data_address.endswith(f":{relays['data'].port}")
    assert b._core.control is not None and b._core.control.bound_endpoint != b.endpoint
    layers = _layers(3)
    b.expect("t1", num_layers=3)
    _send(a, "t1", b.endpoint, layers)
    poll_until(b, lambda ev: "t1" in ev["recvd"])
    poll_until(a, lambda ev: "t1" in ev["sent"])
    got = b.take_layers("t1")
    assert all(torch.equal(got[i], t) for i, t in enumerate(layers))
    payload = sum(t.numel() * t.element_size() for t in layers)
    assert relays["data"].bytes_forwarded >= payload  # the layers went through the relay
    assert relays["control"].connections >= 1


def test_advertise_host_replaces_the_bound_host() -> None:
    cfg = TransferConfig(advertise_host="kv.example.internal", advertise_control_port=7000)
    assert cfg.advertised("127.0.0.1:5555", cfg.advertise_control_port) == "kv.example.internal:7000"
    assert cfg.advertised("127.0.0.1:5556", cfg.advertise_data_port) == "kv.example.internal:5556"
    assert TransferConfig().advertised("127.0.0.1:5556", 0) == "127.0.0.1:5556"


@pytest.mark.parametrize("kw", [{"advertise_host": " "}, {"advertise_control_port": 70000},
                                {"advertise_data_port": -1}])
def test_bad_advertise_settings_raise(kw: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        TransferConfig(**kw)  # type: ignore[arg-type]


def test_wildcard_bind_with_an_advertised_host() -> None:
    """Bound on every interface, advertised as one address peers can dial (a wildcard cannot be)."""
    receiver_cfg = TransferConfig(transport="tcp", host="0.0.0.0", advertise_host="127.0.0.1")  # type: ignore[arg-type]
    with TransferAgent(TransferConfig(transport="tcp")) as a, TransferAgent(receiver_cfg) as b:  # type: ignore[arg-type]
        assert b.endpoint.startswith("tcp://127.0.0.1:")
        assert b.data_address.startswith("tcp=127.0.0.1:")  # the plane set's "backend=address" form
        assert b._core.control is not None and b._core.control.bound_endpoint.startswith("tcp://0.0.0.0:")
        layers = _layers(2)
        b.expect("w1", num_layers=2)
        _send(a, "w1", b.endpoint, layers)
        poll_until(b, lambda ev: "w1" in ev["recvd"])
        got = b.take_layers("w1")
        assert all(torch.equal(got[i], t) for i, t in enumerate(layers))
