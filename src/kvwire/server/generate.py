"""``/v1/completions`` and ``/v1/chat/completions``: request -> engine -> JSON body or SSE stream.

Runs on the event loop thread. Contract per request: a parse/validation failure is a 400 (404 for an
unknown model) and touches no engine state; once admitted, the request always ends with exactly one of
a full body, a finished stream, an error (500 engine failure, 503 shutdown or engine stall; in a
stream an error event then ``[DONE]``) or an abort when the client went away (the ``finally`` below
aborts it in the engine, which frees its KV blocks). A client that stops reading counts as gone:
every write of a response after admission (each SSE event; the whole JSON body of a non-streaming
answer) has a deadline (``client_write_timeout_s``, see :mod:`kvwire.http.front_door`), after which its
connection is aborted (outcome ``client_timeout``).

Also here, as the handler uses them: the middleware that turns every other error of the app into
an OpenAI error body (:func:`errors_as_json`), the request's :class:`RequestStream` (the engine loop
puts its outputs there), the OpenAI response bodies and SSE chunks (:class:`ResponseBuilder`, pure
functions of their inputs) and the request's latency metrics (:class:`RequestTimer`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from aiohttp import web

from kvwire.engine import SamplingParams
from kvwire.errors import (
    INSTANCE_LOST,
    INSTANCE_STOPPING,
    EngineError,
    EngineStalled,
    ForbiddenError,
    InvalidRequestError,
    RankLost,
    ServerShuttingDown,
)
from kvwire.http.front_door import ClientWriter, client_gone
from kvwire.protocol.kv_params import KVTransferParams, endpoints_checked
from kvwire.server.engine_loop import EngineLoop, RequestOutbox, TimedOutput
from kvwire.server.metrics import ServerMetrics
from kvwire.server.openai_protocol import (
    BadRequest,
    RequestKind,
    chat_messages,
    parse_chat,
    parse_completion,
    stop_strings,
)

logger = logging.getLogger(__name__)

_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat runs to the model length


def json_response(status: int, body: dict[str, Any]) -> web.Response:
    return web.Response(status=status, body=json_bytes(body), content_type="application/json")


def error_response(
    status: int, message: str, err_type: str = "invalid_request_error", param: str | None = None,
    reason: str | None = None,
) -> web.Response:
    return json_response(status, error_body(status, message, err_type, param, reason))


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

_ERROR_TYPES = {404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error"}


@web.middleware
async def errors_as_json(request: web.Request, handler: Handler) -> web.StreamResponse:
    """The app's last middleware: an unknown route or method, an oversized body and any unexpected
    exception get the OpenAI error body (``{"error": {"message", "type", "param", "code"}}``), never
    an empty reply. Errors become HTTP statuses here, once."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        default_type = "invalid_request_error" if exc.status < 500 else "server_error"
        err_type = _ERROR_TYPES.get(exc.status, default_type)
        return error_response(exc.status, exc.reason if exc.text is None else exc.text, err_type)
    except ConnectionResetError as exc:  # the client went away (a body read or a write): not an error
        return client_gone(request, exc)
    except Exception as exc:  # the one place an unexpected error becomes an HTTP status
        logger.exception("unhandled error on %s %s", request.method, request.path)
        return error_response(500, f"internal server error: {type(exc).__name__}: {exc}", "server_error")


RETRY_AFTER_S = 1  # what a client refused for a full waiting queue is told to wait


def queue_full_response(max_waiting: int) -> web.Response:
    """429: the waiting queue holds ``max_waiting`` requests (``--max-waiting-requests``)."""
    response = error_response(
        429, f"the server's waiting queue is full ({max_waiting} requests); retry later",
        "rate_limit_error", reason="queue_full")
    response.headers["Retry-After"] = str(RETRY_AFTER_S)
    return response


