import pytest

from kvwire.errors import InvalidRequestError
from kvwire.protocol.kv_params import (
    KV_PARAMS_VERSION,
    MAX_PEER_ENDPOINTS,
    KVTransferParams,
    Role,
    TransferMode,
)


def test_round_trip_through_json_dict() -> None:
    params = KVTransferParams(
        transfer_id="t-1",
        mode=TransferMode.PULL,
        role=Role.DECODE,
        peer_endpoints=["tcp://127.0.0.1:5000", "tcp://127.0.0.1:5001"],
        first_token_id=42,
        num_prompt_tokens=17,
    )
    data = params.to_dict()
    assert data["mode"] == "pull" and data["role"] == "decode" and data["v"] == KV_PARAMS_VERSION
    assert KVTransferParams.from_dict(data) == params


def test_defaults_push_mode() -> None:
    params = KVTransferParams.from_dict({"transfer_id": "x", "role": "prefill"})
    assert params.mode is TransferMode.PUSH
    assert params.peer_endpoints == []
    assert params.deadline_s > 0


@pytest.mark.parametrize(
    "bad",
    [
        None,
        [],
        {"role": "prefill"},
        {"transfer_id": "", "role": "prefill"},
        {"transfer_id": "x", "role": "teacher"},
        {"transfer_id": "x", "role": "decode", "mode": "teleport"},
        {"transfer_id": "x", "role": "decode", "deadline_s": 0},
        {"transfer_id": "x", "role": "decode", "v": KV_PARAMS_VERSION + 1},
        {"transfer_id": 7, "role": "decode"},
    ],
)
def test_invalid_params_raise_typed_error(bad: object) -> None:
    with pytest.raises(InvalidRequestError):
        KVTransferParams.from_dict(bad)


def test_peer_endpoints_are_bounded_in_count() -> None:
    base = {"transfer_id": "t", "role": "prefill"}
    ok = KVTransferParams.from_dict({**base, "peer_endpoints": ["ipc://a"] * MAX_PEER_ENDPOINTS})
    assert len(ok.peer_endpoints) == MAX_PEER_ENDPOINTS
    with pytest.raises(InvalidRequestError, match="peer_endpoints"):
        KVTransferParams.from_dict({**base, "peer_endpoints": ["ipc://a"] * (MAX_PEER_ENDPOINTS + 1)})
