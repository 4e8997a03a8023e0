"""The tokenizer a GGUF file describes, rebuilt as a Hugging Face ``tokenizers`` tokenizer.

A GGUF file stores a byte-level BPE vocabulary (``tokenizer.ggml.model == "gpt2"``) as its token
list, merge list and token types, plus the name of the pre-tokenizer its merges were learned with
(``tokenizer.ggml.pre``). The pre-tokenizer is not in the file, so each supported name maps to the
splitting llama.cpp applies for it; an unknown name is an error rather than a silently different
tokenization.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvwire.engine.gguf_reader import GGUFMetadata
from kvwire.engine.tokenizer import HFTokenizer
from kvwire.errors import ModelLoadError

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types

# Llama 3's split (its tokenizer.json), applied before the byte-level mapping.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _gpt2() -> Any:
    from tokenizers import pre_tokenizers

    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _smollm() -> Any:
    """SmolLM / StarCoder: every digit on its own, then GPT-2's split."""
    from tokenizers import pre_tokenizers

    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _gpt2()])


def _llama3() -> Any:
    from tokenizers import Regex, pre_tokenizers

    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


PRE_TOKENIZERS: dict[str, Callable[[], Any]] = {
    "gpt2": _gpt2,
    "smollm": _smollm,
    "starcoder": _smollm,
    "llama-bpe": _llama3,
    "llama3": _llama3,
}


def gguf_tokenizer(meta: GGUFMetadata, model_eos_ids: tuple[int, ...] = ()) -> HFTokenizer:
    """Raises ModelLoadError for a tokenizer model or pre-tokenizer this module does not rebuild."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ModelLoadError(
            f"{meta.path}: tokenizer model {kind!r} is not supported (byte-level BPE 'gpt2' only)"
        )
    pre = str(meta.get("tokenizer.ggml.pre", "gpt2"))
    if pre not in PRE_TOKENIZERS:
        raise ModelLoadError(
            f"{meta.path}: pre-tokenizer {pre!r} is not supported ({', '.join(sorted(PRE_TOKENIZERS))})"
        )
    tokens: list[str] = list(meta.require("tokenizer.ggml.tokens"))
    merges = [tuple(m.split(" ", 1)) for m in meta.require("tokenizer.ggml.merges")]
    types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    vocab = {token: index for index, token in enumerate(tokens)}
    raw = Tokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
    raw.pre_tokenizer = PRE_TOKENIZERS[pre]()
    raw.decoder = decoders.ByteLevel()
    # Control tokens (<|im_start|>, ...) are matched whole in text and skipped when decoding.
    typed = list(zip(tokens, types, strict=True))
    raw.add_special_tokens([AddedToken(t, special=True, normalized=False) for t, k in typed if k == _CONTROL])
    raw.add_tokens([AddedToken(t, special=False, normalized=False) for t, k in typed if k == _USER_DEFINED])
    bos = _token(tokens, meta.get("tokenizer.ggml.bos_token_id"))
    if meta.get("tokenizer.ggml.add_bos_token") and bos is not None:
        raw.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])]
        )
    extra_eos = {int(meta.get(key)) for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
                 if meta.get(key) is not None}  # fmt: skip
    return HFTokenizer(
        raw,
        bos_token=bos,
        eos_token=_token(tokens, meta.get("tokenizer.ggml.eos_token_id")),
        extra_eos_ids=extra_eos | set(model_eos_ids),
        chat_template=meta.get("tokenizer.chat_template"),
    )


def _token(tokens: list[str], token_id: Any) -> str | None:
    if token_id is None or not 0 <= int(token_id) < len(tokens):
        return None
    return tokens[int(token_id)]
