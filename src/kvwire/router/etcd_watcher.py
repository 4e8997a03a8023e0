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
* Records that fail to decode are dropped and counted in ``dropped["malformed"]``.
* Liveness: etcd's leases (a key lives as long as its lease), and, where faster, the records
  themselves: an instance puts its record every heartbeat interval and says in it (``ttl_s``, its
  lease TTL) when the next one is due at the latest. An entry silent past that is expired here at
  once (out of routing; back with its next record), without waiting for etcd to notice the lease
  ran out (etcd checks every 500 ms, then commits the deletion through Raft: under load, seconds;
  decision 095). Only once the watch is shown current (it delivers, within 1 s, the newest change
  etcd reports under the prefix: one small range request, made while someone is overdue), so a
  watch that fell behind or stalled expires nobody; and not at all while :attr:`EtcdWatcher.stale`
  (every entry counts as heard from at the re-sync). Records without ``ttl_s`` (older instances)
  rely on the lease alone.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import msgspec

from kvwire.discovery.address import DiscoveryAddress
from kvwire.discovery.etcd_gateway import EtcdError, check_answer, decode_record, prefix_request, unb64
from kvwire.discovery.messages import Deregister, Heartbeat
from kvwire.errors import ProtocolError
from kvwire.router.registry import ApplyResult, Registry

log = logging.getLogger(__name__)

BACKOFF_MIN_S = 0.2
BACKOFF_MAX_S = 2.0
CONNECT_TIMEOUT_S = 2.0
EXPIRY_PERIOD_S = 0.1  # how often silent records are looked for (O(N) each: ~0.3 ms at N = 1,000)
PROBE_TIMEOUT_S = 1.0  # asking etcd whether a quiet watch is current
PROBE_BACKOFF_S = 0.2  # after "the watch is behind", before asking again
PROBE_CATCHUP_S = 1.0  # how long the watch may take to deliver what etcd said was newest


