"""Router side of etcd discovery: the registry kept from a range read + a watch on the prefix.

Runs as one task on the router's event loop (aiohttp against etcd's JSON gateway; no gRPC, no torch).

Contract:
* Sync: ``range`` the prefix (every record, and the store revision R); apply each record to the
  :class:`~kvwire.router.registry.Registry` as a heartbeat and deregister every instance this
  watcher knew that is no longer there; then watch from R + 1. PUT events are applied as
  heartbeats (new instance, restart with a newer epoch, load update); DELETE events (lease expired:
  kill -9, SIGSTOP, host gone; or revoked: graceful shutdown) deregister that instance at once.
* Connection to etcd lost (stream ends, refused, error): the registry is left as it is, so the
  router keeps routing on its last view, and :attr:`EtcdWatcher.stale` is true (shown per instance
  in ``/instances`` and as ``kvwire_router_discovery_stale``) until a sync succeeds again. Retries
  back off from 0.2 s to 2 s. A watch cancelled by compaction re-syncs the same way.
* Records are decoded, verified and applied by :class:`~kvwire.router.etcd_records.EtcdRecords`
  (malformed, unauthenticated and replayed ones dropped and counted, decision 125).
* Credentials in the address (``etcd://USER@HOST:PORT``, decision 099): calls and the watch are
  authenticated by :class:`~kvwire.router.etcd_client.EtcdClient`; a watch cancelled "permission
  denied" re-syncs with a fresh token. Credentials etcd refuses are logged as an error and kept in
  :attr:`EtcdWatcher.last_error` (and ``/health``), and retried like an unreachable etcd.
* Liveness: etcd's leases (a key lives as long as its lease), and, where faster, the records
  own deadlines: :class:`~kvwire.router.etcd_probe.SilenceProbe` expires an instance whose next
  record is overdue once etcd confirms that nothing newer was written (decisions 095 and 098).
* The event loop is the router's: a watch message is decoded into structs (no dicts), applied to
  the registry in slices of at most ``APPLY_SLICE`` events with one view rebuild each, and the loop
  is yielded to between slices and messages.
"""

from __future__ import annotations

import asyncio
import logging
import time

import aiohttp

from kvwire.discovery.address import DiscoveryAddress
from kvwire.discovery.etcd_gateway import (
    EtcdAuthError,
    EtcdError,
    EtcdTokenError,
    auth_error,
    check_answer,
    prefix_request,
)
from kvwire.router.etcd_client import WATCH_PATH, EtcdClient
from kvwire.router.etcd_probe import SilenceProbe
from kvwire.router.etcd_records import EtcdRecords
from kvwire.router.etcd_stream import watch_messages
from kvwire.router.freshness import DEFAULT_MAX_ENTRIES, DEFAULT_WINDOW_S
from kvwire.router.registry import Registry
from kvwire.supervision import HealthBoard, supervise_async

log = logging.getLogger(__name__)

BACKOFF_MIN_S = 0.2
BACKOFF_MAX_S = 2.0
APPLY_SLICE = 16  # watch events applied between two yields of the loop (~15 µs of CPU each at N = 1,000)
SYNC_SLICE = 256  # records of a (re-)sync applied between two yields


