"""Connector messages that cross processes (inside transfers): typed and versioned. Encoded and
decoded by the worker half (:func:`kvwire.connector.worker.encode_trailer` / ``decode_trailer``), the
one place that sends and reads them."""

from __future__ import annotations

import msgspec

TRAILER_VERSION = 1


class FirstTokenTrailer(msgspec.Struct, frozen=True, kw_only=True):
    """P -> D with the transfer's completion: the token P sampled after the prompt (``None`` when P
    ended before sampling, e.g. aborted; D then recomputes the last prompt token)."""

    token_id: int | None
    num_prompt_tokens: int
    # P's wall clock when its forward wrote the last KV layer (set by the worker): D observes
    # "P's last layer computed -> D can decode" (kvwire_pd_handover_seconds{phase="exposed"}); only
    # meaningful where both clocks agree (one host, or NTP-synchronized hosts).
    kv_ready_unix_s: float | None = None
    v: int = TRAILER_VERSION
