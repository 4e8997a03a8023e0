"""vLLM's own KV events, forwarded to the kvwire router (decision 100). No vLLM import, no torch.

vLLM publishes its prefix-cache changes when started with ``--kv-events-config``
(``{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557"}``): a ZeroMQ PUB
socket sends ``(topic, seq, payload)`` frames, ``seq`` a big-endian 8-byte counter and ``payload`` a
msgpack ``KVEventBatch`` ``[ts, events, data_parallel_rank]`` whose events are maps tagged by
``type``: ``BlockStored`` (vLLM block hashes, the parent's hash, the blocks' token ids, the block
size), ``BlockRemoved`` (hashes) and ``AllBlocksCleared``.

vLLM's block hashes are not kvwire's: they depend on vLLM's hash function (``sha256`` by default,
``xxhash`` optional), a seed (random per process for the non-cryptographic ones, ``PYTHONHASHSEED``)
and vLLM's encoding of the block, all of which change with vLLM's versions and settings. So the
plugin does not forward them: :class:`VllmKvTranslator` re-hashes each stored block with
:func:`kvwire.protocol.kv_blocks.hash_block` over the token ids the event carries, chained from its parent's
kvwire hash, and remembers ``vLLM hash -> kvwire hash`` for as long as vLLM holds the block (removals
carry only vLLM's hash). The router therefore indexes one hash scheme for every instance, built-in
engine and vLLM alike, and computes it for prompts as before.

Blocks whose vLLM hash covers more than their tokens (LoRA adapters, multimodal inputs, a
``cache_salt``: vLLM's "extra keys") are not forwarded, nor is anything chained after them: the router
cannot tell which requests would hit them, and a hint it cannot match is useless. Partial-block
entries, other KV cache groups and other media (an offloading tier's ``CPU``) are skipped too.

:class:`VllmKvEventBridge` is the thread that subscribes to vLLM's publisher (in the same process:
the scheduler half of the plugin runs in vLLM's engine core) and feeds a :class:`KvEventLog`, which
the discovery client drains into ``KvEvents`` batches like the built-in engine's.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections import Counter
from typing import Annotated, Any

import msgspec
import zmq

from kvwire.protocol.kv_blocks import ROOT_HASH, BlockHash, KvEventLog, hash_block
from kvwire.supervision import HealthBoard, SupervisedThread

log = logging.getLogger(__name__)

VllmHash = bytes | int  # vLLM's ExternalBlockHash: sha256 bytes, or a 64-bit int when so configured
# kvwire's chain hashes token ids as signed 64-bit integers: an event with others is an unknown event
TokenId = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
MAIN_MEDIUM = "GPU"  # what vLLM's block pool reports for its own KV cache (on CPU hosts too)
POLL_MS = 100  # how often the bridge thread checks for close()
MAX_DRAIN = 1000  # messages handled per wake-up at most


class VllmBlockStored(msgspec.Struct, tag="BlockStored"):
    block_hashes: list[VllmHash]
    parent_block_hash: VllmHash | None = None
    token_ids: list[TokenId] = msgspec.field(default_factory=list)
    block_size: int = 0
    lora_id: int | None = None
    lora_name: str | None = None
    medium: str | None = None
    extra_keys: list[Any] | None = None  # one entry per block; None: nothing but the tokens
    group_idx: int | None = None


class VllmBlockRemoved(msgspec.Struct, tag="BlockRemoved"):
    block_hashes: list[VllmHash]
    medium: str | None = None
    group_idx: int | None = None


class VllmAllBlocksCleared(msgspec.Struct, tag="AllBlocksCleared"):
    pass


VllmEvent = VllmBlockStored | VllmBlockRemoved | VllmAllBlocksCleared


class VllmEventBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[msgspec.Raw]  # decoded one by one: an event type we do not know is skipped, not fatal
    data_parallel_rank: int | None = None


_batch_decoder = msgspec.msgpack.Decoder(VllmEventBatch)
_event_decoder = msgspec.msgpack.Decoder(VllmEvent)


def decode_events(payload: bytes) -> tuple[list[VllmEvent], int]:
    """vLLM's msgpack ``KVEventBatch`` -> (the events we understand, how many we did not).

    Raises ``msgspec.DecodeError`` / ``msgspec.ValidationError`` when the batch itself is malformed
    (nested past msgspec's limit included).
    """
    try:
        batch = _batch_decoder.decode(payload)
    except RecursionError as exc:
        raise msgspec.DecodeError(f"KV event batch nested too deep: {exc}") from exc
    events: list[VllmEvent] = []
    unknown = 0
    for raw in batch.events:
        try:
            events.append(_event_decoder.decode(raw))
        except (msgspec.DecodeError, RecursionError):
            unknown += 1
    return events, unknown


class VllmKvTranslator:
    """vLLM's KV events -> kvwire block hashes in a :class:`KvEventLog`. One thread (the bridge's).

    ``skipped`` counts blocks not forwarded, by reason (``extra_keys``, ``lora``, ``medium``,
    ``group``, ``partial``, ``unknown_parent``).
    """

    def __init__(self, events: KvEventLog) -> None:
        self.events = events
        self.block_size = events.block_size
        self._kvwire: dict[VllmHash, BlockHash] = {}  # blocks vLLM holds now, by its hash
        self._refs: Counter[BlockHash] = Counter()  # vLLM blocks per kvwire hash
        self.skipped: Counter[str] = Counter()

    @property
    def num_blocks(self) -> int:
        return len(self._kvwire)

    def apply(self, events: list[VllmEvent]) -> None:
        for event in events:
            if isinstance(event, VllmBlockStored):
                self._stored(event)
            elif isinstance(event, VllmBlockRemoved):
                self._removed(event)
            else:
                self.events.removed(list(self._refs))
                self._kvwire.clear()
                self._refs.clear()

    def _skip_reason(self, event: VllmBlockStored) -> str | None:
        if event.medium not in (None, MAIN_MEDIUM):
            return "medium"
        if event.group_idx not in (None, 0):
            return "group"
        if event.lora_name is not None or event.lora_id is not None:
            return "lora"
        whole = len(event.block_hashes) * self.block_size
        if event.block_size != self.block_size or len(event.token_ids) != whole:
            return "partial"
        return None

    def _stored(self, event: VllmBlockStored) -> None:
        reason = self._skip_reason(event)
        parent: BlockHash | None = ROOT_HASH
        if event.parent_block_hash is not None:
            parent = self._kvwire.get(event.parent_block_hash)
        if reason is None and parent is None:
            reason = "unknown_parent"  # its parent was skipped, or stored before we subscribed
        if reason is not None:
            self.skipped[reason] += len(event.block_hashes)
            return
        assert parent is not None
        extra = event.extra_keys or []
        bs = self.block_size
        new: list[BlockHash] = []
        for i, vllm_hash in enumerate(event.block_hashes):
            if i < len(extra) and extra[i] is not None:
                self.skipped["extra_keys"] += len(event.block_hashes) - i  # and the blocks after it
                break
            parent = hash_block(parent, event.token_ids[i * bs : (i + 1) * bs])
            if vllm_hash not in self._kvwire:  # vLLM re-announces blocks it reuses (report mode "full")
                self._kvwire[vllm_hash] = parent
                self._refs[parent] += 1
                if self._refs[parent] == 1:
                    new.append(parent)
        if new:
            self.events.stored(new)

    def _removed(self, event: VllmBlockRemoved) -> None:
        gone: list[BlockHash] = []
        for vllm_hash in event.block_hashes:
            kvwire_hash = self._kvwire.pop(vllm_hash, None)
            if kvwire_hash is None:
                continue  # a block we never forwarded
            self._refs[kvwire_hash] -= 1
            if self._refs[kvwire_hash] <= 0:
                del self._refs[kvwire_hash]
                gone.append(kvwire_hash)
        if gone:
            self.events.removed(gone)


@dataclasses.dataclass(frozen=True)
class VllmKvEventsSource:
    """Where the plugin subscribes to vLLM's KV events (see :func:`kv_events_source`)."""

    endpoint: str  # a connectable ZeroMQ endpoint
    topic: str = ""


