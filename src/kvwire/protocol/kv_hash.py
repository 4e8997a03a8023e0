"""Prefix-cache block hashes: the one definition shared by instances and the router.

A block holds ``block_size`` token ids. Block ``i``'s hash covers its own tokens *and* every token
before it (a chain): ``h_i = H(h_{i-1}, tokens[i*bs:(i+1)*bs])`` with ``h_{-1} = 0``, where ``H`` is
BLAKE2b (8-byte digest, read as an unsigned 64-bit integer) over the parent hash and the token ids,
each as 8 little-endian bytes. Only full blocks have a hash. Two sequences share block ``i``'s hash
exactly when they share their first ``(i+1)*bs`` tokens (up to 64-bit collisions).

Unlike Python's ``hash()``, the value does not depend on the interpreter or the process, so an
instance can announce hashes (KV events, :mod:`kvwire.discovery.heartbeats`) and the router can
compute the same hashes for an incoming prompt and look them up. Pure Python, no torch.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

BlockHash = int  # unsigned 64-bit
ROOT_HASH: BlockHash = 0  # the parent of block 0

_PARENT = struct.Struct("<Q")


def hash_block(parent: BlockHash, tokens: Sequence[int]) -> BlockHash:
    """The chained hash of one full block of ``tokens`` following a block whose hash is ``parent``."""
    h = hashlib.blake2b(_PARENT.pack(parent), digest_size=8)
    h.update(struct.pack(f"<{len(tokens)}q", *tokens))
    return int.from_bytes(h.digest(), "little")


def block_hashes(
    token_ids: Sequence[int], block_size: int, num_tokens: int | None = None,
    memo: list[BlockHash] | None = None,
) -> list[BlockHash]:
    """Chained hashes of the full blocks of ``token_ids[:num_tokens]`` (all tokens when None).

    ``memo`` (a list owned by the caller, extended in place) keeps earlier blocks' hashes so that a
    growing sequence hashes each block once; the result is a prefix of it.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    n = len(token_ids) if num_tokens is None else min(num_tokens, len(token_ids))
    hashes = [] if memo is None else memo
    parent = hashes[-1] if hashes else ROOT_HASH
    for start in range(len(hashes) * block_size, n - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes[: max(n, 0) // block_size]
