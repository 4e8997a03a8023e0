"""Control-message codec: round trips, versioning, validation, HMAC."""

from __future__ import annotations

import msgspec
import pytest

from kvwire.errors import AuthenticationError, ProtocolError
from kvwire.transfer.wire import (
    MAX_PIECES,
    MAX_REASON_LEN,
    PROTOCOL_VERSION,
    Abort,
    Ack,
    Codec,
    Grant,
    Offer,
    Pull,
    WireLayer,
)

HEAD = {"src_id": "abc", "src_endpoint": "tcp://127.0.0.1:5000", "transfer_id": "t-1"}


def _offer(**kw: object) -> Offer:
    fields: dict[str, object] = {
        **HEAD,
        "layers": [WireLayer([2, 16, 8, 128], "bfloat16")] * 2,
        "deadline_s": 5.0,
        "data_address": "127.0.0.1:6000",
    }
    fields.update(kw)
    return Offer(**fields)  # type: ignore[arg-type]


def test_round_trip_every_message_type() -> None:
    codec = Codec(None)
    for msg in (
        _offer(plane_info=b"\x00uid"),
        Grant(**HEAD, layers=[0, 1], data_address="h:1"),
        Ack(**HEAD, layers=[1], trailer=True),
    ):
        frames = codec.encode(msg)
        assert len(frames) == 1
        assert codec.decode(frames) == msg


@pytest.mark.parametrize(
    ("payload", "match"),
    [
        (b"\xc1", "malformed"),
        (msgspec.msgpack.encode({"t": "offer", "v": PROTOCOL_VERSION + 1, **HEAD}), "version"),
        (msgspec.msgpack.encode({"t": "nope", "v": PROTOCOL_VERSION, **HEAD}), "invalid"),
        (msgspec.msgpack.encode({"t": "ack", "v": PROTOCOL_VERSION, **HEAD, "layers": [-1]}), "negative"),
        (
            msgspec.msgpack.encode(
                {"t": "ack", "v": PROTOCOL_VERSION, **HEAD, "transfer_id": "", "layers": []}
            ),
            "transfer_id",
        ),
        (
            msgspec.msgpack.encode(
                {"t": "ack", "v": PROTOCOL_VERSION, **HEAD, "src_endpoint": "http://x", "layers": []}
            ),
            "ZMQ endpoint",
        ),
    ],
)
def test_bad_messages_raise_protocol_error(payload: bytes, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        Codec(None).decode([payload])


def test_offer_validation() -> None:
    codec = Codec(None)
    for bad in (
        _offer(layers=[WireLayer([-2], "float32")]),
        _offer(layers=[WireLayer([2], "complex64")]),
        _offer(deadline_s=0.0),
    ):
        with pytest.raises(ProtocolError):
            codec.decode(codec.encode(bad))


def test_piece_pull_round_trip_and_validation() -> None:
    """A pull of one piece of a held transfer (decision 087): held id, head range, piece count."""
    codec = Codec(None)
    piece = Pull(**HEAD, deadline_s=5.0, data_address="h:1", held="t", heads=[2, 4], pieces=2)
    assert codec.decode(codec.encode(piece)) == piece
    whole = Pull(**HEAD, deadline_s=5.0, data_address="h:1")  # the pull of before: no piece fields
    assert codec.decode(codec.encode(whole)) == whole and not whole.held
    for bad in ({"heads": [3, 3]}, {"heads": [1]}, {"heads": [-1, 2]}, {"pieces": MAX_PIECES + 1},
                {"pieces": -1}, {"held": "x" * 600}):  # fmt: skip
        msg = msgspec.structs.replace(piece, **bad)
        with pytest.raises(ProtocolError):
            codec.decode(codec.encode(msg))


def test_hmac_required_and_checked() -> None:
    signed = Codec(b"k1")
    frames = signed.encode(_offer())
    assert len(frames) == 2
    assert signed.decode(frames) == _offer()
    with pytest.raises(AuthenticationError):
        signed.decode(frames[:1])  # unsigned
    with pytest.raises(AuthenticationError):
        Codec(b"k2").decode(frames)  # other key
    with pytest.raises(AuthenticationError):
        signed.decode([frames[0] + b" ", frames[1]])  # tampered


def test_a_peers_abort_reason_is_clamped() -> None:
    """The reason is peer text the agent keeps (tombstones, up to 100,000; poll events) and logs: a
    megabyte of it is cut to MAX_REASON_LEN characters (the Abort itself still counts)."""
    codec = Codec(b"k")
    long = Abort(**HEAD, reason="peer_aborted: " + "x" * (1 << 20))
    got = codec.decode(codec.encode(long))
    assert isinstance(got, Abort) and got.transfer_id == "t-1"
    assert len(got.reason) == MAX_REASON_LEN + 3 and got.reason.startswith("peer_aborted: xxx")
    short = Abort(**HEAD, reason="deadline: no data")
    assert codec.decode(codec.encode(short)) == short
