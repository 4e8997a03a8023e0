"""Instance side of etcd discovery: keep this instance's record under a lease in etcd.

Same surface as :class:`~kvwire.discovery.client.HeartbeatClient` (``start``, ``send_now``,
``close``, ``sent``/``dropped``), so every host registers the same way whatever the backend.

Contract:
* One daemon thread, supervised (``kvwire-etcd-registration`` on the host's ``board``). It grants
  a lease of ``lease_ttl_s`` (the heartbeat TTL: 3 heartbeat intervals, at least 2 s) and puts
  the record (a JSON :class:`Heartbeat`: role, model, URL, KV endpoints (one per TP rank), load)
  at ``prefix + instance_id`` bound to that lease.
* Every ``interval_s`` it renews the lease (a keep-alive) and puts the record with the current
  load (``refresh_s``, default the interval). If the process dies or stops (kill -9, SIGSTOP, host
  gone), both stop: routers take it out of routing when the TTL passes without a record (the
  record says so: ``ttl_s``), and etcd deletes the key when the lease runs out: every router
  watching sees the deletion (decision 095).
* Between rounds (:meth:`send_now`), a changed load is put at most once per ``min_put_interval_s``.
  With ``refresh_s`` above the interval (fewer etcd writes), records carry no ``ttl_s`` and only
  the lease tells a dead instance.
* etcd unreachable: the thread keeps trying every interval (failures counted in ``dropped``,
  logged once per outage; :attr:`last_error` says why). With credentials in the address
  (``etcd://USER@...``) it authenticates first and again when etcd drops the token; credentials
  etcd refuses are logged as an error (:class:`~kvwire.discovery.etcd_gateway.EtcdAuthError`) and
  retried every interval, so fixing them in etcd is enough. A keep-alive answered "unknown
  lease" (etcd lost it: restarted without its data, or the lease expired meanwhile) makes it
  grant a new lease and put the record again.
* With a shared secret (``secret``) every record is signed (:func:`~kvwire.discovery.etcd_gateway.
  encode_record`); its ``seq`` grows by one per put and ``sent_at`` is the wall clock, so a router
  refuses an old record written again (decision 125).
* :meth:`close` revokes the lease (the key goes at once: a graceful deregistration), waiting at most
  ``linger_s`` + the call deadline.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from types import TracebackType

from kvwire.discovery.address import DiscoveryAddress
from kvwire.discovery.client import LoadFn
from kvwire.discovery.etcd_gateway import EtcdAuthError, EtcdError, EtcdHttp, encode_record, record_key
from kvwire.discovery.heartbeats import Heartbeat, InstanceInfo, InstanceLoad
from kvwire.errors import ConfigError
from kvwire.supervision import HealthBoard, SupervisedThread

log = logging.getLogger(__name__)


def lease_ttl_for(interval_s: float) -> int:
    """The lease TTL for a heartbeat interval: 3 missed intervals, whole seconds, at least 2 s."""
    return max(2, math.ceil(3 * interval_s))


class EtcdRegistration:
    """Keeps ``info``'s record alive in etcd at ``target`` until :meth:`close`."""

    def __init__(
        self,
        target: DiscoveryAddress,
        info: InstanceInfo,
        load_fn: LoadFn | None = None,
        interval_s: float = 2.0,
        *,
        lease_ttl_s: int | None = None,
        min_put_interval_s: float | None = None,
        refresh_s: float | None = None,
        linger_s: float = 0.5,
        board: HealthBoard | None = None,
        secret: str | bytes | None = None,
    ) -> None:
        if interval_s <= 0:
            raise ConfigError(f"heartbeat interval_s must be > 0, got {interval_s}")
        self.target = target
        self.info = info
        self.interval_s = interval_s
        self.lease_ttl_s = lease_ttl_s or lease_ttl_for(interval_s)
        self.min_put_interval_s = interval_s if min_put_interval_s is None else min_put_interval_s
        self.refresh_s = interval_s if refresh_s is None else refresh_s
        # the promise a record makes: another one within the lease TTL (kept only at one per interval)
        self.record_ttl_s = float(self.lease_ttl_s) if self.refresh_s <= interval_s else 0.0
        self._key = target.key(info.instance_id)
        self._record_key = record_key(secret) if secret else None  # signs each record
        self._load_fn = load_fn
        self._linger_s = linger_s
        self._http = EtcdHttp(target.address, timeout_s=min(2.0, max(0.5, interval_s)),
                              ssl_context=target.ssl_context(), auth=target.auth)
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._board = board
        self._thread: SupervisedThread | None = None
        self._seq = 0
        self._lease: int | None = None
        self._last_put = -math.inf
        self._last_load: InstanceLoad | None = None
        self._failing = False
        self.sent = 0  # successful etcd calls (grants, puts, keep-alives)
        self.puts = 0  # record puts (registrations and load updates)
        self.dropped = 0  # failed etcd calls
        self.leases_granted = 0
        self.last_error = ""  # the latest failure ("" once etcd answers again)

    @property
    def lease(self) -> int | None:
        return self._lease

    def start(self) -> EtcdRegistration:
        if self._thread is None:
            self._thread = SupervisedThread("kvwire-etcd-registration", self._run, self._stop,
                                            board=self._board)
            self._thread.start()
        return self

    def send_now(self) -> None:
        """Ask the thread for a load update now (still rate-limited)."""
        self._wake.set()

    def close(self) -> None:
        """Stop renewing and revoke the lease (idempotent)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.stop(timeout_s=self._linger_s + 4.0)  # logs when it did not stop in time

    def __enter__(self) -> EtcdRegistration:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # --- thread ---------------------------------------------------------------------------------

    def _run(self) -> None:
        """The supervised thread's body: rounds until close(), then the revoke. Anything but an
        etcd failure (counted in :meth:`tick`) raises to the supervisor: restarted with backoff, or
        dead (the host's ``/health`` answers 503 naming ``kvwire-etcd-registration``)."""
        try:
            while not self._stop.is_set():
                self.tick()
                self._wake.wait(self.interval_s)
                self._wake.clear()
            if self._lease is not None:
                self._http.revoke(self._lease)
        except EtcdError as exc:
            log.warning("could not revoke the etcd lease of %s: %s", self.info.instance_id, exc)
        finally:
            self._http.close()

    def tick(self) -> None:
        """One round: renew (or re-create) the lease, then put the record if due. Never raises
        :class:`EtcdError` (counted and logged instead)."""
        try:
            if self._lease is not None and self._http.keepalive(self._lease) <= 0:
                log.warning("etcd lost the lease of %s; registering again", self.info.instance_id)
                self._lease = None
            if self._lease is None:
                self._lease = self._http.grant(self.lease_ttl_s)
                self.leases_granted += 1
                self.sent += 1
                self._put(self._load(), force=True)
            else:
                self.sent += 1
                self._put(self._load(), force=False)
            if self._failing:
                log.info("etcd at %s reachable again (%s)", self.target.address, self.info.instance_id)
                self._failing = False
                self.last_error = ""
        except EtcdError as exc:
            self.dropped += 1
            if str(exc) != self.last_error:  # once per outage, or when the reason changes
                if isinstance(exc, EtcdAuthError):
                    log.error("etcd registration of %s refused, not registered until the credentials "
                              "are fixed (retrying every %.1f s): %s", self.info.instance_id,
                              self.interval_s, exc)
                else:
                    log.warning("etcd registration of %s: %s", self.info.instance_id, exc)
            self._failing, self.last_error = True, str(exc)

    def revoke(self) -> None:
        """Revoke the lease now (the record goes at once); for callers that drive :meth:`tick` themselves.
        Raises :class:`EtcdError`."""
        if self._lease is not None:
            self._http.revoke(self._lease)
            self._lease = None

    def disconnect(self) -> None:
        """Close the HTTP connection to etcd (the next call opens a new one)."""
        self._http.close()

    def _put(self, load: InstanceLoad | None, *, force: bool) -> None:
        assert self._lease is not None
        now = time.monotonic()
        since = now - self._last_put
        changed = load != self._last_load
        if not force and not (changed and since >= self.min_put_interval_s) and since < self.refresh_s:
            return
        self._seq += 1
        record = Heartbeat(info=self.info, load=load, seq=self._seq, sent_at=time.time(),
                           ttl_s=self.record_ttl_s)
        self._http.put(self._key, encode_record(record, self._record_key), self._lease)
        self._last_put, self._last_load = now, load
        self.puts += 1
        self.sent += 1

    def _load(self) -> InstanceLoad | None:
        if self._load_fn is None:
            return None
        try:
            return self._load_fn()
        except Exception:
            log.exception("load_fn of %s raised; the record carries no load", self.info.instance_id)
            return None