class EtcdWatcher:
    """Start with :meth:`start` on the router's loop; :meth:`stop` cancels the task and closes HTTP."""

    def __init__(self, registry: Registry, target: DiscoveryAddress) -> None:
        self._registry = registry
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
        self.probes: collections.Counter[str] = collections.Counter()  # watch checks: current/behind/failed
        self._next_probe = 0.0  # registry clock
        self.revision = 0

    @property
    def address(self) -> str:
        return str(self.target)

    async def start(self) -> None:
        timeout = aiohttp.ClientTimeout(total=None, connect=CONNECT_TIMEOUT_S, sock_connect=CONNECT_TIMEOUT_S)
        ssl_context = self.target.ssl_context()  # https: verified against the address's CA
        connector = aiohttp.TCPConnector(ssl=ssl_context if ssl_context is not None else True)
        self._session = aiohttp.ClientSession(timeout=timeout, connector=connector)
        self._task = asyncio.create_task(self._run(), name="kvwire-etcd-watch")
        self._expiry = asyncio.create_task(self._expire_silent(), name="kvwire-etcd-expiry")

    async def stop(self) -> None:
        for task in (self._task, self._expiry):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if self._session is not None:
            await self._session.close()

    async def _run(self) -> None:
        backoff = BACKOFF_MIN_S
        while True:
            try:
                start_revision = await self._sync()
                backoff = BACKOFF_MIN_S
                await self._watch(start_revision)
                log.warning("etcd watch on %s ended; re-syncing", self.address)
            except (aiohttp.ClientError, asyncio.TimeoutError, EtcdError, ValueError) as exc:
                if not self.stale:
                    log.warning("etcd at %s lost (%s); routing on the last view", self.address, exc)
            self._mark_stale()
            await asyncio.sleep(backoff)
            backoff = min(2 * backoff, BACKOFF_MAX_S)

    async def _expire_silent(self) -> None:
        while True:
            await asyncio.sleep(EXPIRY_PERIOD_S)
            if self.stale:
                continue
            try:
                now = self._registry.now()
                # someone's record is overdue: really silent, or a watch that fell behind or stalled?
                if now < self._next_probe or not self._registry.overdue(now, promised_only=True):
                    continue
                if await self._watch_was_current():
                    self._registry.sweep(promised_only=True, as_of=now)
                else:  # behind or stalled: asking again at once would only add to etcd's load
                    self._next_probe = now + PROBE_BACKOFF_S
            except Exception:  # never let expiry die: liveness depends on it
                log.exception("expiring silent etcd records failed")

    async def _watch_was_current(self) -> bool:
        """True when the watch has delivered every change under the prefix made before this call:
        the silence the registry sees is then the instances', not a watch that is behind (a router
        short of CPU) or stalled (etcd hung with the connection open). One range request (the most
        recently modified key under the prefix, keys only), then up to PROBE_CATCHUP_S for the
        watch to deliver that revision: with instances writing all the time there is always a
        newer change in flight, so "nothing newer than the watch has" would almost never hold.
        Made only while some record is overdue, at most every EXPIRY_PERIOD_S (PROBE_BACKOFF_S
        after a False)."""
        # serializable: answered from the member's own state, like the watch (a linearizable read
        # waits for a Raft round and for the member's apply to catch up: seconds when etcd is busy)
        body = {**prefix_request(self.target.prefix), "limit": 1, "sort_order": "DESCEND",
                "sort_target": "MOD", "keys_only": True, "serializable": True}
        try:
            data = await self._post("/v3/kv/range", body, timeout_s=PROBE_TIMEOUT_S)
        except (aiohttp.ClientError, asyncio.TimeoutError, EtcdError, ValueError):
            self.probes["failed"] += 1
            return False
        newest = max((int(kv.get("mod_revision", 0)) for kv in data.get("kvs", [])), default=0)
        deadline = time.monotonic() + PROBE_CATCHUP_S
        while self.revision < newest:
            if time.monotonic() > deadline or self.stale:
                self.probes["behind"] += 1
                return False
            await asyncio.sleep(0.01)
        self.probes["current"] += 1
        return True

    def _mark_stale(self) -> None:
        if not self.stale:
            self.stale, self.stale_since = True, time.monotonic()

    async def _post(self, path: str, body: dict[str, Any], timeout_s: float = 5.0) -> dict[str, Any]:
        assert self._session is not None
        request_timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with self._session.post(self._url + path, json=body, timeout=request_timeout) as resp:
            return check_answer(path, resp.status, await resp.read())

    async def _sync(self) -> int:
        """Read every record; make the registry match; return the revision to watch from."""
        data = await self._post("/v3/kv/range", prefix_request(self.target.prefix))
        revision = int(data["header"]["revision"])
        present: set[str] = set()
        for kv in data.get("kvs", []):
            ident = self._on_put(kv)
            if ident is not None:
                present.add(ident)
        for ident in set(self._epochs) - present:
            self._on_delete(ident)
        self.revision = revision
        if self.stale:
            log.info("etcd at %s synced: %d instances at revision %d", self.address, len(present), revision)
            self._registry.touch_all()  # silence while etcd was unreachable was not the instances'
        self.stale = False
        self.resyncs += 1
        self.synced.set()
        return revision + 1

    async def _watch(self, start_revision: int) -> None:
        assert self._session is not None
        request = {**prefix_request(self.target.prefix), "start_revision": str(start_revision)}
        create = {"create_request": request}
        async with self._session.post(self._url + "/v3/watch", json=create) as resp:
            if resp.status != 200:
                check_answer("/v3/watch", resp.status, await resp.read())
            async for message in _json_lines(resp.content):
                result = message.get("result")
                if result is None:
                    raise EtcdError(f"etcd watch error: {message.get('error') or message}")
                if result.get("canceled"):
                    raise EtcdError(f"etcd watch cancelled: {result.get('cancel_reason') or result}")
                for event in result.get("events", []):
                    self._on_event(event)
                    # the newest change delivered (not the header's: a catching-up watch's first
                    # answer carries the store's revision before the events that lead to it)
                    self.revision = max(self.revision, int(event.get("kv", {}).get("mod_revision", 0)))
                # aiohttp hands over buffered data without suspending: behind a backlog this loop
                # would never let the rest of the router (requests, expiry) run
                await asyncio.sleep(0)

    def _on_event(self, event: dict[str, Any]) -> None:
        kv = event.get("kv", {})
        if event.get("type") == "DELETE":
            key = unb64(kv.get("key", "")).decode(errors="replace")
            self._on_delete(key.removeprefix(self.target.prefix))
        else:
            self._on_put(kv)

    def _on_put(self, kv: dict[str, Any]) -> str | None:
        try:
            record = decode_record(unb64(kv.get("value", "")))
        except (ProtocolError, ValueError) as exc:
            self.dropped["malformed"] += 1
            log.warning("dropped etcd record %r: %s", kv.get("key"), exc)
            return None
        return self.apply(record)

    def apply(self, record: Heartbeat) -> str:
        result = self._registry.apply(record)
        self.received[result.value] += 1
        if result is not ApplyResult.STALE:
            self._epochs[record.info.instance_id] = record.info.epoch
        return record.info.instance_id

    def _on_delete(self, ident: str) -> None:
        epoch = self._epochs.pop(ident, None)
        if epoch is None:
            return
        result = self._registry.apply(Deregister(instance_id=ident, epoch=epoch, sent_at=time.time()))
        self.received[result.value] += 1


async def _json_lines(stream: aiohttp.StreamReader) -> AsyncIterator[dict[str, Any]]:
    """Newline-separated JSON objects of a gateway stream, whatever their size (a message is
    collected from its chunks once, when its newline arrives)."""
    parts: list[bytes] = []
    async for chunk in stream.iter_any():
        *lines, rest = chunk.split(b"\n")
        if lines:
            lines[0] = b"".join([*parts, lines[0]])
            parts = []
            for line in lines:
                if line.strip():
                    yield _decode_message(line)
        if rest:
            parts.append(rest)
    tail = b"".join(parts)
    if tail.strip():
        yield _decode_message(tail)


def _decode_message(line: bytes) -> dict[str, Any]:
    try:
        message = msgspec.json.decode(line)
    except msgspec.DecodeError as exc:
        raise EtcdError(f"etcd watch stream: not JSON: {line[:200]!r}") from exc
    if not isinstance(message, dict):
        raise EtcdError(f"etcd watch stream: not a JSON object: {line[:200]!r}")
    return message
