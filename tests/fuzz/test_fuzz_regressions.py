"""One regression test per crash the fuzzing tier found (decision 113), each at its decoder.

The first is the crash of issue 33: a 60 KB frame of nested msgpack arrays made
``discovery.heartbeats.decode_frames`` raise ``RecursionError``, which stopped the router's discovery
listener. msgspec raises ``RecursionError`` for any input nested past its limit (about a thousand
levels), JSON or msgpack, typed or not (skipped unknown fields included); every decoder now turns it
into its typed error.
"""

from __future__ import annotations

import json

import msgspec
import pytest

from kvwire.connector.worker import decode_trailer
from kvwire.discovery.etcd_gateway import EtcdError, decode_record
from kvwire.discovery.heartbeats import MAX_FRAME_BYTES, decode_frames, sign
from kvwire.errors import AuthenticationError, InvalidRequestError, ProtocolError
from kvwire.protocol.kv_params import KVTransferParams, Role
from kvwire.protocol.kv_signing import KVParamsRefused, ParamsRefusal, ParamsSigner, ParamsVerifier
from kvwire.router.etcd_stream import decode_watch_message
from kvwire.router.request import parse_client_request
from kvwire.server.openai_protocol import BadRequest, parse_chat, parse_completion
from kvwire.transfer.wire import MAX_MESSAGE_BYTES, Codec

MSGPACK_NEST = b"\x91" * 60_000 + b"\x90"  # the 60 KB frame of issue 33
JSON_NEST = b"[" * 5000 + b"]" * 5000


def _heartbeat_with_nested_extra() -> bytes:
    """A valid heartbeat whose map has one more (unknown) key holding a deep nest: msgspec skips
    unknown fields recursively."""
    from kvwire.bench.fuzz_corpus import discovery_frames

    payload = discovery_frames()[0][1:]
    assert payload[0] & 0xF0 == 0x80  # a fixmap: add one entry
    return bytes([payload[0] + 1]) + payload[1:] + b"\xa5extra" + b"\x91" * 3000 + b"\x90"


def test_discovery_frame_of_nested_arrays_is_a_protocol_error() -> None:
    assert len(MSGPACK_NEST) <= MAX_FRAME_BYTES
    with pytest.raises(ProtocolError, match="malformed discovery message"):
        decode_frames([MSGPACK_NEST, b""])
    with pytest.raises(ProtocolError, match="malformed discovery message"):
        decode_frames([_heartbeat_with_nested_extra()])


def test_signed_discovery_frame_of_nested_arrays_is_a_protocol_error() -> None:
    """With a secret, a correctly signed nest (a peer that knows the secret) is refused too."""
    payload = _heartbeat_with_nested_extra()
    with pytest.raises(ProtocolError) as info:
        decode_frames([payload, sign(payload, b"k")], b"k")
    assert not isinstance(info.value, AuthenticationError)


def test_etcd_record_and_watch_line_nests_are_typed_errors() -> None:
    with pytest.raises(ProtocolError):
        decode_record(b'{"info": ' + JSON_NEST + b"}")
    with pytest.raises(EtcdError):
        decode_watch_message(b'{"result": {"events": [], "x": ' + JSON_NEST + b"}}")
    with pytest.raises(EtcdError):
        decode_watch_message(b'{"error": ' + JSON_NEST + b"}")


def test_control_message_nests_are_protocol_errors() -> None:
    codec = Codec(None)
    with pytest.raises(ProtocolError, match="malformed control message"):
        codec.decode([MSGPACK_NEST])
    offer_head = b"\x82\xa1t\xa5offer\xa1x"  # tag, then an unknown key holding the nest
    with pytest.raises(ProtocolError):
        codec.decode([offer_head + b"\x91" * 3000 + b"\x90"])


def test_oversized_control_message_is_refused_before_its_mac() -> None:
    """The size is checked first: a huge frame with a bad MAC is a size error (no hashing of it)."""
    with pytest.raises(ProtocolError, match="exceeds") as info:
        Codec(b"secret").decode([bytes(MAX_MESSAGE_BYTES + 1), bytes(32)])
    assert not isinstance(info.value, AuthenticationError)


def test_first_token_trailer_nest_is_a_protocol_error() -> None:
    with pytest.raises(ProtocolError, match="malformed first-token trailer"):
        decode_trailer(b"\x81\xa1k" * 2000 + b"\xc0")


