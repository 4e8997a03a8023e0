"""Signed etcd records (decision 125): what an instance with the shared secret puts, and what a
router with it accepts. The attack against a real etcd is in tests/integration/test_security_discovery.py."""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import time

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvwire.discovery import InstanceInfo, parse_discovery_address
from kvwire.discovery.etcd_client import EtcdRegistration
from kvwire.discovery.etcd_gateway import SignedRecord, decode_record, encode_record, record_key
from kvwire.discovery.heartbeats import Heartbeat, encode_frames
from kvwire.errors import AuthenticationError, ConfigError, ProtocolError
from kvwire.protocol.kv_params import Role
from kvwire.router.etcd_stream import WatchEvent, WatchKv
from kvwire.router.etcd_watcher import EtcdWatcher
from kvwire.router.registry import Registry

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


# --- the watcher: signatures and freshness in etcd's order ---------------------------------------


def _event(kind: str, value: bytes = b"", key: bytes = b"/kvwire/instances/p0") -> WatchEvent:
    return WatchEvent(type=kind, kv=WatchKv(key=key, value=value, mod_revision=1))


def _signed(seq: int, sent_at: float | None = None) -> bytes:
    hb = msgspec.structs.replace(_hb(seq), sent_at=time.time() if sent_at is None else sent_at)
    return encode_record(hb, record_key(SECRET))


def _watcher() -> tuple[EtcdWatcher, Registry]:
    registry = Registry(ttl_s=30.0)
    return EtcdWatcher(registry, parse_discovery_address("etcd://h:1"), secret=SECRET.encode()), registry


def test_watcher_refuses_unsigned_and_replayed_records() -> None:
    watcher, registry = _watcher()
    watcher.records.apply_events([_event("PUT", encode_record(_hb()))])
    watcher.records.apply_events([_event("PUT", _signed(1, sent_at=time.time() - 3600))])  # too old
    assert registry.get("p0") is None and watcher.dropped == {"unauthenticated": 1, "replayed": 1}
    first = _signed(1)
    watcher.records.apply_events([_event("PUT", first)])
    watcher.records.apply_events([_event("PUT", first)])  # a re-sync reads the same record again: fine
    assert registry.get("p0") is not None and watcher.dropped["replayed"] == 1
    watcher.records.apply_events([_event("DELETE")])  # the lease ended
    assert registry.get("p0") is None
    watcher.records.apply_events([_event("PUT", first)])  # put back by someone else: a replay
    assert registry.get("p0") is None and watcher.dropped["replayed"] == 2


def test_watcher_takes_an_instance_back_with_its_next_record() -> None:
    """Lease lost and re-granted at once: the deletion and the instance's next record in one watch
    message; the record is fresh, and stays fresh when a re-sync reads it again."""
    watcher, registry = _watcher()
    watcher.records.apply_events([_event("PUT", _signed(1))])
    again = _signed(2)
    watcher.records.apply_events([_event("DELETE"), _event("PUT", again)])
    watcher.records.apply_events([_event("PUT", again)])
    assert registry.get("p0") is not None and watcher.dropped == {}


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.binary(max_size=512), st.builds(
    lambda record, sig: msgspec.json.encode({"type": "signed_record", "record": record, "sig": sig}),
    st.text(max_size=256), st.text(max_size=80))))
def test_any_record_value_decodes_or_raises_protocol_error(value: bytes) -> None:
    """The decoder's contract for hostile values: a Heartbeat, or ProtocolError (AuthenticationError
    is one); nothing else escapes."""
    for key in (None, record_key(SECRET)):
        with contextlib.suppress(ProtocolError):
            assert isinstance(decode_record(value, key), Heartbeat)
