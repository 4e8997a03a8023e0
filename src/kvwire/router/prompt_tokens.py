"""The router's prompt tokenizer: a request's prompt token ids, as the serving instances compute them.

KV-aware routing hashes the prompt's blocks and looks them up in the KV index, so the router must
tokenize exactly like the instances: completions' ``prompt`` (text, or token ids taken as they
are) with the model's tokenizer, chat ``messages`` through its chat template (the same
:mod:`kvwire.tokenizer` code the built-in engine runs). Which tokenizer: ``--tokenizer`` when given
(``byte`` or a local Hugging Face model directory), else what the instances announce
(``InstanceInfo.tokenizer``). A tokenizer that cannot be loaded, or a prompt it cannot handle,
gives ``None`` (logged once per tokenizer): the request is then routed on load alone.
No torch.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from kvwire import hub
from kvwire.errors import KvwireError
from kvwire.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

log = logging.getLogger(__name__)

BYTE = "byte"


class PromptTokenizer:
    """Loads tokenizers lazily, one per spec; event-loop thread only."""

    def __init__(self, override: str | None = None) -> None:
        self._override = override or None
        self._loaded: dict[str, Tokenizer | None] = {}

    def tokenizer(self, announced: str) -> Tokenizer | None:
        spec = self._override or announced
        if not spec:
            return None
        if spec not in self._loaded:
            self._loaded[spec] = _load(spec)
        return self._loaded[spec]

    def token_ids(self, path: str, body: dict[str, Any], announced: str) -> list[int] | None:
        """The prompt's token ids for a completions (``path`` not ending in ``/chat/completions``) or
        chat body; None when unknown (no tokenizer, or a prompt the instance will reject)."""
        if path.endswith("/chat/completions"):
            messages = _chat_messages(body.get("messages"))
            tok = None if messages is None else self.tokenizer(announced)
            if messages is None or tok is None:
                return None
            try:
                return tok.apply_chat_template(messages)
            except KvwireError:
                return None
        prompt = _single_prompt(body.get("prompt"))
        if prompt is None or isinstance(prompt, list):
            return prompt
        tok = self.tokenizer(announced)
        return None if tok is None else tok.encode(prompt)


def _load(spec: str) -> Tokenizer | None:
    if spec == BYTE:
        return ByteTokenizer()
    try:
        path = Path(spec)
        if not path.is_dir() and hub.is_repo_id(spec):  # --tokenizer ORG/NAME: the Hugging Face cache
            path = hub.resolve_tokenizer(spec)
        return HFTokenizer.from_dir(path)
    except (KvwireError, OSError, ImportError, ValueError) as exc:
        log.warning("KV-aware routing: cannot load tokenizer %r (%s); routing such requests on load only",
                    spec, exc)
        return None


def _single_prompt(prompt: Any) -> str | list[int] | None:
    """The server's accepted prompt shapes (``prompt_token_source``); None for anything else."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return prompt
    if isinstance(prompt, list) and prompt and all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt
    ):
        return list(prompt)
    return None


def _chat_messages(messages: Any) -> list[dict[str, Any]] | None:
    """Messages flattened like the server's ``chat_messages`` (text content parts joined)."""
    if not isinstance(messages, list) or not messages:
        return None
    out: list[dict[str, Any]] = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            return None
        content = m.get("content")
        if isinstance(content, list):
            parts = [p.get("text") for p in content if isinstance(p, dict)]
            if len(parts) != len(content) or not all(isinstance(p, str) for p in parts):
                return None
            content = "".join(parts)  # type: ignore[arg-type]
        elif content is None:
            content = ""
        if not isinstance(content, str):
            return None
        out.append({"role": m["role"], "content": content})
    return out