@pytest.mark.parametrize("parse", [parse_completion, parse_chat])
def test_instance_request_body_nest_is_a_400(parse: object) -> None:
    with pytest.raises(BadRequest, match="not valid JSON"):
        parse(b'{"prompt": ' + JSON_NEST + b"}")  # type: ignore[operator]
    with pytest.raises(BadRequest):
        parse(b'{"kv_transfer_params": {"a": ' + JSON_NEST + b"}}")  # type: ignore[operator]


def test_router_request_body_nest_is_a_400() -> None:
    with pytest.raises(InvalidRequestError, match="too deeply"):
        parse_client_request("/v1/completions", b'{"prompt": "x", "user": ' + JSON_NEST + b"}", {})


def test_kv_params_signature_with_non_ascii_characters_is_refused() -> None:
    """``hmac.compare_digest`` raises TypeError for str with non-ASCII characters: the signature is
    compared as bytes, and a forged one is a refusal (403), whatever it contains."""
    signed = ParamsSigner(b"secret").sign(KVTransferParams(transfer_id="t", role=Role.DECODE))
    for forged in ("\u00e9" * 64, "\ud800", "\x00", ""):
        raw = dict(signed.to_dict(), sig=forged)
        with pytest.raises(KVParamsRefused) as info:
            ParamsVerifier(b"secret").verify(KVTransferParams.from_dict(raw))
        assert info.value.refusal is ParamsRefusal.BAD_SIGNATURE
    ParamsVerifier(b"secret").verify(signed)  # the genuine one still passes


def test_plane_info_forcing_an_unknown_transport_is_a_protocol_error() -> None:
    from kvwire.bench.fuzz_corpus import local_hello
    from kvwire.transfer.planes.base import Envelope, decode_envelope

    hostile = msgspec.structs.replace(local_hello(), forced="carrier-pigeon")
    with pytest.raises(ProtocolError, match="unknown transport"):
        decode_envelope(msgspec.msgpack.encode(Envelope(hostile, {})))
    with pytest.raises(ProtocolError, match="does not decode"):
        decode_envelope(MSGPACK_NEST)
    ok = msgspec.msgpack.encode(Envelope(msgspec.structs.replace(local_hello(), forced="shm"), {}))
    assert decode_envelope(ok).hello.forced == "shm"


@pytest.mark.parametrize("field", ["hostname", "boot_id", "instance_id", "gpu_uuid", "peer_gpus", "planes"])
def test_plane_info_with_an_oversized_hello_is_a_protocol_error(field: str) -> None:
    """A peer's hello is kept per peer epoch (up to MAX_PEERS) and logged: a 1 MB hostname (or GPU
    list, or plane table) in every plane_info would have held MAX_PEERS times that."""
    from kvwire.bench.fuzz_corpus import local_hello
    from kvwire.transfer.planes.base import MAX_HELLO_ITEMS, MAX_HELLO_TEXT, Envelope, decode_envelope

    big: object = "h" * (1 << 20)
    if field == "peer_gpus":
        big = [f"GPU-{i}" for i in range(MAX_HELLO_ITEMS + 1)]
    elif field == "planes":
        big = {"tcp": "127.0.0.1:1", "x" * (MAX_HELLO_TEXT + 1): ""}
    hostile = msgspec.structs.replace(local_hello(), **{field: big})
    with pytest.raises(ProtocolError, match="hello too large"):
        decode_envelope(msgspec.msgpack.encode(Envelope(hostile, {})))
    inner = {str(i): b"" for i in range(MAX_HELLO_ITEMS + 1)}
    with pytest.raises(ProtocolError, match="hello too large"):
        decode_envelope(msgspec.msgpack.encode(Envelope(local_hello(), inner)))
    assert decode_envelope(msgspec.msgpack.encode(Envelope(local_hello(), {}))).hello == local_hello()


def test_shm_one_copy_grant_nest_is_a_value_error() -> None:
    from kvwire.transfer.planes.shm.send import decode_direct

    grant = b"\x83\xa5dests\x90\xa9span_sets\x90\xa1x"  # a map: dests, span_sets and an unknown key
    assert decode_direct(grant + b"\x90") == []
    with pytest.raises(ValueError):
        decode_direct(grant + b"\x91" * 3000 + b"\x90")


