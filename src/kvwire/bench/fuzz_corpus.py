"""Seed corpora of the fuzz targets: real messages made by the real encoders (decision 113).

Each function returns the inputs one target starts from, in that target's input format (see
:mod:`kvwire.bench.fuzz_targets`: a leading selector byte where a target has variants). They are
built deterministically from the encoders the processes use (heartbeats, control messages, signed
``kv_transfer_params``, data-plane hellos and frames, request bodies as clients send them), so the
corpus follows the wire format when it changes; nothing is stored but this file.
"""

from __future__ import annotations

import base64
import json
from typing import TYPE_CHECKING, Any

from kvwire.bench.fuzz_targets import SECRET

if TYPE_CHECKING:
    from kvwire.transfer.planes.base import Hello

_LAYOUT = {"model": "tiny", "num_layers": 2, "num_kv_heads": 2, "head_dim": 16, "block_size": 16,
           "dtype": "float32", "tp_size": 1}


def _heartbeats() -> list[object]:
    from kvwire.discovery.heartbeats import Deregister, Heartbeat, InstanceInfo, InstanceLoad, KvEvents
    from kvwire.protocol.kv_params import KVCacheLayout, Role

    info = InstanceInfo(
        instance_id="p-0", role=Role.PREFILL, url="http://127.0.0.1:8100", model="tiny", epoch=17,
        kv_endpoints=["tcp://127.0.0.1:5600"], version="0.1", tokenizer="byte",
        kv_layout=KVCacheLayout(**_LAYOUT),  # type: ignore[arg-type]
    )
    load = InstanceLoad(num_running=1, num_waiting=2, free_kv_blocks=90, total_kv_blocks=100,
                        kv_transports={"tcp://127.0.0.1:5700": "shm"})
    return [
        Heartbeat(info=info, load=load, seq=3, sent_at=1.5, ttl_s=5.0),
        Heartbeat(info=InstanceInfo(instance_id="d", role=Role.DECODE, url="https://h:1", model="m")),
        Deregister(instance_id="p-0", epoch=17, seq=4),
        KvEvents(instance_id="p-0", epoch=17, block_size=16, stored=[1, 2**63 - 1], removed=[5],
                 cleared=True),
    ]


def discovery_frames() -> list[bytes]:
    from kvwire.discovery.heartbeats import encode_frames

    out = []
    for msg in _heartbeats():
        out.append(b"\x00" + encode_frames(msg)[0])  # type: ignore[arg-type]
        payload, mac = encode_frames(msg, SECRET)  # type: ignore[arg-type]
        out.append(b"\x03" + payload + mac)
    return out


def etcd_records() -> list[bytes]:
    from kvwire.discovery.etcd_gateway import encode_record

    return [encode_record(msg) for msg in _heartbeats()[:2]]  # type: ignore[arg-type]


def etcd_watch_lines() -> list[bytes]:
    """Lines of the etcd gateway's watch stream (keys and values base64, revisions as strings)."""
    records = etcd_records()

    def kv(key: str, value: bytes, rev: int) -> dict[str, str]:
        return {"key": base64.b64encode(key.encode()).decode(), "value": base64.b64encode(value).decode(),
                "mod_revision": str(rev), "create_revision": str(rev), "version": "1", "lease": "77"}

    messages = [
        {"result": {"header": {"revision": "5"}, "created": True}},
        {"result": {"events": [{"kv": kv("/kvwire/instances/p-0", records[0], 6)}]}},
        {"result": {"events": [{"type": "DELETE", "kv": kv("/kvwire/instances/d", b"", 7)}]}},
        {"result": {"canceled": True, "cancel_reason": "compacted", "compact_revision": "3"}},
        {"error": {"grpc_code": 14, "http_code": 503, "message": "unavailable"}},
    ]
    return [json.dumps(m).encode() for m in messages]


