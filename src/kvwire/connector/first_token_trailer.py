"""Connector messages that cross processes (inside transfers): typed and versioned."""

from __future__ import annotations

import msgspec

from kvwire.errors import ProtocolError

TRAILER_VERSION = 1


class FirstTokenTrailer(msgspec.Struct, frozen=True, kw_only=True):
    """P -> D with the transfer's completion: the token P sampled after the prompt (``None`` when P
    ended before sampling, e.g. aborted; D then recomputes the last prompt token)."""

    token_id: int | None
    num_prompt_tokens: int
    # P's wall clock when its worker handed the last KV layer over (set by the worker): D observes
    # "P's last layer computed -> D can decode" (kvwire_pd_handover_seconds{phase="exposed"}); only
    # meaningful where both clocks agree (one host, or NTP-synchronized hosts).
    kv_ready_unix_s: float | None = None
    v: int = TRAILER_VERSION


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(FirstTokenTrailer)


def encode_trailer(trailer: FirstTokenTrailer) -> bytes:
    return _encoder.encode(trailer)


def decode_trailer(payload: bytes) -> FirstTokenTrailer:
    """Raises :class:`ProtocolError` on a malformed payload or an unknown version."""
    try:
        trailer = _decoder.decode(payload)
    except (msgspec.DecodeError, RecursionError) as exc:  # nesting past msgspec's limit: RecursionError
        raise ProtocolError(f"malformed first-token trailer: {exc}") from exc
    if trailer.v != TRAILER_VERSION:
        raise ProtocolError(f"first-token trailer version {trailer.v} not supported")
    return trailer