class EtcdWatcher:
    """Start with :meth:`start` on the router's loop; :meth:`stop` cancels the tasks and closes HTTP."""

    def __init__(
        self, registry: Registry, target: DiscoveryAddress, *, board: HealthBoard | None = None,
        secret: bytes | None = None, freshness_window_s: float = DEFAULT_WINDOW_S,
        freshness_max_entries: int = DEFAULT_MAX_ENTRIES,
    ) -> None:
        self._registry = registry
        self._board = board  # the watch and the expiry tasks are supervised there (router /health)
        self.target = target
        self.client = EtcdClient(target)
        self.records = EtcdRecords(registry, target.prefix, secret=secret,
                                   freshness_window_s=freshness_window_s,
                                   freshness_max_entries=freshness_max_entries)
        self.expiry = SilenceProbe(registry, self.records, self.client, lambda: self.stale, board)
        self.freshness = self.records.freshness
        self.received = self.records.received  # by ApplyResult value
        self.dropped = self.records.dropped  # by reason
        self.probes = self.expiry.counts  # overdue instances asked about, by answer
        self._task: asyncio.Task[None] | None = None
        self._expiry: asyncio.Task[None] | None = None
        self.synced = asyncio.Event()  # set after the first successful sync
        self.stale = True  # the view is not (yet / any longer) backed by a live watch
        self.stale_since = time.monotonic()
        self.resyncs = 0
        self.last_error = ""  # why the view is stale ("" while the watch runs)

    @property
    def address(self) -> str:
        return str(self.target)

    @property
    def revision(self) -> int:
        """The newest change the watch has delivered."""
        return self.records.revision

    async def start(self) -> None:
        self.client.open()
        self._task = asyncio.create_task(
            supervise_async("kvwire-etcd-watch", self._run, board=self._board), name="kvwire-etcd-watch")
        self._expiry = asyncio.create_task(
            supervise_async("kvwire-etcd-expiry", self.expiry.run, board=self._board),
            name="kvwire-etcd-expiry")

    async def stop(self) -> None:
        for task in (self._task, self._expiry):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        await self.expiry.stop()
        await self.client.close()

    async def _run(self) -> None:
        """Sync and watch until cancelled; an etcd outage is retried here (the view goes stale), any
        other exception marks the view stale and goes to the supervisor (restart with backoff)."""
        backoff = BACKOFF_MIN_S
        while True:
            try:
                start_revision = await self._sync()
                backoff = BACKOFF_MIN_S
                await self._watch(start_revision)
                log.warning("etcd watch on %s ended; re-syncing", self.address)
            except (aiohttp.ClientError, asyncio.TimeoutError, EtcdError, ValueError) as exc:
                if isinstance(exc, (EtcdAuthError, EtcdTokenError)):
                    self.client.token = None  # the next attempt authenticates afresh
                if isinstance(exc, EtcdAuthError) and str(exc) != self.last_error:
                    log.error("etcd at %s refused this router (retrying; routing on the last view): %s",
                              self.address, exc)
                elif not self.stale:
                    log.warning("etcd at %s lost (%s); routing on the last view", self.address, exc)
                self.last_error = str(exc) or type(exc).__name__
            except Exception as exc:
                self._mark_stale()
                self.last_error = f"{type(exc).__name__}: {exc}"
                raise
            self._mark_stale()
            await asyncio.sleep(backoff)
            backoff = min(2 * backoff, BACKOFF_MAX_S)

    def _mark_stale(self) -> None:
        if not self.stale:
            self.stale, self.stale_since = True, time.monotonic()

    async def _sync(self) -> int:
        """Read every record; make the registry match; return the revision to watch from."""
        data = await self.client.post("/v3/kv/range", prefix_request(self.target.prefix))
        revision = int(data["header"]["revision"])
        records = self.records.from_range(data.get("kvs", []))
        for start in range(0, len(records), SYNC_SLICE):  # one view rebuild per slice, not per record
            self.records.apply_batch(list(records[start:start + SYNC_SLICE]))
            await asyncio.sleep(0)
        present = {record.info.instance_id for record in records}
        self.records.forget_missing(present)
        self.records.revision = revision
        if self.stale:
            log.info("etcd at %s synced: %d instances at revision %d", self.address, len(present), revision)
            self.records.rearm_deadlines()  # silence while etcd was unreachable was not the instances'
        self.stale = False
        self.last_error = ""
        self.resyncs += 1
        self.synced.set()
        return revision + 1

    async def _watch(self, start_revision: int) -> None:
        request = {**prefix_request(self.target.prefix), "start_revision": str(start_revision)}
        async with self.client.watch({"create_request": request}) as resp:
            if resp.status != 200:
                check_answer(WATCH_PATH, resp.status, await resp.read())
            async for message in watch_messages(resp.content):
                result = message.result
                if result is None:
                    raise EtcdError(f"etcd watch error: {message.error}")
                if result.canceled:  # "permission denied": the user may not read the prefix, or
                    # its token expired before the watch was made (both: authenticate again)
                    raise auth_error(WATCH_PATH, f"cancelled: {result.cancel_reason or 'no reason given'}")
                events = result.events
                for start in range(0, len(events), APPLY_SLICE):
                    self.records.apply_events(events[start:start + APPLY_SLICE])
                    # aiohttp hands over buffered data without suspending: behind a backlog this
                    # loop would never let the rest of the router (requests, expiry) run
                    await asyncio.sleep(0)
                if not events:
                    await asyncio.sleep(0)