@dataclasses.dataclass(frozen=True)
class Reply:
    """A non-streaming answer: HTTP status, metrics outcome, JSON body (OpenAI's, or its error body)."""

    status: int
    outcome: str
    body: dict[str, Any]

    @classmethod
    def failure(cls, exc: ServerShuttingDown | EngineError) -> Reply:
        """An engine-side failure: shutdown, an engine stall and a lost rank are 503 (retry elsewhere;
        ``instance_lost`` also tells a router to take this instance out of routing), else 500."""
        if isinstance(exc, RankLost):
            return cls(503, "lost", error_body(503, str(exc), "server_error", reason=INSTANCE_LOST))
        if isinstance(exc, ServerShuttingDown):
            return cls(503, "shutdown", error_body(503, str(exc), "server_error", reason=INSTANCE_STOPPING))
        if isinstance(exc, EngineStalled):
            return cls(503, "stalled", error_body(503, str(exc), "server_error", reason="engine_stalled"))
        return cls(500, "error", error_body(500, str(exc), "server_error"))


class ModelNotFound(InvalidRequestError):
    pass


@dataclasses.dataclass(frozen=True)
class Prepared:
    """A validated request, ready for the engine."""

    kind: RequestKind
    prompt_token_ids: list[int]
    params: SamplingParams
    kv_transfer_params: KVTransferParams | None
    stream: bool
    include_usage: bool
    return_token_ids: bool
    response_id: str | None = None  # from the request's ``request_id`` (vLLM's field), else the engine's id


class RequestStream(RequestOutbox):
    """Outputs of one request, in order; ends after the finished output. Event-loop thread only. The
    engine loop puts into it (``put_nowait``, the queue's own); the handler iterates it."""

    def __init__(self, request_id: str) -> None:
        super().__init__()
        self.request_id = request_id
        self.arrival_s = time.monotonic()
        self.finished = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> TimedOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.output.finished:
            self.finished = True
        return item


