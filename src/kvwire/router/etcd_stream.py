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


def decode_watch_message(line: bytes) -> WatchMessage:
    """One line of the stream; raises :class:`EtcdError` for anything that is not a watch message."""
    try:
        return _decoder.decode(line)
    except (msgspec.DecodeError, RecursionError) as exc:  # nesting past msgspec's limit: RecursionError
        raise EtcdError(f"etcd watch stream: not a watch message ({exc}): {line[:200]!r}") from exc


async def watch_messages(stream: aiohttp.StreamReader) -> AsyncIterator[WatchMessage]:
    """The messages of a gateway stream, whatever their size (a message is joined from its chunks
    once, when its newline arrives)."""
    parts: list[bytes] = []
    async for chunk in stream.iter_any():
        *lines, rest = chunk.split(b"\n")
        if lines:
            lines[0] = b"".join([*parts, lines[0]])
            parts = []
            for line in lines:
                if line.strip():
                    yield decode_watch_message(line)
        if rest:
            parts.append(rest)
    tail = b"".join(parts)
    if tail.strip():
        yield decode_watch_message(tail)
