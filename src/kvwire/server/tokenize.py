"""vLLM's service endpoints on an instance: ``/tokenize``, ``/detokenize`` and ``/version``.

Same bodies as vLLM's (``vllm/entrypoints/serve/tokenize``): ``/tokenize`` takes a ``prompt`` (with
``add_special_tokens``) or chat ``messages`` and answers ``{"count", "max_model_len", "tokens",
"token_strs"}``; ``/detokenize`` takes ``tokens`` and answers ``{"prompt"}``; ``/version`` answers
``{"version"}``. Clients such as vLLM's benchmark use them to align prompts with the server's
tokenizer. Tokenizing runs on the event loop thread (prompts are bounded by the request size limit).
Errors: 400 (bad body, ids outside the vocabulary), 404 (another model), in vLLM's error body.
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from kvwire import __version__
from kvwire.errors import InvalidRequestError
from kvwire.server.generate import GenerationHandler, json_response
from kvwire.server.openai_protocol import (
    BadRequest,
    ChatMessage,
    ChatRequest,
    chat_messages,
    parse_detokenize,
    parse_tokenize,
)


class TokenizeHandlers:
    """Built once per instance with its tokenizer; the handlers are aiohttp routes."""

    def __init__(self, generation: GenerationHandler, model_name: str, max_model_len: int) -> None:
        self._generation = generation  # its tokenizer, vocabulary and body deadline
        self._tokenizer = generation.tokenizer
        self._model_name = model_name
        self._max_model_len = max_model_len
        self._vocab_size = generation.vocab_size

    def add_routes(self, app: web.Application) -> None:
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_get("/version", version)

    async def tokenize(self, request: web.Request) -> web.Response:
        try:
            req = parse_tokenize(await self._generation.read_body(request))
            self._check_model(req.model)
            if req.messages is not None:
                ids = self._tokenizer.apply_chat_template(_flat(req.messages))
            else:
                assert req.prompt is not None
                ids = self._tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        except asyncio.TimeoutError:
            return self._generation.body_timeout_response()
        except _NotFound as exc:
            return _error(404, str(exc), "NotFoundError", "model")
        except InvalidRequestError as exc:
            return _error(400, str(exc), "BadRequestError", getattr(exc, "param", None))
        strs = [self._tokenizer.decode([t]) for t in ids] if req.return_token_strs else None
        return json_response(200, {"count": len(ids), "max_model_len": self._max_model_len,
                                   "tokens": ids, "token_strs": strs})

    async def detokenize(self, request: web.Request) -> web.Response:
        try:
            req = parse_detokenize(await self._generation.read_body(request), self._vocab_size)
            self._check_model(req.model)
        except asyncio.TimeoutError:
            return self._generation.body_timeout_response()
        except _NotFound as exc:
            return _error(404, str(exc), "NotFoundError", "model")
        except InvalidRequestError as exc:
            return _error(400, str(exc), "BadRequestError", getattr(exc, "param", None))
        return json_response(200, {"prompt": self._tokenizer.decode(req.tokens)})

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self._model_name:
            raise _NotFound(f"The model `{model}` does not exist (this server serves `{self._model_name}`)")


async def version(request: web.Request) -> web.Response:
    del request
    return json_response(200, {"version": __version__})


class _NotFound(BadRequest):
    pass


def _error(status: int, message: str, type_: str, param: str | None) -> web.Response:
    """vLLM's error body: ``code`` is the HTTP status."""
    error = {"message": message, "type": type_, "param": param, "code": status}
    return json_response(status, {"error": error})


def _flat(messages: list[ChatMessage]) -> list[dict[str, str]]:
    return chat_messages(ChatRequest(messages=messages))
