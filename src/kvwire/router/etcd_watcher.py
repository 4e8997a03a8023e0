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
* Records that fail to decode are dropped and counted in ``dropped["malformed"]``. With a shared
  secret (``secret``), a record must be signed with it (:class:`~kvwire.discovery.etcd_gateway.
  SignedRecord`): unsigned or badly signed ones are dropped as ``dropped["unauthenticated"]``, and an
  old record written again (its ``seq`` below the last one of its instance and epoch, or a first
  record older than the freshness window plus its ``ttl_s``) as ``dropped["replayed"]``
  (:mod:`kvwire.router.freshness`, decision 125). Refusals are logged once per reason a minute.
* Credentials in the address (``etcd://USER@HOST:PORT``, decision 099): the first call
  authenticates (``/v3/auth/authenticate``) and every call and the watch carry the token; a call
  answered "invalid token" authenticates again and is retried once; a watch cancelled "permission
  denied" re-syncs with a fresh token. Credentials etcd refuses are logged as an error and kept in
  :attr:`EtcdWatcher.last_error` (and ``/health``), and retried like an unreachable etcd.
* Liveness: etcd's leases (a key lives as long as its lease), and, where faster, the records
  themselves: an instance puts its record every heartbeat interval and says in it (``ttl_s``, its
  lease TTL) when the next one is due at the latest. Each record's deadline goes into a heap
  (:mod:`kvwire.router.etcd_expiry`); an entry whose deadline passed is expired (out of routing;
  back with its next record) without waiting for etcd to notice the lease ran out (etcd checks
  every 500 ms, then commits the deletion through Raft: under load, seconds; decision 095) — once
  etcd confirms it: one read-only transaction (serializable ranges of the overdue keys, keys
  only) asks whether each key is still at the revision the router last applied. If it is (or the
  key is gone), nothing newer was written before the question was asked, so the silence is the
  instance's, whatever the watch's lag; if etcd holds a newer record the watch is behind and the
  instance stays (asked again later). Probes go out every ``PROBE_PERIOD_S`` while deadlines are
  passing (decision 098). A stalled etcd answers nothing and so expires nobody; nor does a stale
  view (every entry counts as heard from at the re-sync). Records without ``ttl_s`` (older
  instances) rely on the lease alone.
* The event loop is the router's: a watch message is decoded into structs (no dicts), applied to
  the registry in slices of at most ``APPLY_SLICE`` events with one view rebuild each, and the loop
  is yielded to between slices and messages.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from typing import Any

import aiohttp

from kvwire.discovery.address import DiscoveryAddress
from kvwire.discovery.etcd_gateway import (
    AUTHENTICATE_PATH,
    EtcdAuthError,
    EtcdError,
    EtcdTokenError,
    auth_error,
    authenticate_body,
    b64,
    check_answer,
    decode_record,
    prefix_request,
    record_key,
    token_of,
    unb64,
)
from kvwire.discovery.messages import Deregister, Heartbeat
from kvwire.errors import AuthenticationError, ProtocolError
from kvwire.refusal_log import RefusalLog
from kvwire.router.etcd_expiry import DeadlineHeap
from kvwire.router.etcd_stream import WatchEvent, watch_messages
from kvwire.router.freshness import DEFAULT_MAX_ENTRIES, DEFAULT_WINDOW_S, FreshnessGuard
from kvwire.router.registry import ApplyResult, Registry, clamp_ttl_s
from kvwire.supervision import HealthBoard, supervise_async

log = logging.getLogger(__name__)

BACKOFF_MIN_S = 0.2
BACKOFF_MAX_S = 2.0
CONNECT_TIMEOUT_S = 2.0
PROBE_PERIOD_S = 0.05  # overdue instances are asked about this often (one transaction for all due)
PROBE_MAX_IN_FLIGHT = 4  # probes awaiting etcd's answer (a hung etcd gets no more than this)
PROBE_MAX_KEYS = 128  # keys per probe (etcd's default --max-txn-ops)
PROBE_TIMEOUT_S = 1.0  # one probe's transaction
PROBE_RETRY_S = 0.2  # an instance etcd holds a newer record of (watch behind), or a failed probe
IDLE_CHECK_S = 0.5  # the expiry task's longest sleep (nothing due)
APPLY_SLICE = 16  # watch events applied between two yields of the loop (~15 µs of CPU each at N = 1,000)
SYNC_SLICE = 256  # records of a (re-)sync applied between two yields


class EtcdWatcher:
    """Start with :meth:`start` on the router's loop; :meth:`stop` cancels the task and closes HTTP."""

    def __init__(
        self, registry: Registry, target: DiscoveryAddress, *, board: HealthBoard | None = None,
        secret: bytes | None = None, freshness_window_s: float = DEFAULT_WINDOW_S,
        freshness_max_entries: int = DEFAULT_MAX_ENTRIES,
    ) -> None:
        self._registry = registry
        self._record_key = record_key(secret) if secret else None  # records must be signed with it
        # a re-sync reads the same records again: the same seq is not a replay here
        self.freshness = FreshnessGuard(freshness_window_s, max_entries=freshness_max_entries,
                                        allow_repeat=True) if secret else None
        self._refusals = RefusalLog(log, "etcd record")
        self._board = board  # the watch and the expiry tasks are supervised there (router /health)
        self.target = target
        self._url = target.address
        self._epochs: dict[str, int] = {}  # instance id -> epoch of the record seen last
        self._task: asyncio.Task[None] | None = None
        self._expiry: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None
        self.received: collections.Counter[str] = collections.Counter()  # by ApplyResult value
        self.dropped: collections.Counter[str] = collections.Counter()  # by reason
        self.synced = asyncio.Event()  # set after the first successful sync
        self.stale = True  # the view is not (yet / any longer) backed by a live watch
        self.stale_since = time.monotonic()
        self.resyncs = 0
        self.revision = 0  # the newest change the watch has delivered
        self.last_error = ""  # why the view is stale ("" while the watch runs)
        self._token: str | None = None  # etcd auth token (None: none yet; "": etcd's auth is off)
        self._deadlines = DeadlineHeap()  # instance id -> when its promised next record is overdue
        self._revisions: dict[str, int] = {}  # instance id -> mod revision of its record applied last
        self._probes: set[asyncio.Task[None]] = set()
        # overdue instances asked about: expired (confirmed silent), behind (etcd holds a newer
        # record than the watch delivered), failed (no answer)
        self.probes: collections.Counter[str] = collections.Counter()

    @property
    def address(self) -> str:
        return str(self.target)

    async def start(self) -> None:
        timeout = aiohttp.ClientTimeout(total=None, connect=CONNECT_TIMEOUT_S, sock_connect=CONNECT_TIMEOUT_S)
        ssl_context = self.target.ssl_context()  # https: verified against the address's CA
        connector = aiohttp.TCPConnector(ssl=ssl_context if ssl_context is not None else True)
        self._session = aiohttp.ClientSession(timeout=timeout, connector=connector)
        self._task = asyncio.create_task(
            supervise_async("kvwire-etcd-watch", self._run, board=self._board), name="kvwire-etcd-watch")
        self._expiry = asyncio.create_task(
            supervise_async("kvwire-etcd-expiry", self._expire_silent, board=self._board),
            name="kvwire-etcd-expiry")

    async def stop(self) -> None:
        for task in (self._task, self._expiry, *self._probes):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if self._session is not None:
            await self._session.close()

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
                    self._token = None  # the next attempt authenticates afresh
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

    async def _expire_silent(self) -> None:
        """Sleep until the earliest deadline; while deadlines pass, probe every PROBE_PERIOD_S
        (:meth:`_probe` expires what etcd confirms silent)."""
        while True:
            try:
                delay = self._expiry_step()
            except Exception:  # never let expiry die: liveness depends on it
                log.exception("expiring silent etcd records failed")
                delay = IDLE_CHECK_S
            await asyncio.sleep(delay)

    def _expiry_step(self) -> float:
        """Ask etcd about the instances whose deadline passed; how long to sleep until the next step."""
        if self.stale:
            return PROBE_PERIOD_S
        earliest = self._deadlines.earliest()
        now = self._registry.now()
        if earliest is None or earliest > now:
            return IDLE_CHECK_S if earliest is None else min(IDLE_CHECK_S, earliest - now + 0.001)
        if len(self._probes) < PROBE_MAX_IN_FLIGHT:
            due = self._deadlines.pop_before(now, PROBE_MAX_KEYS)
            asked = {ident: self._revisions.get(ident, 0) for ident in due}
            task = asyncio.create_task(self._probe(now, asked), name="kvwire-etcd-probe")
            self._probes.add(task)
            task.add_done_callback(self._probe_done)
        return PROBE_PERIOD_S

    async def _probe(self, sent_at: float, asked: dict[str, int]) -> None:
        """Is each of ``asked`` (instance id -> revision of the record the router applied last)
        still at that revision in etcd? One read-only transaction of serializable ranges (answered
        from the member's own state, like the watch; keys only). Still there, or gone: no record
        was written after it before ``sent_at``, so the instance is expired as of then. Newer:
        the watch is behind; asked again PROBE_RETRY_S later if no newer record arrives."""
        prefix = self.target.prefix
        idents = list(asked)
        ops = [{"request_range": {"key": b64(prefix + ident), "keys_only": True, "serializable": True}}
               for ident in idents]
        try:
            data = await self._post("/v3/kv/txn", {"success": ops}, timeout_s=PROBE_TIMEOUT_S)
        except (aiohttp.ClientError, asyncio.TimeoutError, EtcdError, ValueError):
            self.probes["failed"] += len(idents)
            self._recheck(idents, sent_at + PROBE_RETRY_S)
            return
        answers = data.get("responses", [])
        silent: list[str] = []
        behind: list[str] = []
        for ident, answer in zip(idents, answers, strict=False):
            kvs = answer.get("response_range", {}).get("kvs", [])
            revision = int(kvs[0].get("mod_revision", 0)) if kvs else 0
            (behind if revision > asked[ident] else silent).append(ident)
        behind.extend(idents[len(answers):])
        if self.stale:
            return
        self.probes["behind"] += len(behind)
        self._recheck(behind, sent_at + PROBE_RETRY_S)
        # an instance whose newer record arrived meanwhile has a later deadline: expire() leaves it
        self.probes["expired"] += len(self._registry.expire(silent, sent_at))

    def _probe_done(self, task: asyncio.Task[None]) -> None:
        """A one-shot probe ended; one that raised (an etcd answer of an unexpected shape) is logged
        and counted (``probes["failed"]``, ``kvwire_thread_errors_total``), never silent."""
        self._probes.discard(task)
        if task.cancelled() or task.exception() is None:
            return
        self.probes["failed"] += 1
        log.error("etcd expiry probe failed", exc_info=task.exception())
        if self._board is not None:
            self._board.worker_error("kvwire-etcd-probe")

    def _recheck(self, idents: list[str], at: float) -> None:
        """Ask about ``idents`` again at ``at``, unless a newer record set their deadline meanwhile."""
        for ident in idents:
            if ident in self._epochs and ident not in self._deadlines:
                view = self._registry.get(ident)
                if view is not None and view.alive and view.ttl_s > 0:
                    self._deadlines.set(ident, at)

    def _mark_stale(self) -> None:
        if not self.stale:
            self.stale, self.stale_since = True, time.monotonic()

    async def _post(self, path: str, body: dict[str, Any], timeout_s: float = 5.0) -> dict[str, Any]:
        """One gateway call; with credentials, authenticated (again, once, if etcd dropped the token)."""
        auth = self.target.auth
        if auth is not None and self._token is None:
            await self._authenticate(timeout_s)
        try:
            return await self._post_once(path, body, timeout_s)
        except EtcdTokenError:
            if auth is None:
                raise
            await self._authenticate(timeout_s)
            return await self._post_once(path, body, timeout_s)

    async def _post_once(self, path: str, body: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        assert self._session is not None
        request_timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with self._session.post(self._url + path, json=body, timeout=request_timeout,
                                      headers=self._headers()) as resp:
            return check_answer(path, resp.status, await resp.read())

    async def _authenticate(self, timeout_s: float) -> None:
        """A token for the address's user (:class:`EtcdAuthError` when etcd refuses it)."""
        assert self._session is not None and self.target.auth is not None
        self._token = None
        request_timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with self._session.post(self._url + AUTHENTICATE_PATH, json=authenticate_body(self.target.auth),
                                      timeout=request_timeout) as resp:
            self._token = token_of(self.target.auth, self._url, resp.status, await resp.read())

    def _headers(self) -> dict[str, str]:
        return {"Authorization": self._token} if self._token else {}

    async def _sync(self) -> int:
        """Read every record; make the registry match; return the revision to watch from."""
        data = await self._post("/v3/kv/range", prefix_request(self.target.prefix))
        revision = int(data["header"]["revision"])
        records = [record for kv in data.get("kvs", []) if (record := self._on_put(kv)) is not None]
        for start in range(0, len(records), SYNC_SLICE):  # one view rebuild per slice, not per record
            self._apply_batch(list(records[start:start + SYNC_SLICE]))
            await asyncio.sleep(0)
        present = {record.info.instance_id for record in records}
        for ident in set(self._epochs) - present:
            self._on_delete(ident)
        self.revision = revision
        if self.stale:
            log.info("etcd at %s synced: %d instances at revision %d", self.address, len(present), revision)
            self._registry.touch_all()  # silence while etcd was unreachable was not the instances'
            for view in self._registry.snapshot():
                if view.alive and view.ttl_s > 0 and view.instance_id in self._epochs:
                    self._deadlines.set(view.instance_id, view.last_seen + view.ttl_s)
        self.stale = False
        self.last_error = ""
        self.resyncs += 1
        self.synced.set()
        return revision + 1

    async def _watch(self, start_revision: int) -> None:
        assert self._session is not None
        request = {**prefix_request(self.target.prefix), "start_revision": str(start_revision)}
        create = {"create_request": request}
        async with self._session.post(self._url + "/v3/watch", json=create, headers=self._headers()) as resp:
            if resp.status != 200:
                check_answer("/v3/watch", resp.status, await resp.read())
            async for message in watch_messages(resp.content):
                result = message.result
                if result is None:
                    raise EtcdError(f"etcd watch error: {message.error}")
                if result.canceled:  # "permission denied": the user may not read the prefix, or
                    # its token expired before the watch was made (both: authenticate again)
                    raise auth_error("/v3/watch", f"cancelled: {result.cancel_reason or 'no reason given'}")
                events = result.events
                for start in range(0, len(events), APPLY_SLICE):
                    self._apply_events(events[start:start + APPLY_SLICE])
                    # aiohttp hands over buffered data without suspending: behind a backlog this
                    # loop would never let the rest of the router (requests, expiry) run
                    await asyncio.sleep(0)
                if not events:
                    await asyncio.sleep(0)

    def _apply_events(self, events: list[WatchEvent]) -> None:
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
                    self._apply_batch(batch)
                    batch, in_batch = [], set()
                    if isinstance(msg, Deregister):  # its epoch may have moved; a record is decoded
                        msg = self._event_message(event.type, kv.key, kv.value)  # once (freshness)
                if msg is not None:
                    batch.append(msg)
                    in_batch.add(ident)
            # the newest change delivered (not the header's: a catching-up watch's first answer
            # carries the store's revision before the events that lead to it)
            self.revision = max(self.revision, kv.mod_revision)
        self._apply_batch(batch)

    def _note_revision(self, key: bytes, revision: int, *, deleted: bool) -> None:
        """The newest revision of an instance's key the router has seen (what a probe compares)."""
        ident = key.decode(errors="replace").removeprefix(self.target.prefix)
        if deleted:
            self._revisions.pop(ident, None)
        else:
            self._revisions[ident] = revision

    def _event_message(self, kind: str, key: bytes, value: bytes) -> Heartbeat | Deregister | None:
        if kind == "DELETE":
            ident = key.decode(errors="replace").removeprefix(self.target.prefix)
            epoch = self._epochs.get(ident)
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

    def _apply_batch(self, batch: list[Heartbeat | Deregister]) -> None:
        if not batch:
            return
        results = self._registry.apply_many(batch)
        for msg, result in zip(batch, results, strict=True):
            self.received[result.value] += 1
            if isinstance(msg, Deregister):
                if result is ApplyResult.DEREGISTERED:
                    self._epochs.pop(msg.instance_id, None)
                    self._deadlines.discard(msg.instance_id)
            elif result not in (ApplyResult.STALE, ApplyResult.REFUSED):
                self._note_record(msg)

    def _note_record(self, record: Heartbeat) -> None:
        ident = record.info.instance_id
        self._epochs[ident] = record.info.epoch
        view = self._registry.get(ident)
        if view is not None and view.ttl_s > 0:
            self._deadlines.set(ident, view.last_seen + view.ttl_s)
        else:
            self._deadlines.discard(ident)

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
        epoch = self._epochs.pop(ident, None)
        self._deadlines.discard(ident)
        self._revisions.pop(ident, None)
        if epoch is None:
            return
        if self.freshness is not None:
            self.freshness.seal(ident, epoch)
        result = self._registry.apply(Deregister(instance_id=ident, epoch=epoch, sent_at=time.time()))
        self.received[result.value] += 1
