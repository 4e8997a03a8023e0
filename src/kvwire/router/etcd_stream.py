"""The etcd watch stream as typed messages (etcd's JSON gateway, ``POST /v3/watch``).

The gateway streams one JSON object per line; keys and values are base64, 64-bit integers strings.
:func:`watch_messages` yields each as a :class:`WatchMessage` decoded by msgspec straight into
structs (base64 to bytes, strings to ints) — no intermediate dicts, and the structs are not tracked
by the garbage collector: at 1,000 records a second the dict form was most of the router's
allocations and set off collections that held its event loop for tens of ms (decision 098).
Fields the router does not read are skipped. No torch.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import msgspec

from kvwire.discovery.etcd_gateway import EtcdError


class WatchKv(msgspec.Struct, gc=False):
    key: bytes = b""
    value: bytes = b""
    mod_revision: int = 0


class WatchEvent(msgspec.Struct, gc=False):
    type: str = "PUT"  # or "DELETE" (the gateway omits the default, PUT)
    kv: WatchKv | None = None


class WatchResult(msgspec.Struct, gc=False):
    events: list[WatchEvent] = []
    canceled: bool = False
    cancel_reason: str = ""


class WatchMessage(msgspec.Struct, gc=False):
    result: WatchResult | None = None
    error: Any = None  # the gateway's error object, when the stream fails


_decoder = msgspec.json.Decoder(WatchMessage, strict=False)
# One watch message (a line) at most: a sync of 10,000 records is ~10 MB; a stream that sends more
# without a newline is broken (or hostile) and is dropped (the watcher re-syncs).
MAX_WATCH_MESSAGE_BYTES = 64 * 1024 * 1024


def decode_watch_message(line: bytes) -> WatchMessage:
    """One line of the stream; raises :class:`EtcdError` for anything that is not a watch message."""
    try:
        return _decoder.decode(line)
    except Exception as exc:  # DecodeError, ValidationError, RecursionError (nesting)
        raise EtcdError(f"etcd watch stream: not a watch message ({exc}): {line[:200]!r}") from exc


async def watch_messages(stream: aiohttp.StreamReader) -> AsyncIterator[WatchMessage]:
    """The messages of a gateway stream, whatever their size (a message is joined from its chunks
    once, when its newline arrives)."""
    parts: list[bytes] = []
    pending = 0  # bytes in parts
    async for chunk in stream.iter_any():
        *lines, rest = chunk.split(b"\n")
        if lines:
            lines[0] = b"".join([*parts, lines[0]])
            parts, pending = [], 0
            for line in lines:
                if line.strip():
                    yield decode_watch_message(line)
        if rest:
            parts.append(rest)
            pending += len(rest)
            if pending > MAX_WATCH_MESSAGE_BYTES:
                raise EtcdError(f"etcd watch stream: a message over {MAX_WATCH_MESSAGE_BYTES} bytes")
    tail = b"".join(parts)
    if tail.strip():
        yield decode_watch_message(tail)
