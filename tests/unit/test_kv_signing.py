"""Signed kv_transfer_params: what verifies, what is refused and why."""

from __future__ import annotations

import hashlib
import hmac

import msgspec
import pytest

from kvwire.errors import ConfigError
from kvwire.protocol.kv_params import KVTransferParams, Role, TransferMode
from kvwire.protocol.kv_signing import (
    CLOCK_SKEW_S,
    KVParamsRefused,
    ParamsRefusal,
    ParamsSigner,
    ParamsVerifier,
)

SECRET = "unit-secret"
NOW = 1_800_000_000.0


def params(**overrides: object) -> KVTransferParams:
    fields: dict[str, object] = dict(transfer_id="t1", role=Role.PREFILL, mode=TransferMode.PUSH,
                                     peer_endpoints=["tcp://10.0.0.2:7000"], peer_instance_id="d0")
    fields.update(overrides)
    return KVTransferParams(**fields)  # type: ignore[arg-type]


def refusal(verifier: ParamsVerifier, p: KVTransferParams) -> ParamsRefusal:
    with pytest.raises(KVParamsRefused) as info:
        verifier.verify(p)
    assert info.value.reason == info.value.refusal.value
    return info.value.refusal


def test_signed_params_verify_after_a_json_round_trip() -> None:
    signed = ParamsSigner(SECRET, ttl_s=30, clock=lambda: NOW).sign(params())
    assert signed.expires_at == NOW + 30 and signed.sig
    wire = KVTransferParams.from_dict(msgspec.json.decode(msgspec.json.encode(signed.to_dict())))
    ParamsVerifier(SECRET, clock=lambda: NOW + 1).verify(wire)


@pytest.mark.parametrize("change", [
    {"peer_endpoints": ["tcp://evil:1"]}, {"peer_instance_id": "x"}, {"role": Role.DECODE},
    {"transfer_id": "t2"}, {"expires_at": NOW + 3600}, {"deadline_s": 300.0}, {"first_token_id": 5},
])
def test_any_changed_field_breaks_the_signature(change: dict[str, object]) -> None:
    signed = ParamsSigner(SECRET, clock=lambda: NOW).sign(params())
    tampered = msgspec.structs.replace(signed, **change)
    assert refusal(ParamsVerifier(SECRET, clock=lambda: NOW), tampered) is ParamsRefusal.BAD_SIGNATURE


def test_unsigned_wrong_secret_expired_and_replayed_are_refused() -> None:
    verifier = ParamsVerifier(SECRET, clock=lambda: NOW)
    assert refusal(verifier, params()) is ParamsRefusal.UNSIGNED
    other = ParamsSigner("another-secret", clock=lambda: NOW).sign(params())
    assert refusal(verifier, other) is ParamsRefusal.BAD_SIGNATURE
    old = ParamsSigner(SECRET, ttl_s=10, clock=lambda: NOW - 10 - CLOCK_SKEW_S - 1).sign(params())
    assert refusal(verifier, old) is ParamsRefusal.EXPIRED
    fresh = ParamsSigner(SECRET, clock=lambda: NOW).sign(params(transfer_id="t9"))
    verifier.verify(fresh)
    assert refusal(verifier, fresh) is ParamsRefusal.REPLAYED
    # The same transfer for the other role (D's half of the pair) is not a replay.
    other_half = params(transfer_id="t9", role=Role.DECODE)
    verifier.verify(ParamsSigner(SECRET, clock=lambda: NOW).sign(other_half))


def test_the_key_is_not_the_raw_secret() -> None:
    """A MAC made with the secret itself (e.g. a heartbeat's) never passes as a params signature."""
    unsigned = msgspec.structs.replace(params(), expires_at=NOW + 60)
    raw_mac = hmac.new(SECRET.encode(), msgspec.json.encode(unsigned), hashlib.sha256).hexdigest()
    forged = msgspec.structs.replace(unsigned, sig=raw_mac)
    assert refusal(ParamsVerifier(SECRET, clock=lambda: NOW), forged) is ParamsRefusal.BAD_SIGNATURE


def test_replay_memory_is_bounded_and_forgets_expired_entries() -> None:
    clock = [NOW]
    verifier = ParamsVerifier(SECRET, clock=lambda: clock[0], max_remembered=3)
    signer = ParamsSigner(SECRET, ttl_s=10, clock=lambda: clock[0])
    for i in range(10):
        verifier.verify(signer.sign(params(transfer_id=f"id{i}")))
    assert len(verifier._seen) <= 3


def test_bad_configuration_is_refused() -> None:
    with pytest.raises(ConfigError):
        ParamsSigner("")
    with pytest.raises(ConfigError):
        ParamsSigner(SECRET, ttl_s=0)


def test_a_refused_signature_never_reaches_the_admission_check() -> None:
    """The connector's check may act (P promises D its transfer, contacting D's endpoint): forged
    parameters must be refused before it runs."""
    from kvwire.protocol.kv_signing import verifying

    seen: list[object] = []
    refused: list[object] = []
    forged = KVTransferParams(transfer_id="t-forged", role=Role.PREFILL, peer_endpoints=["tcp://evil:1"])
    verifier = ParamsVerifier(b"s" * 32)
    checked = verifying(lambda params: seen.append(params) or params, verifier, refused.append)
    with pytest.raises(KVParamsRefused):
        checked(forged.to_dict())
    assert seen == [] and len(refused) == 1


def test_a_forged_request_is_refused_for_its_signature_before_its_endpoints_are_read() -> None:
    """The chain an instance with a shared secret runs: the signature (403), then the endpoints'
    form and the connector's check (400). A forged request with a malformed endpoint is a refusal,
    not a bad request; a signed one with a malformed endpoint is a bad request; neither reaches the
    connector's check."""
    from kvwire.errors import InvalidRequestError
    from kvwire.protocol.kv_params import endpoints_checked
    from kvwire.protocol.kv_signing import verifying

    seen: list[object] = []
    refused: list[object] = []
    signer = ParamsSigner(SECRET, clock=lambda: NOW)
    verifier = ParamsVerifier(SECRET, clock=lambda: NOW)
    checked = verifying(endpoints_checked(seen.append), verifier, refused.append)
    bad_endpoint = ["tcp://10.0.0.2:7000", "not an endpoint"]
    genuine = signer.sign(params(transfer_id="t-ok", peer_endpoints=["tcp://10.0.0.2:7000"]))
    tampered = msgspec.structs.replace(genuine, peer_endpoints=bad_endpoint)
    with pytest.raises(KVParamsRefused):
        checked(tampered)
    with pytest.raises(InvalidRequestError, match=r"peer_endpoints\[1\]"):
        checked(signer.sign(params(transfer_id="t-bad", peer_endpoints=bad_endpoint)))
    assert seen == [] and len(refused) == 1
    assert checked(genuine) == genuine and seen == [genuine]