def control_messages() -> list[bytes]:
    from kvwire.transfer.wire import Abort, Ack, AnyMsg, Codec, Grant, Offer, Pull, Renew, Trailer, WireLayer

    head: dict[str, Any] = {"src_id": "a" * 32, "src_endpoint": "tcp://127.0.0.1:5600", "dst_id": "b" * 32,
            "transfer_id": "req-1"}
    msgs: list[AnyMsg] = [
        Offer(**head, layers=[WireLayer([2, 16, 2, 16], "float32")] * 2, deadline_s=30.0,
              data_address="127.0.0.1:5601", with_trailer=True, plane_info=plane_infos()[0]),
        Grant(**head, layers=[0, 1], data_address="@kvwire-shm-b", early=True, sizes=[4096, 4096]),
        Ack(**head, layers=[0, 1], trailer=True),
        Trailer(**head, payload=trailers()[0]),
        Abort(**head, reason="deadline"),
        Pull(**head, deadline_s=10.0, data_address="127.0.0.1:5601", held="req-0", heads=[0, 1], pieces=2),
        Renew(**head, state="receiving", reply=True),
    ]
    plain, signed = Codec(None), Codec(SECRET)
    out = [b"\x00" + plain.encode(m)[0] for m in msgs]
    out += [b"\x01" + b"".join(signed.encode(m)) for m in msgs[:3]]
    return out


def trailers() -> list[bytes]:
    from kvwire.connector.first_token_trailer import FirstTokenTrailer
    from kvwire.connector.worker import encode_trailer

    return [encode_trailer(FirstTokenTrailer(token_id=42, num_prompt_tokens=7, kv_ready_unix_s=1.25)),
            encode_trailer(FirstTokenTrailer(token_id=None, num_prompt_tokens=0))]


def kv_params() -> list[bytes]:
    from kvwire.protocol.kv_params import KVCacheLayout, KVTransferParams, Role, TransferMode
    from kvwire.protocol.kv_signing import ParamsSigner

    signer = ParamsSigner(SECRET, clock=lambda: 4_000_000_000.0)  # unexpired for the fuzzer's lifetime
    params = [
        KVTransferParams(transfer_id="t-1", role=Role.PREFILL, peer_endpoints=["tcp://127.0.0.1:5700"],
                         peer_instance_id="d-0", peer_kv_layout=KVCacheLayout(**_LAYOUT)),  # type: ignore[arg-type]
        KVTransferParams(transfer_id="t-2", role=Role.DECODE, mode=TransferMode.PULL, first_token_id=5,
                         num_prompt_tokens=9, skip_blocks=1, limit_s=60.0),
    ]
    signed = [json.dumps(signer.sign(p).to_dict()).encode() for p in params]
    return [*signed, json.dumps(params[1].to_dict()).encode()]


_COMPLETION = {"model": "tiny", "prompt": "The capital of France is", "max_tokens": 16, "temperature": 0,
               "stream": True, "stream_options": {"include_usage": True}, "stop": ["\n"], "seed": 1}
_CHAT = {"model": "tiny", "messages": [{"role": "system", "content": "Be brief."},
                                       {"role": "user", "content": [{"type": "text", "text": "Hi é 😀"}]}],
         "max_completion_tokens": 8, "top_p": 0.9, "top_k": 40, "stop_token_ids": [2]}


def instance_bodies() -> list[bytes]:
    tokens = dict(_COMPLETION, prompt=[[1, 2, 3]], stream=False, stream_options=None,
                  kv_transfer_params=json.loads(kv_params()[0]), return_token_ids=True)
    return [b"\x00" + json.dumps(_COMPLETION).encode(), b"\x00" + json.dumps(tokens).encode(),
            b"\x01" + json.dumps(_CHAT, ensure_ascii=False).encode()]