class GenerationHandler:
    def __init__(
        self, engine_loop: EngineLoop, tokenizer: Any, metrics: ServerMetrics, model_name: str,
        max_model_len: int, accepts_kv_transfer_params: bool,
        check_kv_transfer_params: Callable[[object], object] | None = None,
        withdraw_kv_transfer_params: Callable[[KVTransferParams, str], None] | None = None,
        client_write_timeout_s: float = 30.0,
        vocab_size: int | None = None,
        max_waiting_requests: int = 0,
        body_timeout_s: float = 30.0,
    ) -> None:
        self._loop = engine_loop
        self._tokenizer = tokenizer
        self._metrics = metrics
        self._model_name = model_name
        self._max_model_len = max_model_len
        # The model's vocabulary (it may be larger than the tokenizer's: ids the model generated are
        # valid input, e.g. a migrated answer's continuation), else the tokenizer's.
        self._vocab_size: int | None = vocab_size or getattr(tokenizer, "vocab_size", None)
        self._accepts_kv = accepts_kv_transfer_params
        # The admission check (the router's signature with a shared secret -> 403; the endpoints'
        # form, then the connector's own check: role served, endpoints present -> 400).
        self._check_kv = check_kv_transfer_params or endpoints_checked()
        # ... and what undoes its promise for a request the engine never took.
        self._withdraw_kv = withdraw_kv_transfer_params
        self._write_timeout_s = client_write_timeout_s  # deadline of each write to a streaming client
        self._max_waiting = max_waiting_requests  # 0: no bound on the waiting queue
        self._body_timeout_s = body_timeout_s  # a body that does not arrive in time: 408
        self.draining = False  # set on shutdown: new requests get 503
        self.open_requests = 0  # requests between arrival and their last byte written (drain waits on it)

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    @property
    def vocab_size(self) -> int | None:
        return self._vocab_size

    async def read_body(self, request: web.Request) -> bytes:
        """The request's body within ``--http-body-timeout-s`` (``asyncio.TimeoutError`` past it: 408)
        and ``--max-request-bytes`` (aiohttp's ``HTTPRequestEntityTooLarge``: 413).

        The handler's cancellation (the client went away) always propagates, also when the body's
        last bytes arrive in the same loop iteration: not ``asyncio.wait_for``, which before Python
        3.12 returns the body then (CPython gh-86296), so that the request would be admitted for a
        client that is gone and, not streamed, never aborted (decision 146)."""
        read = asyncio.ensure_future(request.read())
        try:
            done, _ = await asyncio.wait({read}, timeout=self._body_timeout_s)
        finally:
            if not read.done():
                read.cancel()  # timed out, or the client went away
            elif not read.cancelled():
                read.exception()  # retrieved (raised below unless the client went away)
        if not done:
            raise asyncio.TimeoutError(f"request body not read within {self._body_timeout_s:g} s")
        return read.result()

    def body_timeout_response(self) -> web.Response:
        return error_response(408, f"request body did not arrive within {self._body_timeout_s:g} s "
                              "(--http-body-timeout-s)")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, RequestKind.COMPLETION)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, RequestKind.CHAT)

    # --- admission -----------------------------------------------------------------------------

    async def _handle(self, request: web.Request, kind: RequestKind) -> web.StreamResponse:
        self.open_requests += 1  # the event loop's thread only: no lock
        try:
            return await self._handle_one(request, kind)
        finally:
            self.open_requests -= 1

    async def _handle_one(self, request: web.Request, kind: RequestKind) -> web.StreamResponse:
        admitted = await self._admit(request, kind)
        if isinstance(admitted, web.Response):
            return admitted
        request_id, stream, prepared = admitted
        builder = ResponseBuilder(kind, prepared.response_id or request_id, self._model_name,
                                  int(time.time()), prepared.return_token_ids)
        writer = ClientWriter(request, self._write_timeout_s, request_id)
        try:
            if prepared.stream:
                return await self._stream(writer, stream, builder, prepared)
            reply = await self._collect(stream, builder, prepared)
            return await self._send(writer, prepared.kind.value, reply)
        finally:
            if not stream.finished:  # client went away (cancelled / connection reset / stopped reading)
                self._loop.abort(request_id)
                self._count(kind.value, "client_timeout" if writer.timed_out else "disconnect")

    async def _admit(
        self, request: web.Request, kind: RequestKind
    ) -> web.Response | tuple[str, RequestStream, Prepared]:
        """Validate and hand to the engine: (request id, stream, request) or an error response."""
        endpoint = kind.value
        if self.draining:
            self._count(endpoint, "shutdown")
            return error_response(
                503, "the server is shutting down", "server_error", reason=INSTANCE_STOPPING
            )
        if self._max_waiting and self._loop.num_waiting >= self._max_waiting:
            self._count(endpoint, "queue_full")
            return queue_full_response(self._max_waiting)
        prepared = await self._read_and_prepare(request, kind)
        if isinstance(prepared, web.Response):
            return prepared
        request_id = f"{_id_prefix(kind)}-{uuid.uuid4().hex}"  # the engine's: unique whatever the client sent
        stream = RequestStream(request_id)
        try:
            try:
                await self._loop.add_request(request_id, stream, prepared.prompt_token_ids, prepared.params,
                                             prepared.kv_transfer_params)
            except BaseException as exc:  # not admitted (or admitted and aborted): P's promise ends
                if prepared.kv_transfer_params is not None and self._withdraw_kv is not None:
                    self._withdraw_kv(prepared.kv_transfer_params, f"not admitted: {type(exc).__name__}")
                raise
        except InvalidRequestError as exc:
            self._count(endpoint, "invalid")
            return error_response(400, str(exc))
        except (ServerShuttingDown, EngineError) as exc:
            return self._failure_response(endpoint, exc)
        self._metrics.prompt_tokens.inc(len(prepared.prompt_token_ids))
        return request_id, stream, prepared

    async def _read_and_prepare(self, request: web.Request, kind: RequestKind) -> Prepared | web.Response:
        """The request's body read (within ``--max-request-bytes``) and validated, or the error
        response (413, 408, 400, 404, 403), counted."""
        endpoint = kind.value
        try:
            return self._prepare(await self.read_body(request), kind)
        except asyncio.TimeoutError:
            self._count(endpoint, "body_timeout")
            return self.body_timeout_response()
        except web.HTTPRequestEntityTooLarge as exc:
            self._count(endpoint, "too_large")
            return error_response(413, exc.text or "request body too large")
        except RecursionError:  # msgspec's nesting guard (about 1,000 levels of arrays/objects)
            self._count(endpoint, "invalid")
            return error_response(400, "request body nests JSON arrays/objects too deeply")
        except ModelNotFound as exc:
            self._count(endpoint, "invalid")
            return error_response(404, str(exc), "invalid_request_error", "model", "model_not_found")
        except BadRequest as exc:
            self._count(endpoint, "invalid")
            return error_response(400, str(exc), param=exc.param, reason=exc.code)
        except InvalidRequestError as exc:
            self._count(endpoint, "invalid")
            return error_response(400, str(exc))
        except ForbiddenError as exc:  # e.g. unsigned kv_transfer_params (counted where refused)
            self._count(endpoint, "forbidden")
            return error_response(403, str(exc), "permission_error", "kv_transfer_params", exc.reason)

    def _prepare(self, body: bytes, kind: RequestKind) -> Prepared:
        if kind is RequestKind.COMPLETION:
            req: Any = parse_completion(body)
            source = req.prompt  # text or token ids (parse_completion resolved it)
            prompt_ids = self._tokenizer.encode(source) if isinstance(source, str) else source
            default_max: int | None = DEFAULT_COMPLETION_MAX_TOKENS
        else:
            req = parse_chat(body)
            prompt_ids = self._tokenizer.apply_chat_template(chat_messages(req))
            default_max = None
        if req.model is not None and req.model != self._model_name:
            raise ModelNotFound(f"The model `{req.model}` does not exist (this server serves "
                                f"`{self._model_name}`)")
        self._check_prompt(prompt_ids)
        room = self._max_model_len - len(prompt_ids)
        max_tokens = req.max_tokens if req.max_tokens is not None else min(room, default_max or room)
        if max_tokens > room:
            raise BadRequest(
                f"This model's maximum context length is {self._max_model_len} tokens. However, you "
                f"requested {len(prompt_ids) + max_tokens} tokens ({len(prompt_ids)} in the prompt, "
                f"{max_tokens} for the completion). Please reduce the prompt or max_tokens.",
                param="max_tokens", code="context_length_exceeded")
        return Prepared(
            kind=kind,
            prompt_token_ids=prompt_ids,
            params=self._sampling_params(req, max_tokens),
            kv_transfer_params=self._kv_params(req.kv_transfer_params),
            stream=req.stream,
            include_usage=bool(req.stream_options and req.stream_options.include_usage),
            return_token_ids=req.return_token_ids,
            response_id=None if req.request_id is None else f"{_id_prefix(kind)}-{req.request_id}",
        )

    def _check_prompt(self, prompt_ids: list[int]) -> None:
        if not prompt_ids:
            raise BadRequest("prompt must not be empty", param="prompt")
        if self._vocab_size is not None and max(prompt_ids) >= self._vocab_size:
            raise BadRequest(f"prompt token ids must be < the vocabulary size {self._vocab_size}",
                             param="prompt")
        if len(prompt_ids) >= self._max_model_len:
            raise BadRequest(
                f"This model's maximum context length is {self._max_model_len} tokens; the prompt has "
                f"{len(prompt_ids)} tokens, which leaves no room for a completion.",
                param="prompt", code="context_length_exceeded")

    @staticmethod
    def _sampling_params(req: Any, max_tokens: int) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_k=0 if req.top_k in (None, -1) else req.top_k,
            top_p=1.0 if req.top_p is None else req.top_p,
            seed=req.seed,
            stop=stop_strings(req),
            stop_token_ids=req.stop_token_ids or (),
            ignore_eos=req.ignore_eos,
            prior_output_tokens=req.kvwire_prior_output_tokens,
        )

    def _kv_params(self, params: dict[str, Any] | None) -> KVTransferParams | None:
        """The request's ``kv_transfer_params``, parsed and checked once, here at the edge; the engine
        and the connector get the typed value."""
        if params is None:
            return None
        if not self._accepts_kv:
            raise BadRequest("kv_transfer_params given, but this instance has no KV connector "
                             "(start it with --role prefill or decode)", param="kv_transfer_params")
        try:
            typed = KVTransferParams.from_dict(params)
            checked = self._check_kv(typed)
        except InvalidRequestError as exc:
            raise BadRequest(str(exc), param="kv_transfer_params") from exc
        return checked if isinstance(checked, KVTransferParams) else typed

    # --- responses -----------------------------------------------------------------------------

    async def _collect(self, stream: RequestStream, builder: ResponseBuilder, prepared: Prepared) -> Reply:
        """Wait for the request to finish; its body or error body."""
        timer = RequestTimer(self._metrics, stream.arrival_s)
        last: Any = None
        try:
            async for item in stream:
                timer.on_tokens(len(item.output.new_token_ids), item.time_s)
                last = item.output
        except (ServerShuttingDown, EngineError) as exc:
            return Reply.failure(exc)
        timer.on_finish(time.monotonic())
        reason = last.finish_reason or "stop"
        if reason == "error":
            message = f"engine error: {last.error or 'unknown'}"
            return Reply(500, reason, error_body(500, message, "server_error"))
        if reason == "abort":
            message = "the request was aborted by the engine"
            return Reply(503, reason, error_body(503, message, "server_error"))
        usage = usage_body(last.num_prompt_tokens or len(prepared.prompt_token_ids), len(last.token_ids))
        body = builder.full(last.text, list(last.token_ids), reason, usage, last.kv_transfer_params,
                            prepared.prompt_token_ids)
        return Reply(200, reason, body)

    async def _send(self, writer: ClientWriter, endpoint: str, reply: Reply) -> web.StreamResponse:
        """Write a non-streaming answer here, under the write deadline, rather than leave it to aiohttp
        after the handler returns, where a client that does not read would hold it for ever. Counted
        as its outcome, or ``client_timeout`` when the deadline cut the client off."""
        try:
            return await writer.send_body(
                json_bytes(reply.body), status=reply.status, content_type="application/json"
            )
        except ConnectionResetError as exc:  # client gone or cut off; nothing is left to abort
            logger.debug("client of %s %s disconnected: %s", endpoint, reply.outcome, exc)
            return writer.response  # opened (send_body opens first): aiohttp sees it failed
        finally:  # also when the abort's connection loss cancelled this handler
            self._count(endpoint, "client_timeout" if writer.timed_out else reply.outcome)

    async def _stream(
        self, writer: ClientWriter, stream: RequestStream, builder: ResponseBuilder, prepared: Prepared
    ) -> web.StreamResponse:
        response = web.StreamResponse(headers=_SSE_HEADERS)
        try:
            first = builder.first_chunk()
            extras = _first_extras(prepared) if builder.return_token_ids else {}
            if first is not None:
                first.update(extras)
                extras = {}
            # the status line and headers go out now, with the first chunk when there is one
            await writer.write(sse_event(first) if first is not None else b"", opening=response)
            outcome, usage = await self._stream_outputs(writer, stream, builder, prepared, extras)
            self._count(prepared.kind.value, outcome)
            usage_chunk = b""
            if usage is not None and prepared.include_usage:
                usage_chunk = sse_event(builder.usage_chunk(usage))
            await writer.write(usage_chunk + SSE_DONE, last=True)
        except ConnectionResetError as exc:  # client gone mid-stream; the caller's finally aborts the request
            logger.debug("client of %s disconnected: %s", builder.response_id, exc)
        return response

    async def _stream_outputs(
        self, writer: ClientWriter, stream: RequestStream, builder: ResponseBuilder,
        prepared: Prepared, extras: dict[str, Any],
    ) -> tuple[str, dict[str, int] | None]:
        """Write content chunks (``extras`` go into the first); returns (outcome, usage or None when
        it ended in an error)."""
        timer = RequestTimer(self._metrics, stream.arrival_s)
        try:
            async for item in stream:
                out = item.output
                timer.on_tokens(len(out.new_token_ids), item.time_s)
                if out.finished and out.finish_reason == "error":
                    message = f"engine error: {out.error}"
                    await writer.write(sse_event(error_body(500, message, "server_error")))
                    return "error", None
                if out.new_token_ids or out.new_text or out.finished:
                    reason = (out.finish_reason or "stop") if out.finished else None
                    chunk = builder.chunk(out.new_text, list(out.new_token_ids), reason,
                                          out.kv_transfer_params)
                    chunk.update(extras)
                    extras = {}
                    await writer.write(sse_event(chunk))
                if out.finished:
                    timer.on_finish(time.monotonic())
                    num_prompt = out.num_prompt_tokens or len(prepared.prompt_token_ids)
                    return out.finish_reason or "stop", usage_body(num_prompt, len(out.token_ids))
        except (ServerShuttingDown, EngineError) as exc:
            failure = Reply.failure(exc)
            await writer.write(sse_event(failure.body))
            return failure.outcome, None
        raise AssertionError("request stream ended without a finished output")

    def _failure_response(self, endpoint: str, exc: ServerShuttingDown | EngineError) -> web.Response:
        """Count an engine-side failure and turn it into its error response (503 or 500)."""
        failure = Reply.failure(exc)
        self._count(endpoint, failure.outcome)
        return json_response(failure.status, failure.body)

    def _count(self, endpoint: str, outcome: str) -> None:
        self._metrics.requests.labels(endpoint, outcome).inc()


