"""Fuzz targets: every decoder a peer or a client can reach, as ``bytes -> typed value or typed error``.

A :class:`FuzzTarget` runs one input through the real decoding function(s) of one trust boundary and
names the exceptions that boundary documents (``allowed``): its listener or HTTP handler turns those
into a refusal (a counted protocol error, a 400/403, a FAILED transfer). Anything else it raises
(``RecursionError``, ``KeyError``, ``TypeError``, ``UnicodeError``, ``OverflowError``...) is a crash:
it would escape the handler and, on a listener thread, stop it. Used by ``kvwire bench fuzz`` (atheris,
coverage-guided, decision 113) and by the short deterministic run in ``tests/fuzz/``.

Targets are built lazily by name (:func:`build`): message and HTTP targets import no torch; the
data-plane targets (:mod:`kvwire.bench.fuzz_planes`) do. Their seeds are messages made by the real
encoders (:mod:`kvwire.bench.fuzz_corpus`).
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable

from kvwire.errors import ForbiddenError, InvalidRequestError, ProtocolError

SECRET = b"fuzz-secret"


@dataclasses.dataclass(frozen=True)
class FuzzTarget:
    """One decoder under fuzz: ``check(data)`` returns or raises one of ``allowed``."""

    name: str
    check: Callable[[bytes], object]
    allowed: tuple[type[BaseException], ...]
    seeds: Callable[[], list[bytes]]
    max_len: int = 4096  # longest input the fuzzer builds (the decoders' own caps are larger)

    def __post_init__(self) -> None:
        if self.max_len <= 0:
            raise ValueError(f"fuzz target {self.name}: max_len must be > 0")

    def crash_of(self, data: bytes) -> Exception | None:
        """The exception ``data`` raises that the boundary does not allow (None: a clean outcome)."""
        try:
            self.check(data)
        except self.allowed:
            return None
        except Exception as exc:  # anything else is the finding
            return exc
        return None


def _split(data: bytes) -> tuple[int, bytes]:
    """First byte selects a variant (secret or not, frame count, endpoint), the rest is the input."""
    return (data[0] if data else 0), data[1:]


def discovery_frames() -> FuzzTarget:
    from kvwire.bench import fuzz_corpus
    from kvwire.discovery.heartbeats import decode_frames

    def check(data: bytes) -> object:
        mode, rest = _split(data)
        secret = SECRET if mode & 1 else None
        if mode & 2:  # two frames: payload, signature (the last 32 bytes)
            return decode_frames([rest[:-32], rest[-32:]], secret)
        return decode_frames([rest], secret)

    return FuzzTarget("discovery.frames", check, (ProtocolError,), fuzz_corpus.discovery_frames, 8192)


def etcd_record() -> FuzzTarget:
    from kvwire.bench import fuzz_corpus
    from kvwire.discovery.etcd_gateway import decode_record

    return FuzzTarget("etcd.record", decode_record, (ProtocolError,), fuzz_corpus.etcd_records, 8192)


def etcd_watch() -> FuzzTarget:
    from kvwire.bench import fuzz_corpus
    from kvwire.discovery.etcd_gateway import EtcdError
    from kvwire.router.etcd_stream import decode_watch_message

    return FuzzTarget("etcd.watch", decode_watch_message, (EtcdError,), fuzz_corpus.etcd_watch_lines, 8192)


def transfer_control() -> FuzzTarget:
    from kvwire.bench import fuzz_corpus
    from kvwire.transfer.wire import Codec

    plain, signed = Codec(None), Codec(SECRET)

    def check(data: bytes) -> object:
        mode, rest = _split(data)
        if mode & 1:
            return signed.decode([rest[:-32], rest[-32:]])
        return plain.decode([rest])

    return FuzzTarget("transfer.control", check, (ProtocolError,), fuzz_corpus.control_messages, 8192)


def first_token_trailer() -> FuzzTarget:
    from kvwire.bench import fuzz_corpus
    from kvwire.connector.worker import decode_trailer

    return FuzzTarget("connector.trailer", decode_trailer, (ProtocolError,), fuzz_corpus.trailers)


def kv_params() -> FuzzTarget:
    """``kv_transfer_params`` as an instance gets them: inside a request body, then checked and
    verified against the router's signature (a secret is set)."""
    from kvwire.bench import fuzz_corpus
    from kvwire.protocol.kv_params import KVTransferParams
    from kvwire.protocol.kv_signing import ParamsVerifier
    from kvwire.server.openai_protocol import parse_completion

    def check(data: bytes) -> object:
        req = parse_completion(b'{"prompt": "hi", "kv_transfer_params": ' + data + b"}")
        params = KVTransferParams.parse(req.kv_transfer_params or {})
        ParamsVerifier(SECRET).verify(params)  # a fresh one: every input is a first use (no replay)
        return params

    return FuzzTarget("kv.params", check, (InvalidRequestError, ForbiddenError), fuzz_corpus.kv_params)


