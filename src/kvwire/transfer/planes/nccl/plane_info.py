"""Handshake bytes of the NCCL data plane (carried opaquely in the agent's ``plane_info`` field).

The **receiver** of a direction owns its communicator and its message framing:

* :class:`CommOffer` — "join communicator ``comm_id`` (this NCCL unique id, and one more per extra
  *lane*) as rank 0 and send to me on it" (with zero-copy messages or without). Created lazily, the
  first time the receiver posts a buffer for that peer; repeated until the receiver closes it
  (idle) or a new one replaces it.
* :class:`ChunkPlan` — the receiver coalesces consecutive granted layers of one transfer into one NCCL
  message (a *chunk*) and tells the sender how: chunk ``seq`` on ``comm_id`` carries ``layers`` of
  ``transfer_id`` (``num_bytes`` in total). The sender posts exactly these messages in ``seq`` order,
  so matched ``ncclSend``/``ncclRecv`` sizes always agree; a chunk whose transfer was cancelled is
  still sent (dummy bytes), which keeps both ends of the stream in step. ``lane`` says which of the
  offer's communicators carries it (each lane keeps ``seq`` order on both ends).

Encoded with msgspec msgpack; :func:`decode_info` raises :class:`~kvwire.errors.ProtocolError`.
"""

from __future__ import annotations

import msgspec

from kvwire.errors import ProtocolError

NCCL_INFO_VERSION = 1
MAX_CHUNKS_PER_INFO = 65536
MAX_LANES = 4  # communicators per offer (NcclPlaneConfig.lanes)


class CommOffer(msgspec.Struct, array_like=True, frozen=True):
    comm_id: str  # random hex; names the communicator and its chunk sequence
    unique_id: bytes  # ncclUniqueId (128 bytes)
    # Both ends pass only registered buffers to this communicator (NcclPlaneConfig.zero_copy): NCCL
    # needs both or neither, so the receiver decides and the sender follows. Last, with a default:
    # an offer from before this field decodes as False.
    zero_copy: bool = False
    # NCCL unique ids of the offer's further communicators (lanes 1, 2, ...). Trailing, defaulted:
    # an older offer decodes as one lane.
    lane_ids: list[bytes] = msgspec.field(default_factory=list)

    @property
    def unique_ids(self) -> list[bytes]:
        """Every lane's NCCL unique id, lane 0 first."""
        return [self.unique_id, *self.lane_ids]


class ChunkPlan(msgspec.Struct, array_like=True, frozen=True):
    comm_id: str
    seq: int  # 0, 1, 2 ... per communicator
    transfer_id: str
    layers: list[int]  # layer indices, in wire order
    num_bytes: int  # sum of the layers' sizes
    lane: int = 0  # which of the offer's communicators carries it (trailing: older plans use lane 0)


class NcclInfo(msgspec.Struct, frozen=True, kw_only=True):
    v: int = NCCL_INFO_VERSION
    offers: list[CommOffer] = msgspec.field(default_factory=list)
    chunks: list[ChunkPlan] = msgspec.field(default_factory=list)


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(NcclInfo)


def encode_info(info: NcclInfo) -> bytes:
    return _encoder.encode(info)


def decode_info(data: bytes) -> NcclInfo:
    """Decode and validate handshake bytes from a peer."""
    try:
        info = _decoder.decode(data)
    except (msgspec.DecodeError, RecursionError) as exc:  # nesting past msgspec's limit: RecursionError
        raise ProtocolError(f"malformed NCCL plane info: {exc}") from exc
    if info.v != NCCL_INFO_VERSION:
        raise ProtocolError(f"unsupported NCCL plane info version {info.v}")
    if len(info.chunks) > MAX_CHUNKS_PER_INFO:
        raise ProtocolError(f"NCCL plane info with {len(info.chunks)} chunks")
    for offer in info.offers:
        if any(len(uid) != 128 for uid in offer.unique_ids) or not offer.comm_id:
            raise ProtocolError("NCCL comm offer with a bad unique id")
        if len(offer.unique_ids) > MAX_LANES:
            raise ProtocolError(f"NCCL comm offer with {len(offer.unique_ids)} lanes (at most {MAX_LANES})")
    for chunk in info.chunks:
        if chunk.seq < 0 or chunk.num_bytes < 0 or not chunk.layers or any(i < 0 for i in chunk.layers):
            raise ProtocolError(f"bad NCCL chunk plan {chunk}")
        if not 0 <= chunk.lane < MAX_LANES:
            raise ProtocolError(f"NCCL chunk plan on lane {chunk.lane}")
    return info