def kv_events_source(kv_events_config: Any, data_parallel_rank: int = 0) -> VllmKvEventsSource | None:
    """The subscription for vLLM's ``KVEventsConfig`` (duck-typed); None when vLLM publishes no
    events over ZeroMQ, or at an endpoint the plugin cannot subscribe to (logged)."""
    if kv_events_config is None or not getattr(kv_events_config, "enable_kv_cache_events", False):
        return None
    if getattr(kv_events_config, "publisher", "zmq") != "zmq":
        return None
    configured = str(kv_events_config.endpoint)
    endpoint = subscribe_endpoint(configured, data_parallel_rank)
    if endpoint is None:
        log.warning("kvwire: cannot subscribe to vLLM's KV events at %r (bind a tcp://*:PORT, ipc:// or "
                    "inproc:// endpoint); the router routes this instance on load only", configured)
        return None
    return VllmKvEventsSource(endpoint, str(getattr(kv_events_config, "topic", "") or ""))


def subscribe_endpoint(publisher_endpoint: str, data_parallel_rank: int = 0) -> str | None:
    """Where to subscribe to a vLLM publisher configured with ``publisher_endpoint`` (vLLM binds
    wildcard, ``ipc://`` and ``inproc://`` endpoints, shifted by the data-parallel rank as vLLM does).

    None when the plugin cannot subscribe: vLLM *connects* its PUB to a fixed ``tcp://host:port``
    (someone else binds there), or binds ``tcp://*:0`` (a port only vLLM learns).
    """
    endpoint = publisher_endpoint.strip()
    if endpoint.startswith("inproc://"):
        return endpoint if data_parallel_rank == 0 else f"{endpoint}_dp{data_parallel_rank}"
    if endpoint.startswith("ipc://"):
        return endpoint
    if not endpoint.startswith("tcp://") or ":" not in endpoint[len("tcp://"):]:
        return None
    host, _, port_text = endpoint[len("tcp://"):].rpartition(":")
    if host not in ("*", "0.0.0.0", "[::]", "::"):
        return None
    try:
        port = int(port_text)
    except ValueError:
        return None
    if port <= 0:
        return None
    loopback = "[::1]" if host in ("[::]", "::") else "127.0.0.1"
    return f"tcp://{loopback}:{port + data_parallel_rank}"