def tokenize_bodies() -> list[bytes]:
    """``/tokenize`` bodies (a prompt; chat messages, one with content parts) and a ``/detokenize`` one."""
    parts = [{"type": "text", "text": "The capital of France?"}]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": parts}]
    chat = {"model": "tiny", "messages": messages, "return_token_strs": True}
    prompt = {"model": "tiny", "prompt": "The capital", "add_special_tokens": False}
    return [b"\x00" + json.dumps(prompt).encode(),
            b"\x00" + json.dumps(chat, ensure_ascii=False).encode(),
            b"\x01" + json.dumps({"model": "tiny", "tokens": [1, 450, 7483]}).encode()]


def router_bodies() -> list[bytes]:
    headers = b"Authorization: Bearer sk-1\nX-Request-Id: r-1\nUser-Agent: openai-python\n\n"
    return [b"\x00" + headers + json.dumps(_COMPLETION).encode(),
            b"\x01" + headers + json.dumps(_CHAT, ensure_ascii=False).encode(),
            b"\x00\n\n" + json.dumps({"prompt": [1, 2], "max_tokens": 2}).encode()]


def api_keys() -> list[bytes]:
    """``Authorization`` header values as clients send them (http.api_key): a right key, a wrong one,
    another scheme, a non-ASCII key (UTF-8)."""
    return [b"Bearer sk-fuzz-key-1", "Bearer sk-fuzz-\u00e9-key-2".encode(), b"bearer  sk-wrong-key ",
            b"Basic dXNlcjpwYXNz"]


ANSWER_END = b"\n\x00\n"  # router.upstream_answer: P's answer, then D's stream


def streamed_requests() -> list[tuple[str, bytes]]:
    """A streamed completion and chat request as the router parses them (with token ids, usage)."""
    return [("/v1/completions", json.dumps(dict(_COMPLETION, return_token_ids=True)).encode()),
            ("/v1/chat/completions", json.dumps(dict(_CHAT, stream=True)).encode())]


def upstream_answers() -> list[bytes]:
    """P's non-streaming answer and D's SSE stream, in the shapes ``kvwire serve`` writes them."""
    base = {"id": "cmpl-1", "created": 1, "model": "tiny"}
    text = {"index": 0, "text": " Paris", "token_ids": [42], "finish_reason": "length"}
    message = {"index": 0, "message": {"role": "assistant", "content": "Hi"}, "finish_reason": "length"}
    answers: list[dict[str, Any]] = [dict(base, object="text_completion", choices=[text]),
                                     dict(base, object="chat.completion", choices=[message])]
    events: list[list[dict[str, Any]]] = [
        [dict(base, object="text_completion", prompt_token_ids=[1, 2, 3], kvwire_max_tokens=16,
              choices=[{"index": 0, "text": " Paris", "token_ids": [42], "finish_reason": None}]),
         dict(base, object="text_completion", choices=[{"index": 0, "text": ".", "token_ids": [7],
                                                         "finish_reason": "length"}]),
         dict(base, object="text_completion", choices=[], usage={"prompt_tokens": 3, "completion_tokens": 2,
                                                                 "total_tokens": 5})],
        [dict(base, object="chat.completion.chunk", choices=[{"index": 0, "delta": {"role": "assistant",
                                                                                     "content": ""}}]),
         dict(base, object="chat.completion.chunk", choices=[{"index": 0, "delta": {"content": "Hi"},
                                                              "token_ids": [9], "finish_reason": None}]),
         {"error": {"message": "instance draining", "code": "shutting_down"}}],
    ]
    out = []
    for i, (answer, stream) in enumerate(zip(answers, events, strict=True)):
        sse = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in stream) + b"data: [DONE]\n\n"
        out.append(bytes([i]) + json.dumps(answer).encode() + ANSWER_END + sse)
    return out