def instance_body() -> FuzzTarget:
    """An OpenAI request body on an instance (``kvwire serve``): completions or chat."""
    from kvwire.bench import fuzz_corpus
    from kvwire.server.openai_protocol import parse_chat, parse_completion, stop_strings

    def check(data: bytes) -> object:
        mode, rest = _split(data)
        req = parse_chat(rest) if mode & 1 else parse_completion(rest)
        stop_strings(req)
        return req

    return FuzzTarget("http.instance_body", check, (InvalidRequestError,), fuzz_corpus.instance_bodies, 8192)


def instance_tokenize() -> FuzzTarget:
    """A ``/tokenize`` or ``/detokenize`` body on an instance (vLLM's service endpoints): what the
    handler reads before the tokenizer runs (the chat messages flattened for the template)."""
    from kvwire.bench import fuzz_corpus
    from kvwire.server.openai_protocol import (
        ChatRequest,
        chat_messages,
        parse_detokenize,
        parse_tokenize,
    )

    def check(data: bytes) -> object:
        mode, rest = _split(data)
        if mode & 1:
            return parse_detokenize(rest, 32000).tokens
        req = parse_tokenize(rest)
        return chat_messages(ChatRequest(messages=req.messages)) if req.messages is not None else req.prompt

    return FuzzTarget("http.instance_tokenize", check, (InvalidRequestError,), fuzz_corpus.tokenize_bodies)


def router_body() -> FuzzTarget:
    """An OpenAI request body and headers on the router (what it reads before picking instances)."""
    from kvwire.bench import fuzz_corpus
    from kvwire.router.request import parse_client_request

    paths = ("/v1/completions", "/v1/chat/completions")

    def check(data: bytes) -> object:
        mode, rest = _split(data)
        head, _, body = rest.partition(b"\n\n")
        headers = {}
        for line in head.decode("utf-8", "surrogateescape").splitlines():
            name, _, value = line.partition(":")
            headers[name.strip()] = value.strip()
        req = parse_client_request(paths[mode & 1], body, headers)
        return req.derived_body(stream=True), req.max_new_tokens, req.est_prompt_tokens

    return FuzzTarget("http.router_body", check, (InvalidRequestError,), fuzz_corpus.router_bodies, 8192)


def api_key() -> FuzzTarget:
    """The ``Authorization`` header at an HTTP front door (``kvwire router`` and ``kvwire serve``), as
    aiohttp hands it over (decoded with ``surrogateescape``): a key check or a refusal, nothing else
    (an exception there is a 500 before any handler runs)."""
    from kvwire.bench import fuzz_corpus
    from kvwire.http.front_door import ApiKeyConfig

    keys = ApiKeyConfig(("sk-fuzz-key-1", "sk-fuzz-\u00e9-key-2"))

    def check(data: bytes) -> object:
        return keys.check(data.decode("utf-8", "surrogateescape")) is None  # True: a key matched

    return FuzzTarget("http.api_key", check, (), fuzz_corpus.api_keys, 1024)


def plane_info() -> FuzzTarget:
    """``plane_info`` of Offer/Grant/Pull: the plane-set envelope (hello, negotiation) and the
    shared-memory plane's one-copy destinations."""
    from kvwire.bench import fuzz_corpus
    from kvwire.transfer.planes.base import choose, decode_envelope
    from kvwire.transfer.planes.shm.send import decode_direct

    local = fuzz_corpus.local_hello()

    def check(data: bytes) -> object:
        envelope = decode_envelope(data)
        choice = choose(local, envelope.hello)
        return choice, [decode_direct(inner) for inner in envelope.inner.values()]

    return FuzzTarget("transfer.plane_info", check, (ProtocolError, ValueError), fuzz_corpus.plane_infos)


def nccl_info() -> FuzzTarget:
    """The NCCL plane's part of a peer's ``plane_info`` (communicator offers, chunk plans): pure
    msgspec, no CUDA needed to decode it."""
    from kvwire.bench import fuzz_corpus
    from kvwire.transfer.planes.nccl.plane_info import decode_info

    return FuzzTarget("transfer.nccl_info", decode_info, (ProtocolError,), fuzz_corpus.nccl_infos)


