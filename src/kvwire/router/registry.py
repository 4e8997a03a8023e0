"""What the router knows of its instances: who is live (:class:`Registry`, below) and which
prefix-cache blocks each holds (:class:`KvIndex`, at the end). Both are fed by discovery threads and
read by the event loop.

Instance registry: who is alive, by heartbeat, TTL and request-path failures.

Thread-safety: the discovery listener thread and the sweeper thread write, the router's event loop
reads. Every method takes the one lock; readers get immutable :class:`InstanceView` tuples, cached
until the next change, so the request path costs one attribute read when nothing changed.

Cost at scale: a heartbeat that only refreshes a live entry (the steady state: N of them per
interval) swaps that one entry into the cached tuples at its known position (a C-level tuple copy)
instead of re-sorting everything; any other change rebuilds the tuples (O(N log N)).

Liveness rules:
* a heartbeat registers or refreshes ``(instance_id, epoch)``; a newer epoch replaces the old entry
  (restart); an older epoch or a non-increasing ``seq`` is stale and ignored;
* a new instance at the URL of another entry replaces that entry (one process per address);
* :meth:`Registry.mark_unreachable` (request-path failure, discovery connection closed) takes an
  instance out of routing until its next heartbeat;
* :meth:`Registry.sweep` (run by :class:`~kvwire.router.sweeper.RegistrySweeper`) expires entries
  silent for ``ttl_s`` (or for the TTL their last heartbeat promised) and forgets expired ones
  after ``forget_after_s``; an etcd router, which tracks deadlines itself and has etcd confirm a
  silence first, calls :meth:`Registry.expire` for the instances it confirmed instead;
* a :class:`Deregister` for the current epoch removes the entry at once.

``on_remove(instance_id)`` (optional) is called, outside the lock, for every entry removed
(deregistered, forgotten, or replaced by another instance at its URL): the router drops the
instance's KV index entries then.
"""

from __future__ import annotations

import enum
import logging
import math
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import msgspec
from msgspec.structs import replace

from kvwire.discovery.heartbeats import Deregister, Heartbeat, InstanceInfo, InstanceLoad, KvEvents
from kvwire.http.refusal_log import RefusalLog
from kvwire.protocol.kv_blocks import BlockHash
from kvwire.protocol.kv_params import Role

log = logging.getLogger(__name__)

Clock = Callable[[], float]



class InstanceState(str, enum.Enum):
    ALIVE = "alive"
    UNREACHABLE = "unreachable"  # request-path failure / connection closed; back on next heartbeat
    EXPIRED = "expired"  # no heartbeat within the TTL


class ApplyResult(str, enum.Enum):
    REGISTERED = "registered"
    REFRESHED = "refreshed"
    REPLACED = "replaced"  # new epoch (restart) or new instance at the same URL
    DEREGISTERED = "deregistered"
    STALE = "stale"  # older epoch, replayed/reordered seq, or deregistration of an unknown epoch
    REFUSED = "refused"  # a new instance while the registry holds max_instances entries