def _id_prefix(kind: RequestKind) -> str:
    return "chatcmpl" if kind is RequestKind.CHAT else "cmpl"


def _first_extras(prepared: Prepared) -> dict[str, Any]:
    """Fields of a stream's first event when the request asked ``return_token_ids``: the prompt's
    token ids and the resolved completion budget, so that a router can continue the answer
    elsewhere exactly (mid-stream migration, decision 052)."""
    return {"prompt_token_ids": list(prepared.prompt_token_ids),
            "kvwire_max_tokens": prepared.params.max_tokens}


# --- OpenAI response bodies and SSE chunks ----------------------------------------------------------
# Pure functions of their inputs (no engine, no HTTP), so the wire format is tested on its own.
# Streaming follows OpenAI: ``data: {json}\n\n`` events, the last content chunk carries
# ``finish_reason``, an optional usage chunk with empty ``choices`` follows, then ``data: [DONE]``.
# kvwire extensions: top-level ``kv_transfer_params`` (non-streaming body and the final streaming
# chunk), and ``token_ids`` / ``prompt_token_ids`` when the request asked ``return_token_ids``.

SSE_DONE = b"data: [DONE]\n\n"
_encoder = msgspec.json.Encoder()


def sse_event(payload: dict[str, Any]) -> bytes:
    return b"data: " + _encoder.encode(payload) + b"\n\n"


