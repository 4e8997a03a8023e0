"""Freshness of signed discovery messages: a captured heartbeat replayed later is refused (decision 125).

A signature proves who wrote a message, not when. Every discovery message an instance sends (heartbeat,
KV events, deregistration; an etcd record) carries its process's ``epoch`` and a ``seq`` that grows by
one per message of that epoch, and its wall clock ``sent_at``. The router keeps, per
``(instance id, epoch)``, the highest ``seq`` it accepted and refuses anything at or below it; a pair
it does not know (a new process, a router just started, a pair forgotten) is accepted only when
``sent_at`` is within ``max_age_s`` of the router's clock (either way: clocks may disagree by that
much). A pair is forgotten once its newest ``sent_at`` is older than its ``max_age_s``: any replay of
it is then older still and fails the window. So a replay is refused whether the victim is alive,
deregistered, forgotten by the registry, or the router restarted — except within ``max_age_s`` of
the capture after a router restart (the router knows no ``seq`` then), which replays only a genuine,
recent message of that instance.

etcd records are state, re-read at every re-sync: the same record again is not a replay there
(``allow_repeat``) until the record is deleted (:meth:`FreshnessGuard.seal`: the same record put
back after its lease ended is one). A record is legitimately as old as its promise (``ttl_s``) plus
the window; a record that promises nothing (``ttl_s`` 0: an instance writing less often than its
lease) has no time bound, only the ``seq`` check and etcd's own access control (decision 125).

Used only with a shared secret (without one anybody can forge a message, so replaying one proves
nothing). One thread at a time (the listener's thread, or the etcd watcher's event loop); at most
``max_entries`` pairs are remembered (the least recently heard from are forgotten first, counted in
:attr:`FreshnessGuard.evicted`).
"""

from __future__ import annotations

import collections
import math
import time
from collections.abc import Callable

from kvwire.errors import ConfigError

DEFAULT_WINDOW_S = 30.0  # clock skew between hosts + a heartbeat queued while a router restarts
DEFAULT_MAX_ENTRIES = 100_000


class FreshnessGuard:
    """Per ``(instance id, epoch)``: the highest ``seq`` accepted, and until when to remember it."""

    def __init__(self, window_s: float = DEFAULT_WINDOW_S, *, max_entries: int = DEFAULT_MAX_ENTRIES,
                 allow_repeat: bool = False, clock: Callable[[], float] = time.time) -> None:
        if not 0 < window_s < math.inf:
            raise ConfigError(f"discovery freshness window must be > 0 and finite, got {window_s}")
        if max_entries <= 0:
            raise ConfigError(f"max_entries must be > 0, got {max_entries}")
        self.window_s = window_s
        self.max_entries = max_entries
        self._allow_repeat = allow_repeat
        self._clock = clock
        # (instance id, epoch) -> (highest seq accepted, forget after this wall-clock time, that seq
        # may come again: allow_repeat and not sealed since)
        self._seen: collections.OrderedDict[tuple[str, int], tuple[int, float, bool]] = (
            collections.OrderedDict())
        self.evicted = 0  # pairs forgotten early because max_entries were remembered

    def __len__(self) -> int:
        return len(self._seen)

    def check(self, instance_id: str, epoch: int, seq: int, sent_at: float,
              max_age_s: float | None) -> str | None:
        """None (and the message is remembered) when fresh, else why it is refused. ``max_age_s``:
        how far from the router's clock a message of an unknown pair may be sent (the ZeroMQ
        listener: :attr:`window_s`; None: no time bound)."""
        now = self._clock()
        self._forget_expired(now)
        key = (instance_id, epoch)
        known = self._seen.get(key)
        if known is not None:
            last_seq, _, repeat_ok = known
            if seq < last_seq or (seq == last_seq and not repeat_ok):
                return f"seq {seq} of {instance_id[:100]!r} epoch {epoch} is not after {last_seq}"
        elif max_age_s is not None and not abs(now - sent_at) <= max_age_s:  # NaN fails too
            return (f"first message of {instance_id[:100]!r} epoch {epoch} sent {now - sent_at:.1f} s "
                    f"from the router's clock (window {max_age_s:.1f} s; check NTP)")
        forget = math.inf if max_age_s is None else max(sent_at, now) + max_age_s
        if known is not None:
            forget = max(forget, known[1])
        self._seen[key] = (max(seq, known[0]) if known is not None else seq, forget, self._allow_repeat)
        self._seen.move_to_end(key)
        while len(self._seen) > self.max_entries:
            self._seen.popitem(last=False)
            self.evicted += 1
        return None

    def seal(self, instance_id: str, epoch: int) -> None:
        """The pair's record is gone (etcd deleted it): from now on only a higher ``seq`` is fresh."""
        known = self._seen.get((instance_id, epoch))
        if known is not None:
            self._seen[(instance_id, epoch)] = (known[0], known[1], False)

    def _forget_expired(self, now: float) -> None:
        while self._seen:
            _, (_, forget_at, _) = next(iter(self._seen.items()))
            if forget_at >= now:
                return
            self._seen.popitem(last=False)
