"""Structure-aware mutations for the fuzz targets (decision 113).

Byte-level mutation (atheris/libFuzzer's own) rarely builds what breaks decoders of msgpack, JSON and
length-prefixed frames: a thousand nested arrays, a length field of 2**32-1, a float of 1e999, a
lone UTF-16 surrogate. :func:`mutate` applies one such edit, chosen by a seeded ``random.Random``: it
is the custom mutator of ``kvwire bench fuzz`` (mixed with libFuzzer's) and the whole mutator of the
deterministic short run in ``tests/fuzz/``.
"""

from __future__ import annotations

import random
import struct
from collections.abc import Callable, Sequence

# msgpack: fixarray(1), array16(65535), map32 header, str32 of 2**32-1, bin32; JSON: array, object
_NEST_UNITS = (b"\x91", b"\x81\xa1k", b"\xdc\xff\xff", b"[", b'{"a":', b"\xdd\xff\xff\xff\xff")
_TOKENS = (
    b"\xc0", b"\xc2", b"\xc3", b"\xcb\x7f\xf0\x00\x00\x00\x00\x00\x00",
    b"\xcb\x7f\xf8\x00\x00\x00\x00\x00\x01",
    b"\xcf\xff\xff\xff\xff\xff\xff\xff\xff", b"\xd3\x80\x00\x00\x00\x00\x00\x00\x00", b"\xdb\xff\xff\xff\xff",
    b"\xc6\xff\xff\xff\xff", b"\xdf\xff\xff\xff\xff", b"\xd4\x01\x00", b"\xc1",
    b"1e999", b"-1e999", b"NaN", b"-0", b"9" * 40, b"0.0000001", b'"\\ud800"', b'"\\u0000"', b'"\xff\xfe"',
    b'"\xed\xa0\x80"', b'"\xc3\xa9\xf0\x9f\x98\x80"', b"null", b"true", b"[]", b"{}", b'""', b"-1",
    b'"' + b"x" * 600 + b'"',
)
_EDGE_INTS = (0, 1, 0x7F, 0x80, 0xFF, 0x7FFF, 0xFFFF, 0x7FFFFFFF, 0xFFFFFFFF, 2**63 - 1, 2**64 - 1)


def _flip(rng: random.Random, data: bytes, _: Sequence[bytes]) -> bytes:
    if not data:
        return bytes([rng.randrange(256)])
    i = rng.randrange(len(data))
    return data[:i] + bytes([data[i] ^ (1 << rng.randrange(8))]) + data[i + 1 :]


def _nest(rng: random.Random, data: bytes, _: Sequence[bytes]) -> bytes:
    """Nesting far past any decoder's recursion limit, at a random place."""
    unit = rng.choice(_NEST_UNITS)
    depth = rng.choice((64, 600, 1100, 3000))
    i = rng.randrange(len(data) + 1)
    return data[:i] + unit * depth + data[i:]


def _token(rng: random.Random, data: bytes, _: Sequence[bytes]) -> bytes:
    """Replace a span with a hostile value (extreme numbers, huge length headers, bad unicode)."""
    i = rng.randrange(len(data) + 1)
    j = min(len(data), i + rng.randrange(1, 12))
    return data[:i] + rng.choice(_TOKENS) + data[j:]


def _int_field(rng: random.Random, data: bytes, _: Sequence[bytes]) -> bytes:
    """Overwrite a 1/2/4/8-byte window (a length or count field) with an edge value."""
    width = rng.choice((1, 2, 4, 8))
    if len(data) < width:
        return data + b"\xff" * width
    i = rng.randrange(len(data) - width + 1)
    value = rng.choice(_EDGE_INTS) & ((1 << (8 * width)) - 1)
    order = rng.choice(("big", "little"))
    return data[:i] + value.to_bytes(width, order) + data[i + width :]  # type: ignore[arg-type]


def _cut(rng: random.Random, data: bytes, _: Sequence[bytes]) -> bytes:
    """Truncate, or drop a span."""
    if not data:
        return data
    i = rng.randrange(len(data))
    if rng.random() < 0.5:
        return data[:i]
    return data[:i] + data[i + rng.randrange(1, 16) :]


def _repeat(rng: random.Random, data: bytes, _: Sequence[bytes]) -> bytes:
    """Duplicate a span many times (long strings, long lists, frames that repeat)."""
    if not data:
        return data
    i = rng.randrange(len(data))
    j = min(len(data), i + rng.randrange(1, 32))
    return data[:j] + data[i:j] * rng.choice((2, 16, 200)) + data[j:]


def _splice(rng: random.Random, data: bytes, seeds: Sequence[bytes]) -> bytes:
    """Half of this input, half of another seed."""
    other = rng.choice(seeds) if seeds else data
    return data[: rng.randrange(len(data) + 1)] + other[rng.randrange(len(other) + 1) :]


def _garbage(rng: random.Random, data: bytes, _: Sequence[bytes]) -> bytes:
    i = rng.randrange(len(data) + 1)
    return data[:i] + rng.randbytes(rng.randrange(1, 24)) + data[i:]


_UNICODE = ("\u00e9", "\ud800", "\U0001f600", "\x00", "\u202e", "\ufeff", "\uffff")


def _unicode(rng: random.Random, data: bytes, _: Sequence[bytes]) -> bytes:
    """Non-ASCII, a lone surrogate (as a JSON escape or raw) or NUL inside a string: after a quote
    (JSON) or a msgpack fixstr header."""
    starts = [i + 1 for i, b in enumerate(data) if b == 0x22 or 0xA0 <= b <= 0xBF]
    i = rng.choice(starts) if starts else 0
    char = rng.choice(_UNICODE)
    if rng.random() < 0.5:
        piece = char.encode("utf-8", "surrogatepass")
    else:
        piece = "".join(f"\\u{ord(c):04x}" if ord(c) < 0x10000 else c for c in char).encode("utf-8")
    return data[:i] + piece + data[i:]


def _float(rng: random.Random, data: bytes, _: Sequence[bytes]) -> bytes:
    """A msgpack float64 of inf/nan/huge at a random place."""
    value = rng.choice((float("inf"), float("-inf"), float("nan"), 1e308, -0.0, 5e-324))
    i = rng.randrange(len(data) + 1)
    return data[:i] + b"\xcb" + struct.pack("!d", value) + data[i:]


MUTATIONS: tuple[Callable[[random.Random, bytes, Sequence[bytes]], bytes], ...] = (
    _flip, _nest, _token, _int_field, _cut, _repeat, _splice, _garbage, _float, _unicode,
)


def mutate(rng: random.Random, data: bytes, seeds: Sequence[bytes], max_len: int) -> bytes:
    """One to three structured edits of ``data``, at most ``max_len`` bytes (the selector byte of
    targets with variants is kept at the front by most edits: they rarely touch byte 0)."""
    for _ in range(rng.randrange(1, 4)):
        data = rng.choice(MUTATIONS)(rng, data, seeds)
    return data[:max_len]


def inputs(seeds: Sequence[bytes], count: int, seed: int, max_len: int) -> list[bytes]:
    """``count`` deterministic mutants of ``seeds`` (each a mutation of a seed or of an earlier mutant)."""
    rng = random.Random(seed)
    pool = list(seeds) or [b""]
    out: list[bytes] = []
    for _ in range(count):
        parent = rng.choice(pool) if rng.random() < 0.7 or not out else rng.choice(out)
        out.append(mutate(rng, parent, pool, max_len))
    return out
