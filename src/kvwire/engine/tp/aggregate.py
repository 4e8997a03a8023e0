"""Merge the ranks' connector reports into the one report the scheduler reads (rank 0).

A request's KV send is finished when every rank reports it (P frees its blocks only then); its
KV receive is finished when every rank has every layer. A receive that fails on any rank ends the
request at once for all of them: the failure is reported now (per the load-failure policy, as the
failing rank wrote it: ``failed`` or ``invalid_block_ids``) and the other ranks' receives of that
transfer are aborted in the next step, so no rank keeps loading into blocks the request gives up.
"""

from __future__ import annotations

import dataclasses
from collections import Counter, OrderedDict
from collections.abc import Sequence

from kvwire.connector.base import ConnectorMetadata, ConnectorOutput
from kvwire.connector.metadata import AbortSpec, KvwireConnectorMetadata

_FORGET_AFTER = 4096  # ended requests remembered (to drop their other ranks' late reports)


@dataclasses.dataclass
class _Recv:
    transfer_id: str
    block_ids: frozenset[int]
    first_token: int | None = None


class OutputAggregator:
    """Rank 0 only. ``note_metadata`` with each step's metadata, then ``merge`` the ranks' outputs."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._sent: Counter[str] = Counter()
        self._recvd: Counter[str] = Counter()
        self._recvs: dict[str, _Recv] = {}
        self._ended: OrderedDict[str, None] = OrderedDict()
        self._to_abort: list[AbortSpec] = []

    def note_metadata(self, metadata: ConnectorMetadata) -> None:
        if isinstance(metadata, KvwireConnectorMetadata):
            for spec in metadata.recvs:
                self._recvs[spec.request_id] = _Recv(spec.transfer_id, frozenset(spec.block_ids))
            for abort in metadata.aborts:
                self._recvs.pop(abort.request_id, None)
                self._recvd.pop(abort.request_id, None)

    def take_aborts(self) -> tuple[AbortSpec, ...]:
        """Aborts the next step's metadata must carry to every rank."""
        out, self._to_abort = tuple(self._to_abort), []
        return out

    def merge(self, outputs: Sequence[ConnectorOutput]) -> ConnectorOutput:
        sending: set[str] = set()
        recving: set[str] = set()
        failed: dict[str, str] = {}
        invalid: set[int] = set()
        first: dict[str, int] = {}
        for rank, out in enumerate(outputs):
            for rid in out.finished_sending:
                self._sent[rid] += 1
                if self._sent[rid] >= self.size:
                    del self._sent[rid]
                    sending.add(rid)
            for rid, reason in out.failed.items():
                if self._end(rid, f"rank {rank}: {reason}"):
                    failed[rid] = reason
            for rid in out.finished_recving:
                recv = self._recvs.get(rid)
                if rid in self._ended or recv is None:
                    continue
                if rank == 0 and rid in out.first_token_ids:
                    recv.first_token = out.first_token_ids[rid]
                bad = recv.block_ids & out.invalid_block_ids
                if bad:  # this rank's pieces failed: recompute now, stop the other ranks' pieces
                    self._end(rid, f"rank {rank}: KV load failed")
                    recving.add(rid)
                    invalid |= recv.block_ids
                    continue
                self._recvd[rid] += 1
                if self._recvd[rid] >= self.size:
                    del self._recvd[rid], self._recvs[rid]
                    recving.add(rid)
                    if recv.first_token is not None:
                        first[rid] = recv.first_token
        return ConnectorOutput(frozenset(sending), frozenset(recving), failed, frozenset(invalid), first)

    def _end(self, rid: str, reason: str) -> bool:
        """End a receive on every rank. False when it had already ended."""
        if rid in self._ended:
            return False
        self._ended[rid] = None
        while len(self._ended) > _FORGET_AFTER:
            self._ended.popitem(last=False)
        self._recvd.pop(rid, None)
        recv = self._recvs.pop(rid, None)
        if recv is not None and self.size > 1:
            self._to_abort.append(AbortSpec(rid, recv.transfer_id, reason, report_free=False))
        return True