def upstream_answer() -> FuzzTarget:
    """What an instance answers, as the router reads it: P's whole answer (the first-token splice of
    a streamed P/D request), D's event stream (the splice, the migration ledger) and an error body.
    None of these raises: an answer the router cannot use is passed on or ends that upstream call."""
    from kvwire.bench import fuzz_corpus
    from kvwire.router.relay import FirstTokenSplicer, _says_gone
    from kvwire.router.request import StreamLedger, parse_client_request

    requests = [parse_client_request(path, body, {}) for path, body in fuzz_corpus.streamed_requests()]

    def check(data: bytes) -> object:
        mode, rest = _split(data)
        answer, _, stream = rest.partition(fuzz_corpus.ANSWER_END)
        chat = bool(mode & 1)
        splicer = FirstTokenSplicer.from_prefill(answer, chat)
        out = [splicer.early_events() + splicer.filter(stream) + splicer.flush()] if splicer else []
        ledger = StreamLedger(requests[chat], chat)
        out.append(ledger.filter(stream))
        return out, ledger.token_ids, _says_gone(503, answer)

    return FuzzTarget("router.upstream_answer", check, (), fuzz_corpus.upstream_answers, 8192)


def vllm_kv_events() -> FuzzTarget:
    """A KV event batch from vLLM's publisher as the plugin's bridge handles it (``on_frames``:
    decoded, then re-hashed into kvwire's chain). It counts a malformed batch and goes on: nothing
    may escape it."""
    from kvwire.bench import fuzz_corpus
    from kvwire.integrations.vllm_kv_events import VllmKvEventBridge, VllmKvTranslator
    from kvwire.protocol.kv_blocks import KvEventLog

    bridge = VllmKvEventBridge("tcp://127.0.0.1:1", VllmKvTranslator(KvEventLog(16)))  # never started

    def check(data: bytes) -> object:
        bridge.translator = VllmKvTranslator(KvEventLog(16))  # each input from a fresh index
        applied = bridge.batches
        seq = bridge.batches + bridge.malformed  # in order: no gap warnings
        bridge._next_seq = seq
        bridge.on_frames([b"", seq.to_bytes(8, "big", signed=True), data])
        return bridge.batches > applied  # True: decoded and applied

    return FuzzTarget("vllm.kv_events", check, (), fuzz_corpus.vllm_kv_events)


# name -> module:function building it (imported only when asked for)
TARGETS: dict[str, str] = {
    "discovery.frames": "kvwire.bench.fuzz_targets:discovery_frames",
    "etcd.record": "kvwire.bench.fuzz_targets:etcd_record",
    "etcd.watch": "kvwire.bench.fuzz_targets:etcd_watch",
    "transfer.control": "kvwire.bench.fuzz_targets:transfer_control",
    "transfer.plane_info": "kvwire.bench.fuzz_targets:plane_info",
    "transfer.nccl_info": "kvwire.bench.fuzz_targets:nccl_info",
    "connector.trailer": "kvwire.bench.fuzz_targets:first_token_trailer",
    "kv.params": "kvwire.bench.fuzz_targets:kv_params",
    "http.instance_body": "kvwire.bench.fuzz_targets:instance_body",
    "http.instance_tokenize": "kvwire.bench.fuzz_targets:instance_tokenize",
    "http.router_body": "kvwire.bench.fuzz_targets:router_body",
    "http.api_key": "kvwire.bench.fuzz_targets:api_key",
    "router.upstream_answer": "kvwire.bench.fuzz_targets:upstream_answer",
    "vllm.kv_events": "kvwire.bench.fuzz_targets:vllm_kv_events",
    "plane.tcp_hello": "kvwire.bench.fuzz_planes:tcp_hello",
    "plane.tcp_frames": "kvwire.bench.fuzz_planes:tcp_frames",
    "plane.shm_frames": "kvwire.bench.fuzz_planes:shm_frames",
}


def build(name: str) -> FuzzTarget:
    """The target called ``name``, or built by ``module:function`` (a decoder being written, before
    it joins :data:`TARGETS`); ValueError for an unknown one."""
    if name not in TARGETS and ":" not in name:
        raise ValueError(f"unknown fuzz target {name!r}; known: {', '.join(TARGETS)}")
    module, _, function = TARGETS.get(name, name).partition(":")
    factory: Callable[[], FuzzTarget] = getattr(importlib.import_module(module), function)
    return factory()

