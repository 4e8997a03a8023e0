"""Expiring silent etcd records without waiting for their lease (decisions 095 and 098).

An instance puts its record every heartbeat interval and says in it (``ttl_s``, its lease TTL) when
the next one is due at the latest. Each record's deadline goes into a heap
(:mod:`kvwire.router.etcd_expiry`); an entry whose deadline passed is expired (out of routing; back
with its next record) without waiting for etcd to notice the lease ran out (etcd checks every
500 ms, then commits the deletion through Raft: under load, seconds) — once etcd confirms it: one
read-only transaction (serializable ranges of the overdue keys, keys only) asks whether each key is
still at the revision the router last applied. If it is (or the key is gone), nothing newer was
written before the question was asked, so the silence is the instance's, whatever the watch's lag;
if etcd holds a newer record the watch is behind and the instance stays (asked again later). Probes
go out every ``PROBE_PERIOD_S`` while deadlines are passing. A stalled etcd answers nothing and so
expires nobody; nor does a stale view (every entry counts as heard from at the re-sync). Records
without ``ttl_s`` (older instances) rely on the lease alone.

One supervised task on the router's loop (:meth:`SilenceProbe.run`), plus at most
``PROBE_MAX_IN_FLIGHT`` one-shot probe tasks; :meth:`SilenceProbe.stop` cancels them.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable

import aiohttp

from kvwire.discovery.etcd_gateway import EtcdError, b64
from kvwire.router.etcd_client import EtcdClient
from kvwire.router.etcd_records import EtcdRecords
from kvwire.router.registry import Registry
from kvwire.supervision import HealthBoard

log = logging.getLogger(__name__)

PROBE_PERIOD_S = 0.05  # overdue instances are asked about this often (one transaction for all due)
PROBE_MAX_IN_FLIGHT = 4  # probes awaiting etcd's answer (a hung etcd gets no more than this)
PROBE_MAX_KEYS = 128  # keys per probe (etcd's default --max-txn-ops)
PROBE_TIMEOUT_S = 1.0  # one probe's transaction
PROBE_RETRY_S = 0.2  # an instance etcd holds a newer record of (watch behind), or a failed probe
IDLE_CHECK_S = 0.5  # the expiry task's longest sleep (nothing due)


class SilenceProbe:
    """``stale()`` tells whether the view is backed by a live watch (nothing expires while it is not)."""

    def __init__(
        self, registry: Registry, records: EtcdRecords, client: EtcdClient, stale: Callable[[], bool],
        board: HealthBoard | None,
    ) -> None:
        self._registry = registry
        self._records = records
        self._client = client
        self._stale = stale
        self._board = board
        self.in_flight: set[asyncio.Task[None]] = set()
        # overdue instances asked about: expired (confirmed silent), behind (etcd holds a newer
        # record than the watch delivered), failed (no answer)
        self.counts: collections.Counter[str] = collections.Counter()

    async def run(self) -> None:
        """Sleep until the earliest deadline; while deadlines pass, probe every PROBE_PERIOD_S
        (:meth:`_probe` expires what etcd confirms silent)."""
        while True:
            try:
                delay = self.step()
            except Exception:  # never let expiry die: liveness depends on it
                log.exception("expiring silent etcd records failed")
                delay = IDLE_CHECK_S
            await asyncio.sleep(delay)

    async def stop(self) -> None:
        for task in list(self.in_flight):
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    def step(self) -> float:
        """Ask etcd about the instances whose deadline passed; how long to sleep until the next step."""
        if self._stale():
            return PROBE_PERIOD_S
        earliest = self._records.deadlines.earliest()
        now = self._registry.now()
        if earliest is None or earliest > now:
            return IDLE_CHECK_S if earliest is None else min(IDLE_CHECK_S, earliest - now + 0.001)
        if len(self.in_flight) < PROBE_MAX_IN_FLIGHT:
            asked = self._records.due(now, PROBE_MAX_KEYS)
            task = asyncio.create_task(self._probe(now, asked), name="kvwire-etcd-probe")
            self.in_flight.add(task)
            task.add_done_callback(self.probe_done)
        return PROBE_PERIOD_S

    async def _probe(self, sent_at: float, asked: dict[str, int]) -> None:
        """Is each of ``asked`` (instance id -> revision of the record the router applied last)
        still at that revision in etcd? One read-only transaction of serializable ranges (answered
        from the member's own state, like the watch; keys only). Still there, or gone: no record
        was written after it before ``sent_at``, so the instance is expired as of then. Newer:
        the watch is behind; asked again PROBE_RETRY_S later if no newer record arrives."""
        prefix = self._client.target.prefix
        idents = list(asked)
        ops = [{"request_range": {"key": b64(prefix + ident), "keys_only": True, "serializable": True}}
               for ident in idents]
        try:
            data = await self._client.post("/v3/kv/txn", {"success": ops}, timeout_s=PROBE_TIMEOUT_S)
        except (aiohttp.ClientError, asyncio.TimeoutError, EtcdError, ValueError):
            self.counts["failed"] += len(idents)
            self._records.recheck(idents, sent_at + PROBE_RETRY_S)
            return
        answers = data.get("responses", [])
        silent: list[str] = []
        behind: list[str] = []
        for ident, answer in zip(idents, answers, strict=False):
            kvs = answer.get("response_range", {}).get("kvs", [])
            revision = int(kvs[0].get("mod_revision", 0)) if kvs else 0
            (behind if revision > asked[ident] else silent).append(ident)
        behind.extend(idents[len(answers):])
        if self._stale():
            return
        self.counts["behind"] += len(behind)
        self._records.recheck(behind, sent_at + PROBE_RETRY_S)
        # an instance whose newer record arrived meanwhile has a later deadline: expire() leaves it
        self.counts["expired"] += len(self._registry.expire(silent, sent_at))

    def probe_done(self, task: asyncio.Task[None]) -> None:
        """A one-shot probe ended; one that raised (an etcd answer of an unexpected shape) is logged
        and counted (``counts["failed"]``, ``kvwire_thread_errors_total``), never silent."""
        self.in_flight.discard(task)
        if task.cancelled() or task.exception() is None:
            return
        self.counts["failed"] += 1
        log.error("etcd expiry probe failed", exc_info=task.exception())
        if self._board is not None:
            self._board.worker_error("kvwire-etcd-probe")