def test_router_reads_of_nested_upstream_answers_are_not_crashes() -> None:
    """What an instance answers the router (P's answer, D's stream, an error body) nested too deep:
    treated like any other answer it cannot use."""
    from kvwire.router.relay import FirstTokenSplicer, _says_gone

    assert FirstTokenSplicer.from_prefill(JSON_NEST, chat=False) is None
    answer = json.dumps({"choices": [{"text": "Hi", "index": 0}], "id": "x"}).encode()
    splicer = FirstTokenSplicer.from_prefill(answer, chat=False)
    assert splicer is not None
    event = b"data: " + JSON_NEST + b"\n\n"
    assert splicer.filter(event) == event  # passed on unchanged, like any foreign event
    assert _says_gone(503, b'{"error": ' + JSON_NEST + b"}") is False


@pytest.mark.parametrize("body", [b'{"error": {"reason": []}}', b'{"error": {"code": {"a": 1}}}',
                                  b'{"error": {"reason": [1], "code": [2]}}'])
def test_an_unhashable_error_reason_or_code_from_an_instance_is_not_a_crash(body: bytes) -> None:
    """The router looks an instance's error ``reason`` (and the older string ``code``) up in a set:
    a list or object there raised TypeError on the request's task."""
    from kvwire.router.relay import _says_gone

    assert _says_gone(503, body) is False
    assert _says_gone(503, b'{"error": {"code": 503, "reason": "instance_lost"}}') is True
    assert _says_gone(503, b'{"error": {"code": "instance_stopping"}}') is True


@pytest.mark.parametrize("endpoint", ["tcp://127.0.0.1:abc", "tcp://a b:1", "tcp://*:5", "tcp://", "ipc://",
                                      "tcp://127.0.0.1:0", "tcp://h:99999", "tcp://h:1\x00", "http://evil"])
def test_control_message_with_a_malformed_endpoint_is_refused(endpoint: str) -> None:
    """Replies go to ``src_endpoint``: ZeroMQ refuses a malformed one only when the control thread
    connects to it (a socket was made by then, and nothing closed it: 3 descriptors per message).
    The decoder refuses it instead."""
    from kvwire.transfer.wire import Abort

    msg = Abort(src_id="a", src_endpoint=endpoint, transfer_id="t", reason="r")
    with pytest.raises(ProtocolError, match="src_endpoint"):
        Codec(None).decode(Codec(None).encode(msg))


@pytest.mark.parametrize("endpoint", ["tcp://127.0.0.1:5600", "tcp://[::1]:5", "tcp://host_a.lan:80",
                                      "ipc:///tmp/kvwire.sock", "inproc://agent-1"])
def test_control_message_endpoints_of_every_form_pass(endpoint: str) -> None:
    from kvwire.transfer.wire import Abort

    msg = Abort(src_id="a", src_endpoint=endpoint, transfer_id="t", reason="r")
    assert Codec(None).decode(Codec(None).encode(msg)) == msg


def test_shm_chunk_at_the_end_of_the_ring_positions_is_a_protocol_error() -> None:
    """Found by ``kvwire bench fuzz`` (plane.shm_frames): a chunk whose ring position plus size
    passes 2**64 made the reader's credit (u64) fail to pack: ``struct.error``, which the link's
    reader does not catch (its thread died). Now refused as a protocol error, like any bad frame."""
    from kvwire.bench.fuzz_targets import build
    from kvwire.transfer.planes.shm.wire import FRAME, Frame

    target = build("plane.shm_frames")
    for pos in (2**64 - 1, 2**64 - 32):
        frame = FRAME.pack(Frame.CHUNK, 0, 64, 0, pos, 32, 5) + b"req-1"
        with pytest.raises(ProtocolError, match="out of range"):
            target.check(frame)
    last = FRAME.pack(Frame.CHUNK, 0, 64, 0, 2**64 - 33, 32, 5) + b"req-1"  # the last that fits
    assert target.crash_of(last) is None


def _streamed(chat: bool) -> object:
    from kvwire.bench.fuzz_corpus import streamed_requests

    path, body = streamed_requests()[chat]
    return parse_client_request(path, body, {})


