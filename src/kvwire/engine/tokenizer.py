"""The engine's tokenizers; they live in :mod:`kvwire.tokenizer` (no torch) so that the router can
tokenize prompts exactly as the engine does (KV-aware routing)."""

from __future__ import annotations

from kvwire.tokenizer import ByteTokenizer, HFTokenizer, IncrementalDetokenizer, Tokenizer

__all__ = ["ByteTokenizer", "HFTokenizer", "IncrementalDetokenizer", "Tokenizer"]
