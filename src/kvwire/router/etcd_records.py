"""The router's view of the instance records under an etcd prefix, applied to its registry.

PUT records (from a range read or the watch) are applied as heartbeats (new instance, restart with a
newer epoch, load update); a DELETE (lease expired: kill -9, SIGSTOP, host gone; or revoked:
graceful shutdown) deregisters that instance at once. Records that fail to decode are dropped and
counted in ``dropped["malformed"]``. With a shared secret a record must be signed with it
(:class:`~kvwire.discovery.etcd_gateway.SignedRecord`): unsigned or badly signed ones are dropped
as ``dropped["unauthenticated"]``, and an old record written again (its ``seq`` below the last one
of its instance and epoch, or a first record older than the freshness window plus its ``ttl_s``) as
``dropped["replayed"]`` (:mod:`kvwire.router.freshness`, decision 125). Refusals are logged once per
reason a minute.

Alongside, per instance: the epoch of its last record, the mod revision of its key (what an expiry
probe compares, :mod:`kvwire.router.etcd_probe`) and the deadline of its promised next record
(:class:`~kvwire.router.etcd_expiry.DeadlineHeap`). Pure bookkeeping, no I/O; event-loop thread.
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Any

from kvwire.discovery.etcd_gateway import decode_record, record_key, unb64
from kvwire.discovery.heartbeats import Deregister, Heartbeat
from kvwire.errors import AuthenticationError, ProtocolError
from kvwire.http.refusal_log import RefusalLog
from kvwire.router.etcd_expiry import DeadlineHeap
from kvwire.router.etcd_stream import WatchEvent
from kvwire.router.freshness import FreshnessGuard
from kvwire.router.registry import ApplyResult, Registry, clamp_ttl_s

log = logging.getLogger(__name__)


class EtcdRecords:
    def __init__(
        self, registry: Registry, prefix: str, *, secret: bytes | None, freshness_window_s: float,
        freshness_max_entries: int,
    ) -> None:
        self._registry = registry
        self._prefix = prefix
        self._record_key = record_key(secret) if secret else None  # records must be signed with it
        # a re-sync reads the same records again: the same seq is not a replay here
        self.freshness = FreshnessGuard(freshness_window_s, max_entries=freshness_max_entries,
                                        allow_repeat=True) if secret else None
        self._refusals = RefusalLog(log, "etcd record")
        self.epochs: dict[str, int] = {}  # instance id -> epoch of the record seen last
        self.revisions: dict[str, int] = {}  # instance id -> mod revision of its record applied last
        self.deadlines = DeadlineHeap()  # instance id -> when its promised next record is overdue
        self.received: collections.Counter[str] = collections.Counter()  # by ApplyResult value
        self.dropped: collections.Counter[str] = collections.Counter()  # by reason
        self.revision = 0  # the newest change the watch has delivered

    # --- a range read (a sync) ------------------------------------------------------------------

    def from_range(self, kvs: list[dict[str, Any]]) -> list[Heartbeat]:
        """The valid records of a range answer (revisions noted; the rest counted and logged)."""
        return [record for kv in kvs if (record := self._on_put(kv)) is not None]

    def forget_missing(self, present: set[str]) -> None:
        """Deregister every instance this view knew that a sync no longer found."""
        for ident in set(self.epochs) - present:
            self._on_delete(ident)

    def rearm_deadlines(self) -> None:
        """After a stale spell: every entry counts as heard from now (the silence was etcd's)."""
        self._registry.touch_all()
        for view in self._registry.snapshot():
            if view.alive and view.ttl_s > 0 and view.instance_id in self.epochs:
                self.deadlines.set(view.instance_id, view.last_seen + view.ttl_s)

    # --- the watch ------------------------------------------------------------------------------

    def apply_events(self, events: list[WatchEvent]) -> None:
        """Apply watch events in order, as few registry batches as order allows (a batch never
        holds two events of one instance)."""
        batch: list[Heartbeat | Deregister] = []
        in_batch: set[str] = set()
        for event in events:
            kv = event.kv
            if kv is None:
                continue
            self._note_revision(kv.key, kv.mod_revision, deleted=event.type == "DELETE")
            msg = self._event_message(event.type, kv.key, kv.value)
            if msg is not None:
                ident = msg.instance_id if isinstance(msg, Deregister) else msg.info.instance_id
                if ident in in_batch:
                    self.apply_batch(batch)
                    batch, in_batch = [], set()
                    if isinstance(msg, Deregister):  # its epoch may have moved; a record is decoded
                        msg = self._event_message(event.type, kv.key, kv.value)  # once (freshness)
                if msg is not None:
                    batch.append(msg)
                    in_batch.add(ident)
            # the newest change delivered (not the header's: a catching-up watch's first answer
            # carries the store's revision before the events that lead to it)
            self.revision = max(self.revision, kv.mod_revision)
        self.apply_batch(batch)

    def apply_batch(self, batch: list[Heartbeat | Deregister]) -> None:
        if not batch:
            return
        results = self._registry.apply_many(batch)
        for msg, result in zip(batch, results, strict=True):
            self.received[result.value] += 1
            if isinstance(msg, Deregister):
                if result is ApplyResult.DEREGISTERED:
                    self.epochs.pop(msg.instance_id, None)
                    self.deadlines.discard(msg.instance_id)
            elif result not in (ApplyResult.STALE, ApplyResult.REFUSED):
                self._note_record(msg)

    # --- expiry ---------------------------------------------------------------------------------

    def due(self, now: float, max_keys: int) -> dict[str, int]:
        """Up to ``max_keys`` instances whose deadline passed (taken off the heap), with the revision
        of the record applied last."""
        return {ident: self.revisions.get(ident, 0) for ident in self.deadlines.pop_before(now, max_keys)}

    def recheck(self, idents: list[str], at: float) -> None:
        """Ask about ``idents`` again at ``at``, unless a newer record set their deadline meanwhile."""
        for ident in idents:
            if ident in self.epochs and ident not in self.deadlines:
                view = self._registry.get(ident)
                if view is not None and view.alive and view.ttl_s > 0:
                    self.deadlines.set(ident, at)

    # --- one record -----------------------------------------------------------------------------

    def _note_revision(self, key: bytes, revision: int, *, deleted: bool) -> None:
        """The newest revision of an instance's key the router has seen (what a probe compares)."""
        ident = key.decode(errors="replace").removeprefix(self._prefix)
        if deleted:
            self.revisions.pop(ident, None)
        else:
            self.revisions[ident] = revision

    def _event_message(self, kind: str, key: bytes, value: bytes) -> Heartbeat | Deregister | None:
        if kind == "DELETE":
            ident = key.decode(errors="replace").removeprefix(self._prefix)
            epoch = self.epochs.get(ident)
            if epoch is None:
                return None
            if self.freshness is not None:  # in etcd's order: the deleted record put back is a replay
                self.freshness.seal(ident, epoch)
            return Deregister(instance_id=ident, epoch=epoch, sent_at=time.time())
        return self._record(value, key)

    def _record(self, value: bytes, key: object) -> Heartbeat | None:
        """A record's value, decoded, verified (with a secret) and fresh; else None (counted, logged)."""
        try:
            record = decode_record(value, self._record_key)
        except AuthenticationError as exc:
            self.dropped["unauthenticated"] += 1
            self._refusals.refused("unauthenticated", f"key {key!r:.200}: {exc}")
            return None
        except (ProtocolError, ValueError) as exc:
            self.dropped["malformed"] += 1
            self._refusals.refused("malformed", f"key {key!r:.200}: {exc}")
            return None
        if self.freshness is None:
            return record
        promised_s = clamp_ttl_s(record.ttl_s, self._registry.max_record_ttl_s)
        max_age_s = self.freshness.window_s + promised_s if promised_s > 0 else None
        refused = self.freshness.check(record.info.instance_id, record.info.epoch, record.seq,
                                       record.sent_at, max_age_s)
        if refused is None:
            return record
        self.dropped["replayed"] += 1
        self._refusals.refused("replayed", f"key {key!r:.200}: {refused}")
        return None

    def _note_record(self, record: Heartbeat) -> None:
        ident = record.info.instance_id
        self.epochs[ident] = record.info.epoch
        view = self._registry.get(ident)
        if view is not None and view.ttl_s > 0:
            self.deadlines.set(ident, view.last_seen + view.ttl_s)
        else:
            self.deadlines.discard(ident)

    def _on_put(self, kv: dict[str, Any]) -> Heartbeat | None:
        """A record of a range answer, decoded (None, counted, when malformed); its revision noted."""
        self._note_revision(unb64(kv.get("key", "")), int(kv.get("mod_revision", 0)), deleted=False)
        try:
            value = unb64(kv.get("value", ""))
        except ValueError as exc:
            self.dropped["malformed"] += 1
            self._refusals.refused("malformed", f"key {kv.get('key')!r:.200}: {exc}")
            return None
        return self._record(value, kv.get("key"))

    def _on_delete(self, ident: str) -> None:
        epoch = self.epochs.pop(ident, None)
        self.deadlines.discard(ident)
        self.revisions.pop(ident, None)
        if epoch is None:
            return
        if self.freshness is not None:
            self.freshness.seal(ident, epoch)
        result = self._registry.apply(Deregister(instance_id=ident, epoch=epoch, sent_at=time.time()))
        self.received[result.value] += 1