@pytest.mark.parametrize("ids", ['["7"]', "[null]", "[[1]]", "[2.5]", "[-1]", '"12"', "[true]"])
def test_malformed_token_ids_from_an_instance_are_treated_as_absent(ids: str) -> None:
    """Found by ``kvwire bench fuzz`` (router.upstream_answer): the migration ledger ran ``int()``
    over the token ids and prompt ids an instance streamed (ValueError, TypeError in the router's
    relay). Ids that are not a list of non-negative ints are now ignored: the
    answer is then not token-exact, so a migration resumes from the text (ids_complete False)."""
    from kvwire.router.request import StreamLedger

    ledger = StreamLedger(_streamed(False), chat=False)  # type: ignore[arg-type]
    event = ('{"id": "c", "object": "text_completion", "created": 1, "model": "tiny", '
             '"prompt_token_ids": %s, "choices": [{"index": 0, "text": "a", "token_ids": %s, '
             '"finish_reason": null}]}')
    out = ledger.filter(b"data: " + (event % (ids, ids)).encode() + b"\n\n")
    assert out.startswith(b"data: ")
    assert ledger.prompt_ids is None and ledger.token_ids == [] and not ledger.ids_complete
    ledger.filter(b"data: " + (event % ("[1, 2]", "[5]")).encode() + b"\n\n")
    assert ledger.prompt_ids == [1, 2] and ledger.token_ids == [5]


@pytest.mark.parametrize("message", ['"length"', "[1]", "null"])
def test_chat_answers_without_a_message_object_are_not_spliced(message: str) -> None:
    """Found by ``kvwire bench fuzz``: P's chat answer whose ``message`` is not an object
    (AttributeError), and D's chat events without a ``delta`` object (TypeError on the trim)."""
    from kvwire.router.relay import FirstTokenSplicer

    answer = b'{"choices": [{"index": 0, "message": ' + message.encode() + b"}]}"
    assert FirstTokenSplicer.from_prefill(answer, chat=True) is None
    good = b'{"choices": [{"index": 0, "message": {"role": "assistant", "content": "Hi"}}]}'
    splicer = FirstTokenSplicer.from_prefill(good, chat=True)
    assert splicer is not None
    for choice in (b'{"index": 0, "delta": null, "finish_reason": "stop"}', b'{"delta": "Hi"}', b"7"):
        event = b'data: {"choices": [' + choice + b"]}\n\n"
        assert splicer.filter(event) == event  # not one to trim: passed on unchanged


def test_nccl_plane_info_nest_is_a_protocol_error() -> None:
    from kvwire.transfer.planes.nccl.plane_info import NcclInfo, decode_info, encode_info

    assert decode_info(encode_info(NcclInfo())) == NcclInfo()
    with pytest.raises(ProtocolError, match="malformed NCCL plane info"):
        decode_info(b"\x81\xa1x" + b"\x91" * 3000 + b"\x90")  # an unknown key holding the nest


def test_vllm_kv_event_batch_nest_is_a_malformed_batch() -> None:
    """vLLM's publisher is in the same pod, but its batches are decoded by the plugin's bridge
    thread: a nest (in the batch or in one event, which the batch skips as raw bytes) is a malformed
    batch, counted by the bridge, never raised past it."""
    import msgspec as ms

    from kvwire.integrations.vllm_kv_events import VllmKvEventBridge, VllmKvTranslator, decode_events
    from kvwire.protocol.kv_blocks import KvEventLog

    nested_events = b"\x93\xcb" + bytes(8) + b"\x91" * 3000 + b"\x90" + b"\x00"
    nested_one = ms.msgpack.encode([1.5, [ms.Raw(b"\x81\xa4type" + b"\x91" * 3000 + b"\x90")], 0])
    bridge = VllmKvEventBridge("tcp://127.0.0.1:1", VllmKvTranslator(KvEventLog(16)))  # never started
    for seq, payload in enumerate((nested_events, nested_one)):
        with pytest.raises(ms.DecodeError, match="nested too deep"):
            decode_events(payload)
        bridge.on_frames([b"", seq.to_bytes(8, "big"), payload])
    assert bridge.malformed == 2 and bridge.batches == 0


@pytest.mark.parametrize("token", [2**63, -1])
def test_vllm_block_stored_with_a_token_id_out_of_range_is_an_unknown_event(token: int) -> None:
    """Found by ``kvwire bench fuzz`` (vllm.kv_events): a stored block's token id outside int64
    made kvwire's chain hash fail to pack it (``struct.error`` on the bridge thread). The decoder
    bounds token ids; such an event is skipped as unknown, the rest of its batch applied."""
    import msgspec as ms

    from kvwire.bench.fuzz_corpus import vllm_kv_events
    from kvwire.integrations.vllm_kv_events import decode_events

    good = ms.msgpack.decode(vllm_kv_events()[0])[1][0]
    bad = dict(good, token_ids=[token] * len(good["token_ids"]))
    events, unknown = decode_events(ms.msgpack.encode([1.5, [bad, good], 0]))
    assert unknown == 1 and len(events) == 1
