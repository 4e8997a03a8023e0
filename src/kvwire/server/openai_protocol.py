"""OpenAI request bodies: typed decoding and validation (no engine, no HTTP).

``parse_completion`` / ``parse_chat`` turn raw body bytes into a typed request or raise
:class:`kvwire.errors.InvalidRequestError` carrying the offending ``param``; the HTTP layer turns that
into a 400 with an OpenAI-style error body. Unknown fields are ignored (clients send many), but a known
field of the wrong type is an error. Parameters we do not implement (``n > 1``, ``logprobs``, ``echo``,
penalties, ``logit_bias``, tools) are refused with 400 rather than silently ignored.
"""

from __future__ import annotations

import enum
import re
from typing import Any

import msgspec

from kvwire.errors import InvalidRequestError


class RequestKind(str, enum.Enum):
    COMPLETION = "completion"
    CHAT = "chat"


class BadRequest(InvalidRequestError):
    """An invalid request, with the name of the offending field (``param``) when known."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False


class _CommonFields(msgspec.Struct, kw_only=True):
    """Fields shared by both endpoints (``model`` is checked against the served name later)."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    logprobs: Any = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    min_tokens: int | None = None
    user: str | None = None
    # kvwire / vLLM extensions.
    kv_transfer_params: dict[str, Any] | None = None
    return_token_ids: bool = False
    # The last N prompt tokens are this answer's own earlier output (a router migrating a stream).
    kvwire_prior_output_tokens: int = 0
    # vLLM's: the answer's id is ``cmpl-<request_id>`` / ``chatcmpl-<request_id>`` (a router gives P and
    # D the same one, so that a stream that starts with P's first token keeps one id throughout).
    request_id: str | None = None


class CompletionRequest(_CommonFields, kw_only=True):
    # str | list[int] | a list of exactly one of those (checked in prompt_token_source); after
    # parse_completion, the one prompt: str | list[int].
    prompt: Any = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str
    # A string, or a list of content parts ({"type": "text", "text": ...}); None for tool calls.
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ChatRequest(_CommonFields, kw_only=True):
    messages: list[ChatMessage] = msgspec.field(default_factory=list)
    max_completion_tokens: int | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None


# The engine's thread compares each new token of the request with every stop token id and searches its
# text for every stop string: a body of millions of them slowed every request of the instance.
MAX_STOP_STRINGS = 256
MAX_STOP_TOKEN_IDS = 1024
_REQUEST_ID = re.compile(r"[\x21-\x7e]{1,256}")  # printable ASCII, no spaces: it becomes the answer's id
_PATH_FIELD = re.compile(r"at `\$\.([A-Za-z_][A-Za-z0-9_]*)")


def _decode(body: bytes, cls: type[msgspec.Struct]) -> Any:
    if not body.strip():
        raise BadRequest("request body is empty; expected a JSON object")
    try:
        return msgspec.json.decode(body, type=cls)
    except msgspec.ValidationError as exc:
        match = _PATH_FIELD.search(str(exc))
        raise BadRequest(f"invalid request: {exc}", param=match.group(1) if match else None) from exc
    except msgspec.DecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from exc
    except RecursionError as exc:  # msgspec's nesting guard (about 1,000 levels of arrays/objects)
        raise BadRequest("request body is not valid JSON: it nests arrays/objects too deeply") from exc


def parse_completion(body: bytes) -> CompletionRequest:
    """Decode and validate a ``/v1/completions`` body; its ``prompt`` comes back as the one prompt,
    text or token ids (:func:`prompt_token_source`)."""
    req: CompletionRequest = _decode(body, CompletionRequest)
    _check_common(req)
    if req.echo:
        raise BadRequest("echo is not supported", param="echo")
    if req.best_of not in (None, 1):
        raise BadRequest("best_of > 1 is not supported", param="best_of")
    if req.suffix:
        raise BadRequest("suffix is not supported", param="suffix")
    req.prompt = prompt_token_source(req)  # checked and unwrapped now (text or token ids), tokenized later
    return req


def parse_chat(body: bytes) -> ChatRequest:
    """Decode and validate a ``/v1/chat/completions`` body."""
    req: ChatRequest = _decode(body, ChatRequest)
    _check_common(req)
    if req.max_completion_tokens is not None:
        if req.max_tokens is not None and req.max_tokens != req.max_completion_tokens:
            raise BadRequest("max_tokens and max_completion_tokens disagree", param="max_completion_tokens")
        req.max_tokens = req.max_completion_tokens
    if req.tools:
        raise BadRequest("tools are not supported", param="tools")
    if req.top_logprobs:
        raise BadRequest("top_logprobs is not supported", param="top_logprobs")
    chat_messages(req)
    return req


