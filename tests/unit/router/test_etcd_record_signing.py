"""Signed etcd records (decision 125): what an instance with the shared secret puts, and what a
router with it accepts. The attack against a real etcd is in tests/integration/test_security_discovery.py."""

from __future__ import annotations

import hashlib
import hmac

import msgspec
import pytest

from kvwire.discovery import InstanceInfo, parse_discovery_address
from kvwire.discovery.etcd_client import EtcdRegistration
from kvwire.discovery.etcd_gateway import SignedRecord, decode_record, encode_record, record_key
from kvwire.discovery.messages import Heartbeat, encode_frames
from kvwire.errors import AuthenticationError, ConfigError, ProtocolError
from kvwire.kv_params import Role

SECRET = "etcd-record-test-secret"


def _hb(seq: int = 1) -> Heartbeat:
    info = InstanceInfo(instance_id="p0", role=Role.PREFILL, url="http://h:1", model="m", epoch=5)
    return Heartbeat(info=info, seq=seq, sent_at=123.0, ttl_s=6.0)


def test_signed_record_round_trip_and_readable_without_the_key() -> None:
    key = record_key(SECRET)
    value = encode_record(_hb(), key)
    assert decode_record(value, key) == _hb()
    assert decode_record(value) == _hb()  # a router without the secret reads it, as before
    outer = msgspec.json.decode(value)
    assert outer["type"] == "signed_record" and msgspec.json.decode(outer["record"])["seq"] == 1


def test_unsigned_forged_and_foreign_signatures_are_refused() -> None:
    key = record_key(SECRET)
    with pytest.raises(AuthenticationError, match="unsigned"):
        decode_record(encode_record(_hb()), key)
    with pytest.raises(AuthenticationError, match="bad"):
        decode_record(encode_record(_hb(), record_key("another-secret-entirely")), key)
    genuine = msgspec.json.decode(encode_record(_hb(), key), type=SignedRecord)
    tampered = genuine.record.replace('"http://h:1"', '"http://evil:1"')
    with pytest.raises(AuthenticationError):
        decode_record(msgspec.json.encode(SignedRecord(record=tampered, sig=genuine.sig)), key)
    # signed with the raw secret (how ZeroMQ heartbeats are): another kind of signature, refused
    raw = msgspec.json.encode(_hb())
    other_kind = hmac.new(SECRET.encode(), raw, hashlib.sha256).hexdigest()
    with pytest.raises(AuthenticationError):
        decode_record(msgspec.json.encode(SignedRecord(record=raw.decode(), sig=other_kind)), key)
    with pytest.raises(AuthenticationError):  # a non-ASCII signature is a bad one, not a crash
        decode_record(msgspec.json.encode(SignedRecord(record=raw.decode(), sig="é" * 64)), key)
    assert encode_frames(_hb(), SECRET.encode())[1] != bytes.fromhex(genuine.sig)


def test_malformed_signed_records() -> None:
    key = record_key(SECRET)
    for value in (b'{"type":"signed_record","record":"{","sig":""}', b'{"type":"signed_record"}', b"[]"):
        with pytest.raises(ProtocolError):
            decode_record(value, key)
    good = msgspec.json.decode(encode_record(_hb(), key), type=SignedRecord)
    inner = good.record.replace('"http://h:1"', '"ftp://h:1"')  # well signed, invalid inside
    sig = hmac.new(key, inner.encode(), hashlib.sha256).hexdigest()
    with pytest.raises(ProtocolError, match="http"):
        decode_record(msgspec.json.encode(SignedRecord(record=inner, sig=sig)), key)
    with pytest.raises(ConfigError):
        record_key("")


def test_registration_signs_its_records_with_the_secret() -> None:
    target = parse_discovery_address("etcd://h:2379")
    info = _hb().info
    puts: list[bytes] = []

    class Fake:
        def grant(self, ttl_s: int) -> int:
            return 1

        def put(self, key: str, value: bytes, lease: int) -> None:
            puts.append(value)

    for secret in (SECRET, None):
        reg = EtcdRegistration(target, info, interval_s=1.0, secret=secret)
        reg._http = Fake()  # type: ignore[assignment]
        reg.tick()
    signed, plain = puts
    assert decode_record(signed, record_key(SECRET)).info == info
    with pytest.raises(AuthenticationError):
        decode_record(plain, record_key(SECRET))