class VllmKvEventBridge:
    """A daemon thread: SUB to vLLM's publisher at ``endpoint`` (topic prefix ``topic``) -> translator.

    ``start()`` connects (ZeroMQ retries until vLLM binds); ``close()`` (idempotent) stops the thread
    within ``POLL_MS`` and closes the socket. Sequence gaps (PUB drops messages a slow subscriber
    cannot take, and anything published before the subscription took hold) are counted in ``gaps``
    and logged: a lost ``BlockStored`` costs the router a missed hit, a lost ``BlockRemoved`` a stale
    hint — never a wrong answer (decision 046).
    """

    def __init__(
        self, endpoint: str, translator: VllmKvTranslator, topic: str = "", *,
        board: HealthBoard | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.translator = translator
        self._topic = topic.encode()
        self._stop = threading.Event()
        self._board = board
        self._thread: SupervisedThread | None = None
        self._next_seq: int | None = None
        self.batches = 0
        self.gaps = 0
        self.malformed = 0

    def start(self) -> VllmKvEventBridge:
        if self._thread is None:
            self._thread = SupervisedThread("kvwire-vllm-kv-events", self._run, self._stop, board=self._board)
            self._thread.start()
        return self

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.stop(timeout_s=POLL_MS / 1000 + 2.0)  # logs when it did not stop in time
        t = self.translator
        log.info("kvwire: vLLM KV event bridge closed: %d batches, %d blocks held, %d gaps, %d malformed, "
                 "skipped %s", self.batches, t.num_blocks, self.gaps, self.malformed, dict(t.skipped))

    def _run(self) -> None:
        """The supervised thread's body (``kvwire-vllm-kv-events``): its own SUB socket, closed on
        the way out; an exception restarts it with backoff on a fresh socket (a sequence gap then
        says batches were missed), and one that keeps failing is dead on the host's board."""
        # vLLM's publisher uses the process-wide context: an inproc:// endpoint needs the same one.
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        sock = ctx.socket(zmq.SUB)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVHWM, 100_000)
            sock.setsockopt(zmq.SUBSCRIBE, self._topic)
            sock.connect(self.endpoint)
            log.info("kvwire: forwarding vLLM's KV events from %s to the router", self.endpoint)
            while not self._stop.is_set():
                if sock.poll(POLL_MS):
                    self._drain(sock)
        finally:
            sock.close(linger=0)

    def _drain(self, sock: zmq.Socket) -> None:
        for _ in range(MAX_DRAIN):
            try:
                frames = sock.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            self.on_frames(frames)

    def on_frames(self, frames: list[bytes]) -> None:
        """Handle one ``(topic, seq, payload)`` message (bridge thread; public for tests)."""
        if len(frames) != 3 or len(frames[1]) != 8:
            self.malformed += 1
            return
        seq = int.from_bytes(frames[1], "big", signed=True)
        expected = 0 if self._next_seq is None else self._next_seq
        if seq != expected:
            self.gaps += 1
            log.warning("kvwire: vLLM KV event batches %d..%d were lost; the router's index may miss "
                        "or keep some of this instance's blocks until they change", expected, seq - 1)
        self._next_seq = seq + 1
        try:
            events, unknown = decode_events(frames[2])
        except Exception as exc:  # DecodeError, ValidationError, RecursionError (nesting), ...
            self.malformed += 1
            log.warning("kvwire: malformed vLLM KV event batch %d: %s", seq, exc)
            return
        if unknown:
            self.translator.skipped["unknown_event"] += unknown
        self.translator.apply(events)
        self.batches += 1