def _check_common(req: _CommonFields) -> None:
    if req.n != 1:
        raise BadRequest("only n=1 is supported", param="n")
    if req.logprobs not in (None, False):
        raise BadRequest("logprobs are not supported", param="logprobs")
    if req.presence_penalty or req.frequency_penalty:
        raise BadRequest("presence/frequency penalties are not supported", param="presence_penalty")
    if req.logit_bias:
        raise BadRequest("logit_bias is not supported", param="logit_bias")
    if req.min_tokens:
        raise BadRequest("min_tokens is not supported", param="min_tokens")
    if req.max_tokens is not None and req.max_tokens <= 0:
        raise BadRequest(f"max_tokens must be at least 1, got {req.max_tokens}", param="max_tokens")
    if req.temperature is not None and req.temperature < 0:
        raise BadRequest(f"temperature must be >= 0, got {req.temperature}", param="temperature")
    if req.top_p is not None and not 0 < req.top_p <= 1:
        raise BadRequest(f"top_p must be in (0, 1], got {req.top_p}", param="top_p")
    if req.top_k is not None and req.top_k < -1:
        raise BadRequest(f"top_k must be -1, 0 (disabled) or positive, got {req.top_k}", param="top_k")
    if req.stop_token_ids is not None and any(t < 0 for t in req.stop_token_ids):
        raise BadRequest("stop_token_ids must be non-negative", param="stop_token_ids")
    if req.stop_token_ids is not None and len(req.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise BadRequest(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids", param="stop_token_ids")
    if req.request_id is not None and not _REQUEST_ID.fullmatch(req.request_id):
        raise BadRequest("request_id must be 1-256 printable ASCII characters without spaces",
                         param="request_id")
    if req.stream_options is not None and not req.stream:
        raise BadRequest("stream_options is only allowed with stream=true", param="stream_options")


def prompt_token_source(req: CompletionRequest) -> str | list[int]:
    """The single prompt as text or token ids. A list holding one prompt is unwrapped."""
    prompt = req.prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise BadRequest("prompt must not be empty", param="prompt")
        return prompt
    if isinstance(prompt, list):
        if not prompt:
            raise BadRequest("prompt must not be empty", param="prompt")
        if _all_token_ids(prompt):
            if min(prompt) < 0:
                raise BadRequest("prompt token ids must be non-negative", param="prompt")
            return list(prompt)
        if all(isinstance(p, (str, list)) for p in prompt):
            raise BadRequest("batched prompts are not supported: send one prompt per request", param="prompt")
    if prompt is None:
        raise BadRequest("prompt is required", param="prompt")
    raise BadRequest("prompt must be a string or a list of token ids", param="prompt")


def _all_token_ids(values: list[Any]) -> bool:
    """Whether every item is an int and none a bool. The items' types as a set first (C speed: a
    long prompt's ids are not each checked in a Python loop); the loop only when some item is not
    exactly an int (an int subclass passes, as before)."""
    if set(map(type, values)) == {int}:
        return True
    return all(isinstance(t, int) and not isinstance(t, bool) for t in values)


def chat_messages(req: ChatRequest) -> list[dict[str, str]]:
    """Messages flattened to ``{"role", "content"}`` string dicts for the chat template."""
    if not req.messages:
        raise BadRequest("messages must be a non-empty list", param="messages")
    out: list[dict[str, str]] = []
    for message in req.messages:
        if message.role not in ("system", "user", "assistant", "developer", "tool"):
            raise BadRequest(f"unknown message role {message.role!r}", param="messages")
        out.append({"role": message.role, "content": _content_text(message.content)})
    return out


def _content_text(content: str | list[dict[str, Any]] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts: list[str] = []
    for part in content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise BadRequest("only text content parts are supported", param="messages")
        parts.append(part["text"])
    return "".join(parts)


def stop_strings(req: _CommonFields) -> list[str]:
    if req.stop is None:
        return []
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop)
    if any(not s for s in stops):
        raise BadRequest("stop strings must not be empty", param="stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise BadRequest(f"at most {MAX_STOP_STRINGS} stop strings", param="stop")
    return stops


# --- vLLM's tokenizer endpoints ---------------------------------------------------------------


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """``POST /tokenize``: vLLM's body, either a ``prompt`` or chat ``messages``."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    """``POST /detokenize``: token ids back to text."""

    model: str | None = None
    tokens: list[int] = msgspec.field(default_factory=list)


def parse_tokenize(body: bytes) -> TokenizeRequest:
    req: TokenizeRequest = _decode(body, TokenizeRequest)
    if (req.prompt is None) == (req.messages is None):
        raise BadRequest("give either prompt or messages", param="prompt")
    if req.messages is not None and not req.add_generation_prompt:
        raise BadRequest("add_generation_prompt=false is not supported", param="add_generation_prompt")
    return req


def parse_detokenize(body: bytes, vocab_size: int | None) -> DetokenizeRequest:
    req: DetokenizeRequest = _decode(body, DetokenizeRequest)
    if any(t < 0 or (vocab_size is not None and t >= vocab_size) for t in req.tokens):
        raise BadRequest(f"token ids must be in [0, {vocab_size})", param="tokens")
    return req