def vllm_kv_events() -> list[bytes]:
    """KV event batches as vLLM 0.32's publisher sends them (msgpack ``[ts, events, dp_rank]``):
    blocks stored (a chain of two, then a child), removed, all cleared."""
    import hashlib

    import msgspec

    def vh(i: int) -> bytes:
        return hashlib.sha256(f"vllm-{i}".encode()).digest()

    tokens = [(7 * j) % 250 + 1 for j in range(64)]
    stored = {"type": "BlockStored", "block_hashes": [vh(0), vh(1)], "parent_block_hash": None,
              "token_ids": tokens[:32], "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None}
    child = dict(stored, block_hashes=[vh(2)], parent_block_hash=vh(1), token_ids=tokens[32:48])
    removed = {"type": "BlockRemoved", "block_hashes": [vh(2)], "medium": "GPU"}
    return [msgspec.msgpack.encode([1.5, [stored, child], 0]), msgspec.msgpack.encode([2.5, [removed], None]),
            msgspec.msgpack.encode([3.5, [{"type": "AllBlocksCleared"}, stored], 0])]


def local_hello() -> Hello:
    from kvwire.transfer.planes.base import Hello

    return Hello(instance_id="a" * 32, boot_id="boot", hostname="host", netns=4026531840, device="cpu",
                 planes={"shm": "@kvwire-shm-a", "tcp": "127.0.0.1:5601"})


def plane_infos() -> list[bytes]:
    import msgspec

    from kvwire.transfer.planes.base import Envelope, Hello
    from kvwire.transfer.planes.shm.send import ShmDest, encode_direct

    spans = [(0, 4096), (8192, 4096)]
    direct = encode_direct([ShmDest("req-1", layer, 1, 65536 * layer, 3, 99, spans) for layer in range(2)])
    peer = Hello(instance_id="b" * 32, boot_id="boot", hostname="host", netns=4026531840, device="cpu",
                 planes={"shm": "@kvwire-shm-b", "tcp": "127.0.0.1:5701"}, forced="shm")
    return [msgspec.msgpack.encode(Envelope(peer, {"shm": direct})),
            msgspec.msgpack.encode(Envelope(local_hello(), {}))]


def nccl_infos() -> list[bytes]:
    """NCCL plane_info as a receiver sends it: an offer (two lanes), chunk plans, both."""
    from kvwire.transfer.planes.nccl.plane_info import ChunkPlan, CommOffer, NcclInfo, encode_info

    offer = CommOffer("c0ffee", bytes(range(128)), zero_copy=True, lane_ids=[bytes(128)])
    chunks = [ChunkPlan("c0ffee", seq, "req-1", [2 * seq, 2 * seq + 1], 8192, lane=seq % 2)
              for seq in range(3)]
    return [encode_info(NcclInfo(offers=[offer])), encode_info(NcclInfo(chunks=chunks)),
            encode_info(NcclInfo(offers=[offer], chunks=chunks))]


def tcp_hellos() -> list[bytes]:
    from kvwire.transfer.planes.common.hello import HELLO, MAC_BYTES
    from kvwire.transfer.planes.tcp.wire import MAGIC, VERSION

    peer, me = b"b" * 16, b"a" * 16  # the dialler's epoch, the one it names for the acceptor
    return [HELLO.pack(MAGIC, VERSION, len(peer), len(me)) + peer + me + bytes(MAC_BYTES)]


def tcp_frames() -> list[bytes]:
    """A hello-less frame stream: two frames of the posted layer, an unsolicited one."""
    from kvwire.transfer.planes.tcp.wire import FRAME

    tid = b"req-1"
    good = FRAME.pack(0, 64, len(tid)) + tid + bytes(range(64))
    return [good, good + FRAME.pack(1, 8, 5) + b"req-2" + bytes(8)]


def shm_frames() -> list[bytes]:
    """A shared-memory link's frames: chunks of the posted layer in the ring, a one-copy DONE."""
    from kvwire.transfer.planes.shm.wire import FRAME, Frame

    tid = b"req-1"
    first = FRAME.pack(Frame.CHUNK, 0, 64, 0, 0, 32, len(tid)) + tid
    second = FRAME.pack(Frame.CHUNK, 0, 64, 32, 32, 32, len(tid)) + tid
    done = FRAME.pack(Frame.DONE, 1, 64, 0, 0, 64, len(tid)) + tid
    return [first + second, done, first + done]