def json_bytes(payload: dict[str, Any]) -> bytes:
    return _encoder.encode(payload)


def error_body(
    status: int, message: str, err_type: str = "invalid_request_error", param: str | None = None,
    reason: str | None = None,
) -> dict[str, Any]:
    """vLLM's error body (``ErrorResponse``: ``code`` is the HTTP status, an int); ``reason``, when
    given, is kvwire's machine-readable cause (``queue_full``, ``instance_lost``, ...: what a router or
    script branches on), an extra field that vLLM's and OpenAI's clients ignore."""
    error: dict[str, Any] = {"message": message, "type": err_type, "param": param, "code": status}
    if reason is not None:
        error["reason"] = reason
    return {"error": error}


def usage_body(num_prompt_tokens: int, num_completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_completion_tokens,
        "total_tokens": num_prompt_tokens + num_completion_tokens,
    }


@dataclasses.dataclass(frozen=True)
class ResponseBuilder:
    """Builds every body of one request (same id, model and creation time throughout)."""

    kind: RequestKind
    response_id: str
    model: str
    created: int
    return_token_ids: bool = False

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.response_id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices}

    def full(
        self,
        text: str,
        token_ids: list[int],
        finish_reason: str | None,
        usage: dict[str, int],
        kv_transfer_params: dict[str, Any] | None,
        prompt_token_ids: list[int] | None = None,
    ) -> dict[str, Any]:
        """The non-streaming body."""
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish_reason}
        if self.kind is RequestKind.CHAT:
            choice["message"] = {"role": "assistant", "content": text}
            body = self._envelope("chat.completion", [choice])
        else:
            choice["text"] = text
            body = self._envelope("text_completion", [choice])
        if self.return_token_ids:
            choice["token_ids"] = token_ids
            body["prompt_token_ids"] = prompt_token_ids
        body["usage"] = usage
        body["kv_transfer_params"] = kv_transfer_params
        return body

    def first_chunk(self) -> dict[str, Any] | None:
        """Chat streams open with the assistant role; completions have no opening chunk."""
        if self.kind is not RequestKind.CHAT:
            return None
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                  "finish_reason": None}
        return self._envelope("chat.completion.chunk", [choice])

    def chunk(
        self,
        text: str,
        token_ids: list[int],
        finish_reason: str | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """One streaming content chunk; the final one has ``finish_reason`` and ``kv_transfer_params``."""
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish_reason}
        if self.kind is RequestKind.CHAT:
            choice["delta"] = {"content": text} if text or finish_reason is None else {}
            body = self._envelope("chat.completion.chunk", [choice])
        else:
            choice["text"] = text
            body = self._envelope("text_completion", [choice])
        if self.return_token_ids:
            choice["token_ids"] = token_ids
        if finish_reason is not None:
            body["kv_transfer_params"] = kv_transfer_params
        return body

    def usage_chunk(self, usage: dict[str, int]) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.kind is RequestKind.CHAT else "text_completion"
        body = self._envelope(obj, [])
        body["usage"] = usage
        return body


# --- the request's latency metrics ------------------------------------------------------------------


class RequestTimer:
    """Records TTFT / ITL / E2E for one request from the engine's output timestamps."""

    def __init__(self, metrics: ServerMetrics, arrival_s: float) -> None:
        self._metrics = metrics
        self._arrival_s = arrival_s
        self._last_token_s: float | None = None

    def on_tokens(self, num_new_tokens: int, time_s: float) -> None:
        if num_new_tokens <= 0:
            return
        self._metrics.generation_tokens.inc(num_new_tokens)
        if self._last_token_s is None:
            self._metrics.ttft.observe(max(0.0, time_s - self._arrival_s))
            num_gaps, gap_s = num_new_tokens - 1, 0.0  # tokens beyond the first came in the same step
        else:
            num_gaps = num_new_tokens
            gap_s = max(0.0, time_s - self._last_token_s) / num_new_tokens
        for _ in range(num_gaps):
            self._metrics.itl.observe(gap_s)
        self._last_token_s = time_s

    def on_finish(self, time_s: float) -> None:
        self._metrics.e2e.observe(max(0.0, time_s - self._arrival_s))
