"""Tokenizers: a byte-level one for the built-in presets (no files) and a wrapper around a local
Hugging Face ``tokenizer.json`` (``tokenizers`` library) with the chat template of
``tokenizer_config.json`` rendered by jinja2. Plus incremental detokenization for streaming."""

from __future__ import annotations

import abc
import functools
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvwire.errors import InvalidRequestError, ModelLoadError


class Tokenizer(abc.ABC):
    eos_token_id: int | None
    eos_token_ids: frozenset[int]  # every token that ends generation (eos + generation_config's)
    vocab_size: int

    @abc.abstractmethod
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Text -> token ids, with the model's special prefix (BOS) when it uses one (unless
        ``add_special_tokens`` is False: vLLM's ``/tokenize`` option)."""

    @abc.abstractmethod
    def decode(self, token_ids: list[int]) -> str:
        """Token ids -> text, special tokens skipped."""

    @abc.abstractmethod
    def apply_chat_template(self, messages: list[dict[str, Any]]) -> list[int]:
        """Chat messages ({"role", "content"}) -> prompt token ids, ending with the assistant cue."""


class ByteTokenizer(Tokenizer):
    """One token per UTF-8 byte (ids 0..255) plus four specials. Used by the presets."""

    BOS, EOS, IM_START, IM_END = 256, 257, 258, 259
    NUM_TOKENS = 260

    def __init__(self) -> None:
        self.eos_token_id = self.EOS
        self.eos_token_ids = frozenset({self.EOS, self.IM_END})
        self.vocab_size = self.NUM_TOKENS

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        body = list(text.encode("utf-8"))
        return [self.BOS, *body] if add_special_tokens else body

    def decode(self, token_ids: list[int]) -> str:
        return bytes(t for t in token_ids if 0 <= t < 256).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> list[int]:
        ids = [self.BOS]
        for message in _checked_messages(messages):
            body = f"{message['role']}\n{message['content']}".encode()
            ids += [self.IM_START, *body, self.IM_END, *b"\n"]
        return [*ids, self.IM_START, *b"assistant\n"]


class HFTokenizer(Tokenizer):
    """A Hugging Face ``tokenizers`` tokenizer plus the metadata chat generation needs (BOS/EOS
    spellings, extra end-of-generation ids, the chat template). Built from a local HF directory
    (:meth:`from_dir`) or from a GGUF file (``kvwire.engine.gguf_tokenizer``)."""

    def __init__(
        self,
        raw: Any,
        *,
        bos_token: str | None,
        eos_token: str | None,
        extra_eos_ids: set[int] | None = None,
        chat_template: str | None = None,
    ) -> None:
        self._tok = raw
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.bos_token, self.eos_token = bos_token, eos_token
        eos_id = self._id(eos_token)
        eos_ids = {i for i in [eos_id, *(extra_eos_ids or ())] if i is not None}
        self.eos_token_id = eos_id if eos_id is not None else (min(eos_ids) if eos_ids else None)
        self.eos_token_ids = frozenset(eos_ids)
        self.chat_template = chat_template
        self.source_dir: Path | None = None  # the local directory it was read from, if any

    @classmethod
    def from_dir(cls, model_dir: Path, model_eos_ids: list[int] | None = None) -> HFTokenizer:
        """``tokenizer.json`` (+ ``tokenizer_config.json``, ``generation_config.json``,
        ``chat_template.jinja`` when present)."""
        from tokenizers import Tokenizer as RawTokenizer

        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise ModelLoadError(f"{model_dir}: no tokenizer.json")
        config = _read_json(model_dir / "tokenizer_config.json")
        gen = _read_json(model_dir / "generation_config.json").get("eos_token_id")
        eos_ids = set(model_eos_ids or ()) | set(
            gen if isinstance(gen, list) else [gen] if isinstance(gen, int) else []
        )
        chat_template = config.get("chat_template")
        if chat_template is None and (model_dir / "chat_template.jinja").is_file():
            chat_template = (model_dir / "chat_template.jinja").read_text()
        tokenizer = cls(
            RawTokenizer.from_file(str(path)),
            bos_token=_token_text(config.get("bos_token")),
            eos_token=_token_text(config.get("eos_token")),
            extra_eos_ids=eos_ids,
            chat_template=chat_template,
        )
        tokenizer.source_dir = model_dir  # announced to routers (a model id's cache snapshot)
        return tokenizer

    def _id(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, token_ids: list[int]) -> str:
        return str(self._tok.decode(token_ids, skip_special_tokens=True))

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> list[int]:
        messages = _checked_messages(messages)
        if not self.chat_template:
            text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
            return self.encode(text)
        import jinja2

        try:
            text = self._template.render(
                messages=messages,
                add_generation_prompt=True,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except jinja2.TemplateError as exc:
            raise InvalidRequestError(f"chat template failed: {exc}") from exc
        # The template writes the special tokens itself.
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    @functools.cached_property
    def _template(self) -> Any:
        """The chat template compiled once, on first use (compiling costs far more than rendering;
        a template that does not compile raises jinja2.TemplateError on every request)."""
        import jinja2.sandbox

        assert self.chat_template is not None, "only used when the model has a chat template"
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_template_error
        return env.from_string(self.chat_template)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas in O(total) decode work: decodes a
    small window (prefix context + new tokens) and holds back incomplete UTF-8 sequences."""

    def __init__(self, tokenizer: Tokenizer, prior: Sequence[int] = ()) -> None:
        """``prior``: output tokens produced before this detokenizer (elsewhere): replayed, so the
        state (held-back bytes included) is what it was after them; their text is not re-emitted."""
        self._tokenizer = tokenizer
        self._prefix_offset = 0
        self._read_offset = 0
        self.text = ""
        self._prior = list(prior)
        for end in range(1, len(self._prior) + 1):
            self._step(self._prior[:end], final=False)
        self._prior_text_len = len(self.text)

    @property
    def output_text(self) -> str:
        """The text of the tokens after ``prior``."""
        return self.text[self._prior_text_len :]

    def step(self, token_ids: list[int], final: bool = False) -> str:
        """``token_ids`` = all output tokens so far (after ``prior``); returns the text they add (may
        be ""). ``final`` flushes what was held back (an incomplete UTF-8 sequence at the end)."""
        return self._step(self._prior + token_ids if self._prior else token_ids, final)

    def _step(self, token_ids: list[int], final: bool) -> str:
        prefix = self._tokenizer.decode(token_ids[self._prefix_offset : self._read_offset])
        full = self._tokenizer.decode(token_ids[self._prefix_offset :])
        if len(full) <= len(prefix) or (full.endswith("\ufffd") and not final):
            return ""
        delta = full[len(prefix) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(token_ids)
        self.text += delta
        return delta


def _checked_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages must be a non-empty list")
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise InvalidRequestError("each message needs a string 'role'")
        if not isinstance(m.get("content"), str):
            raise InvalidRequestError("each message needs a string 'content'")
    return messages


def _raise_template_error(message: str) -> None:
    import jinja2

    raise jinja2.TemplateError(message)


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc
    return data if isinstance(data, dict) else {}