class InstanceView(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """Immutable snapshot of one registry entry.

    A msgspec struct, not a dataclass: one is made per applied heartbeat (1,000 a second at
    N = 1,000), and a struct is built in a fraction of a frozen dataclass's time. ``gc=False``: it
    holds only immutable records (no cycles), so the garbage collector never walks the registry's
    views (decision 109).
    """

    info: InstanceInfo
    load: InstanceLoad | None
    state: InstanceState
    last_seen: float  # registry clock (monotonic) of the last heartbeat
    last_seq: int
    reason: str = ""  # why it is not alive
    first_seen: float = 0.0  # registry clock of this epoch's first heartbeat
    ttl_s: float = 0.0  # the next heartbeat promised within this long (etcd records); 0 = none

    @property
    def instance_id(self) -> str:
        return self.info.instance_id

    @property
    def role(self) -> Role:
        return self.info.role

    @property
    def url(self) -> str:
        return self.info.url

    @property
    def alive(self) -> bool:
        return self.state is InstanceState.ALIVE


DEFAULT_MAX_INSTANCES = 10_000
DEFAULT_MAX_RECORD_TTL_S = 60.0


def clamp_ttl_s(ttl_s: float, max_ttl_s: float) -> float:
    """A peer's promised ``ttl_s``, as the registry uses it: at most ``max_ttl_s``; a negative or
    non-finite one (NaN) counts as no promise (0: the registry's own TTL applies); ``inf`` is the cap."""
    if math.isnan(ttl_s) or ttl_s <= 0:
        return 0.0
    return min(ttl_s, max_ttl_s)


class Registry:
    """Bounds on what peers choose: at most ``max_instances`` entries (a heartbeat of a new instance
    beyond that is :attr:`ApplyResult.REFUSED`), and a promised ``ttl_s`` clamped to
    ``max_record_ttl_s`` (:func:`clamp_ttl_s`; clamps counted in :attr:`ttl_clamped`)."""

    def __init__(
        self, ttl_s: float, forget_after_s: float = 60.0, clock: Clock = time.monotonic,
        on_remove: Callable[[str], None] | None = None,
        on_register: Callable[[InstanceInfo], None] | None = None, *,
        max_instances: int = DEFAULT_MAX_INSTANCES, max_record_ttl_s: float = DEFAULT_MAX_RECORD_TTL_S,
    ) -> None:
        self.ttl_s = ttl_s
        self.max_instances = max_instances
        self.max_record_ttl_s = max_record_ttl_s
        self.ttl_clamped = 0  # heartbeats whose ttl_s was out of range (negative, NaN, above the cap)
        self._refusals = RefusalLog(log, "instance registration")
        self._on_remove = on_remove
        self._on_register = on_register  # outside the lock, once per new entry or epoch
        self._removed: list[str] = []  # ids removed under the lock, reported after it
        self.forget_after_s = forget_after_s
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: dict[str, InstanceView] = {}
        self._all: tuple[InstanceView, ...] = ()
        # Live entries by role, and by (role, model); None = any model.
        self._live: dict[tuple[Role, str | None], tuple[InstanceView, ...]] = {}
        # instance id -> its position in each cached tuple above (key None: ``_all``)
        self._pos: dict[str, list[tuple[tuple[Role, str | None] | None, int]]] = {}
        self.version = 0  # bumps on every change that affects routing

    # --- writers --------------------------------------------------------------------------------

    def apply(self, msg: Heartbeat | Deregister) -> ApplyResult:
        with self._lock:
            if isinstance(msg, Deregister):
                result = self._deregister(msg)
            else:
                old = self._entries.get(msg.info.instance_id)
                result = self._heartbeat(msg.info, msg.load, msg.seq, msg.ttl_s)
                if result is ApplyResult.REFRESHED and old is not None and old.alive and old.info == msg.info:
                    self._swap(self._entries[msg.info.instance_id])
                    return result
            if result not in (ApplyResult.STALE, ApplyResult.REFUSED):
                self._rebuild()
        self._report_removed()
        self._log_result(msg, result)
        return result

    def _registered(self, msg: Heartbeat | Deregister, result: ApplyResult) -> None:
        if self._on_register is not None and isinstance(msg, Heartbeat):
            self._on_register(msg.info)  # REGISTERED or REPLACED: a new instance or process

    def apply_many(self, msgs: list[Heartbeat | Deregister]) -> list[ApplyResult]:
        """:meth:`apply` for a batch (one watch message of an etcd router) under one lock, with at
        most one rebuild of the cached views: a burst of deletions costs one O(N log N), not one each."""
        results: list[ApplyResult] = []
        with self._lock:
            dirty = False
            swaps: list[InstanceView] = []  # plain refreshes, swapped in together at the end
            for msg in msgs:
                if isinstance(msg, Deregister):
                    result = self._deregister(msg)
                else:
                    old = self._entries.get(msg.info.instance_id)
                    result = self._heartbeat(msg.info, msg.load, msg.seq, msg.ttl_s)
                    same = old is not None and old.alive and old.info == msg.info
                    if result is ApplyResult.REFRESHED and same:
                        swaps.append(self._entries[msg.info.instance_id])
                        results.append(result)
                        continue
                dirty = dirty or result not in (ApplyResult.STALE, ApplyResult.REFUSED)
                results.append(result)
            if dirty:
                self._rebuild()  # from the entries, the refreshed ones included
            elif swaps:
                self._swap_many(swaps)
        self._report_removed()
        for msg, result in zip(msgs, results, strict=True):
            self._log_result(msg, result)
        return results

    def _log_result(self, msg: Heartbeat | Deregister, result: ApplyResult) -> None:
        ident = msg.instance_id if isinstance(msg, Deregister) else msg.info.instance_id
        if result in (ApplyResult.REGISTERED, ApplyResult.REPLACED, ApplyResult.DEREGISTERED):
            log.info("instance %s %s", ident, result.value)
            self._registered(msg, result)
        elif result is ApplyResult.REFUSED:
            self._refusals.refused("registry_full", f"instance {ident[:100]!r}: the registry holds "
                                   f"{self.max_instances} instances (--max-instances)")

    def expire(self, idents: list[str], as_of: float) -> list[str]:
        """Expire those of ``idents`` that are alive, promised a next heartbeat (``ttl_s`` > 0) and
        were silent past it as of ``as_of`` (registry clock); returns them. One rebuild at most.
        For a discovery source that tracks deadlines itself (etcd: a deadline heap)."""
        expired: list[str] = []
        reasons: list[str] = []
        with self._lock:
            for ident in idents:
                entry = self._entries.get(ident)
                if entry is None or not entry.alive or entry.ttl_s <= 0:
                    continue
                silent_s = as_of - entry.last_seen
                if silent_s > entry.ttl_s:
                    reason = f"no heartbeat for {silent_s:.1f} s"
                    self._entries[ident] = replace(entry, state=InstanceState.EXPIRED, reason=reason)
                    expired.append(ident)
                    reasons.append(reason)
            if expired:
                self._rebuild()
        for ident, reason in zip(expired, reasons, strict=True):
            log.warning("instance %s expired: %s", ident, reason)
        return expired

    def _heartbeat(
        self, info: InstanceInfo, load: InstanceLoad | None, seq: int, ttl_s: float
    ) -> ApplyResult:
        now = self._clock()
        old = self._entries.get(info.instance_id)
        same_url = [] if old is not None else [e for e in self._entries.values() if e.url == info.url]
        if old is None and len(self._entries) - len(same_url) >= self.max_instances:
            return ApplyResult.REFUSED
        clamped = clamp_ttl_s(ttl_s, self.max_record_ttl_s)
        if clamped != ttl_s and ttl_s != 0:
            self.ttl_clamped += 1
            ttl_s = clamped
        same_epoch = old is not None and old.info.epoch == info.epoch
        first_seen = old.first_seen if same_epoch and old is not None else now
        fresh = InstanceView(info=info, load=load, state=InstanceState.ALIVE, last_seen=now, last_seq=seq,
                             first_seen=first_seen, ttl_s=ttl_s)
        if old is None:
            result = ApplyResult.REGISTERED
            for other in same_url:
                del self._entries[other.instance_id]  # a new process took over that address
                self._removed.append(other.instance_id)
                result = ApplyResult.REPLACED
        elif info.epoch < old.info.epoch or (info.epoch == old.info.epoch and seq <= old.last_seq):
            return ApplyResult.STALE
        elif info.epoch > old.info.epoch:
            result = ApplyResult.REPLACED
        else:
            if old.state is not InstanceState.ALIVE:
                log.info("instance %s alive again (was %s)", info.instance_id, old.state.value)
            result = ApplyResult.REFRESHED
        self._entries[info.instance_id] = fresh
        return result

    def _deregister(self, msg: Deregister) -> ApplyResult:
        old = self._entries.get(msg.instance_id)
        if old is None or old.info.epoch != msg.epoch:
            return ApplyResult.STALE
        del self._entries[msg.instance_id]
        self._removed.append(msg.instance_id)
        return ApplyResult.DEREGISTERED

    def mark_unreachable(self, instance_id: str, epoch: int | None, reason: str) -> bool:
        """Take ``instance_id`` out of routing until its next heartbeat. False if unknown/other epoch."""
        with self._lock:
            old = self._entries.get(instance_id)
            if old is None or (epoch is not None and old.info.epoch != epoch):
                return False
            if old.state is not InstanceState.ALIVE:
                return False
            self._entries[instance_id] = replace(old, state=InstanceState.UNREACHABLE, reason=reason)
            self._rebuild()
        log.warning("instance %s out of routing: %s", instance_id, reason)
        return True

    def sweep(self) -> list[str]:
        """Expire entries silent past their TTL (the one their last heartbeat promised, else the
        registry's) and forget old expired ones; returns the ids that changed."""
        now = self._clock()
        changed: list[str] = []
        with self._lock:
            for ident, entry in list(self._entries.items()):
                silent_s = now - entry.last_seen
                if entry.state is InstanceState.EXPIRED:
                    if now - entry.last_seen > self.forget_after_s:
                        del self._entries[ident]
                        self._removed.append(ident)
                        changed.append(ident)
                elif silent_s > (entry.ttl_s or self.ttl_s):
                    reason = f"no heartbeat for {silent_s:.1f} s"
                    self._entries[ident] = replace(entry, state=InstanceState.EXPIRED, reason=reason)
                    changed.append(ident)
                    log.warning("instance %s expired: %s", ident, reason)
            if changed:
                self._rebuild()
        self._report_removed()
        return changed

    def touch_all(self) -> None:
        """Count every live entry as heard from now (a discovery source that was unreachable is back
        and has just re-read every record: silence during the outage was not the instances')."""
        now = self._clock()
        with self._lock:
            for ident, entry in list(self._entries.items()):
                if entry.alive:
                    self._entries[ident] = replace(entry, last_seen=now)
            self._rebuild()

    def _report_removed(self) -> None:
        with self._lock:
            removed, self._removed = self._removed, []
        if self._on_remove is not None:
            for ident in removed:
                self._on_remove(ident)

    def seconds_to_next_change(self) -> float | None:
        """Seconds until the earliest entry :meth:`sweep` would expire or forget (<= 0: due now);
        None when the registry is empty. O(N); the sweeper calls it once per wake-up."""
        with self._lock:
            deadlines = [
                e.last_seen + (self.forget_after_s if e.state is InstanceState.EXPIRED else self.ttl_s)
                for e in self._entries.values()
            ]
        return min(deadlines) - self._clock() if deadlines else None

    def _rebuild(self) -> None:
        # caller holds the lock
        self.version += 1
        self._all = tuple(sorted(self._entries.values(), key=lambda e: e.instance_id))
        live: dict[tuple[Role, str | None], list[InstanceView]] = {}
        pos: dict[str, list[tuple[tuple[Role, str | None] | None, int]]] = {}
        for index, entry in enumerate(self._all):
            slots: list[tuple[tuple[Role, str | None] | None, int]] = [(None, index)]
            if entry.alive:
                for key in ((entry.role, None), (entry.role, entry.info.model)):
                    bucket = live.setdefault(key, [])
                    slots.append((key, len(bucket)))
                    bucket.append(entry)
            pos[entry.instance_id] = slots
        self._live = {key: tuple(entries) for key, entries in live.items()}
        self._pos = pos

    def _swap_many(self, fresh: list[InstanceView]) -> None:
        """:meth:`_swap` for several entries with one copy of each cached tuple (a batch of 16
        refreshes makes 3 new tuples, not 48: at N = 1,000 those copies were most of a refresh's
        cost and of what the garbage collector had to look at)."""
        self.version += 1
        updates: dict[tuple[Role, str | None] | None, list[tuple[int, InstanceView]]] = {}
        for view in fresh:
            for key, index in self._pos[view.instance_id]:
                updates.setdefault(key, []).append((index, view))
        for key, items in updates.items():
            new = list(self._all if key is None else self._live[key])
            for index, view in items:
                new[index] = view
            if key is None:
                self._all = tuple(new)
            else:
                self._live[key] = tuple(new)

    def _swap(self, fresh: InstanceView) -> None:
        """Put ``fresh`` where its previous (live) version sits in every cached tuple (caller holds
        the lock; same id, role and model, so the positions hold)."""
        self.version += 1
        for key, index in self._pos[fresh.instance_id]:
            old = self._all if key is None else self._live[key]
            new = (*old[:index], fresh, *old[index + 1:])
            if key is None:
                self._all = new
            else:
                self._live[key] = new

    # --- readers (any thread; lock-free reads of immutable tuples) -------------------------------

    def snapshot(self) -> tuple[InstanceView, ...]:
        """Every known entry (alive or not), sorted by instance id."""
        return self._all

    def live(self, role: Role, model: str | None = None) -> tuple[InstanceView, ...]:
        """Instances of ``role`` (serving ``model``, when given) in routing, sorted by instance id."""
        return self._live.get((role, model), ())

    def get(self, instance_id: str) -> InstanceView | None:
        return self._entries.get(instance_id)

    def now(self) -> float:
        """The registry's clock (monotonic seconds): the time base of ``last_seen`` and ``as_of``."""
        return self._clock()

    def registered_for_s(self, view: InstanceView) -> float:
        """Seconds since this epoch of the instance first registered."""
        return max(0.0, self._clock() - view.first_seen)

    def age_s(self, view: InstanceView) -> float:
        return max(0.0, self._clock() - view.last_seen)


# --- the KV index ------------------------------------------------------------------------------------
# The router's KV index: which instance holds which prefix-cache block, from the instances' KV events.
#
# Fed by the discovery listener thread (:meth:`KvIndex.apply`), read by the event loop
# (:meth:`KvIndex.match`); one lock. Bounded: at most ``max_blocks`` distinct hashes are kept, the
# least recently stored ones dropped first (the instance probably evicted them too; a stale entry
# costs a missed hit, never a wrong answer: instances check their own cache).
#
# An instance's entries are dropped when it leaves (:meth:`drop`, called by the registry when it
# forgets or deregisters it) and replaced when it restarts (a batch of a newer epoch). Batches of an
# older epoch are ignored. Hashes are :mod:`kvwire.protocol.kv_blocks` chains; no torch.

DEFAULT_MAX_BLOCKS = 1 << 20  # hashes: ~200 MB worst case; a 2-core box's tiny clusters use far less


@dataclass
class _Holder:
    epoch: int
    block_size: int
    hashes: set[BlockHash]
    reported_blocks: int = 0  # what the instance said it holds (its own count)


class KvIndex:
    def __init__(self, max_blocks: int = DEFAULT_MAX_BLOCKS) -> None:
        if max_blocks <= 0:
            raise ValueError(f"max_blocks must be > 0, got {max_blocks}")
        self.max_blocks = max_blocks
        self._lock = threading.Lock()
        self._where: OrderedDict[BlockHash, set[str]] = OrderedDict()  # least recently stored first
        self._holders: dict[str, _Holder] = {}
        self._block_sizes: Counter[int] = Counter()  # block size -> instances using it
        self.num_dropped_blocks = 0  # hashes forgotten to stay within max_blocks

    # --- writers (discovery listener thread) ------------------------------------------------------

    def apply(self, msg: KvEvents) -> bool:
        """Apply one batch; False when it is stale (an older epoch of the instance)."""
        with self._lock:
            holder = self._holders.get(msg.instance_id)
            if holder is not None and msg.epoch < holder.epoch:
                return False
            if holder is None or msg.epoch > holder.epoch or msg.block_size != holder.block_size:
                self._drop_locked(msg.instance_id)
                holder = self._holders[msg.instance_id] = _Holder(msg.epoch, msg.block_size, set())
                self._block_sizes[msg.block_size] += 1
            elif msg.cleared:
                self._forget_all(msg.instance_id, holder)
            for h in msg.removed:
                self._forget(msg.instance_id, holder, h)
            for h in msg.stored:
                holders = self._where.get(h)
                if holders is None:
                    holders = self._where[h] = set()
                else:
                    self._where.move_to_end(h)
                holders.add(msg.instance_id)
                holder.hashes.add(h)
            holder.reported_blocks = msg.num_cached_blocks
            self._trim()
            return True

    def drop(self, instance_id: str) -> None:
        """Forget every entry of ``instance_id`` (it left)."""
        with self._lock:
            self._drop_locked(instance_id)

    def _drop_locked(self, instance_id: str) -> None:
        holder = self._holders.pop(instance_id, None)
        if holder is not None:
            self._forget_all(instance_id, holder)
            self._block_sizes[holder.block_size] -= 1
            if self._block_sizes[holder.block_size] <= 0:
                del self._block_sizes[holder.block_size]

    def _forget_all(self, instance_id: str, holder: _Holder) -> None:
        for h in list(holder.hashes):
            self._forget(instance_id, holder, h)

    def _forget(self, instance_id: str, holder: _Holder, h: BlockHash) -> None:
        holder.hashes.discard(h)
        holders = self._where.get(h)
        if holders is not None:
            holders.discard(instance_id)
            if not holders:
                del self._where[h]

    def _trim(self) -> None:
        while len(self._where) > self.max_blocks:
            h, holders = self._where.popitem(last=False)
            for instance_id in holders:
                holder = self._holders.get(instance_id)
                if holder is not None:
                    holder.hashes.discard(h)
            self.num_dropped_blocks += 1

    # --- readers (event loop) -----------------------------------------------------------------------

    def block_size(self, instance_id: str) -> int | None:
        holder = self._holders.get(instance_id)
        return None if holder is None else holder.block_size

    def num_blocks(self, instance_id: str) -> int:
        """Blocks of ``instance_id`` in the index."""
        holder = self._holders.get(instance_id)
        return 0 if holder is None else len(holder.hashes)

    def match(
        self, instance_ids: Iterable[str], hashes_for: Callable[[int], list[BlockHash]]
    ) -> dict[str, int]:
        """For each instance, how many leading blocks of the request it holds.

        ``hashes_for(block_size)`` returns the request's chained block hashes for that block size
        (instances may differ). Instances the index knows nothing about match 0 blocks.
        """
        out: dict[str, int] = {}
        cache: dict[int, list[BlockHash]] = {}
        with self._lock:
            for instance_id in instance_ids:
                holder = self._holders.get(instance_id)
                if holder is None or not holder.hashes:
                    out[instance_id] = 0
                    continue
                hashes = cache.get(holder.block_size)
                if hashes is None:
                    hashes = cache[holder.block_size] = hashes_for(holder.block_size)
                n = 0
                for h in hashes:
                    if h not in holder.hashes:
                        break
                    n += 1
                out[instance_id] = n
        return out

    def holders(self, hashes_for: Callable[[int], list[BlockHash]]) -> set[str]:
        """The instances holding the request's first block (for their block size): every instance
        :meth:`match` would give at least one block. O(block sizes in use + those instances)."""
        out: set[str] = set()
        with self._lock:
            for block_size in self._block_sizes:
                hashes = hashes_for(block_size)
                if not hashes:
                    continue
                for instance_id in self._where.get(hashes[0], ()):
                    holder = self._holders.get(instance_id)
                    if holder is not None and holder.block_size == block_size:
                        out.add(instance_id)
        return out

    def __len__(self) -> int:
        return len(self._where)
