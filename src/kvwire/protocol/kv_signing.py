"""Router-signed ``kv_transfer_params``: only the router decides which peers exchange KV.

With a shared secret (``KVWIRE_SECRET``, the one discovery heartbeats and the transfer control plane
already use), the router signs every :class:`~kvwire.protocol.kv_params.KVTransferParams` it hands an
instance: ``sig = HMAC-SHA256(k, canonical(params without sig))`` where ``k`` is derived from the
secret for this purpose only (a heartbeat signature can never pass as a params signature). The
signature covers every field: transfer id, mode, role, the peer's instance id and KV endpoints, the
deadline, pull mode's first token and prompt length, and ``expires_at`` (Unix seconds).

The router names only peers from its registry, which admits only heartbeats signed with the same
secret; so a valid signature is the proof that the peer endpoints come from discovery, not from the
request (decision 043). Instances verify with :class:`ParamsVerifier` before anything is scheduled or
any connection is made, and refuse (HTTP 403 on ``kvwire serve``) params that are unsigned, tampered
with, expired (beyond :data:`CLOCK_SKEW_S`) or replayed (same transfer id and role seen before, while
still unexpired).

Without a secret nothing is signed or checked: a development setup on one host.
"""

from __future__ import annotations

import collections
import enum
import hashlib
import hmac
import threading
import time
from collections.abc import Callable

import msgspec

from kvwire.errors import ConfigError, ForbiddenError
from kvwire.protocol.kv_params import KVTransferParams

_KEY_LABEL = b"kvwire kv_transfer_params v1"
CLOCK_SKEW_S = 5.0  # how far the router's and an instance's clocks may disagree
DEFAULT_TTL_S = 60.0
MAX_REMEMBERED = 100_000  # replay cache bound (oldest forgotten first)


class ParamsRefusal(str, enum.Enum):
    """Why an instance refused ``kv_transfer_params`` (metric label)."""

    UNSIGNED = "unsigned"
    BAD_SIGNATURE = "bad_signature"
    EXPIRED = "expired"
    REPLAYED = "replayed"


class KVParamsRefused(ForbiddenError):
    """``kv_transfer_params`` failed verification (HTTP 403); ``refusal`` says why."""

    def __init__(self, message: str, refusal: ParamsRefusal) -> None:
        super().__init__(message, refusal.value)
        self.refusal = refusal


def derive_key(secret: str | bytes) -> bytes:
    raw = secret.encode() if isinstance(secret, str) else bytes(secret)
    if not raw:
        raise ConfigError("the shared secret must not be empty")
    return hmac.new(raw, _KEY_LABEL, hashlib.sha256).digest()


def _mac(key: bytes, params: KVTransferParams) -> str:
    canonical = msgspec.json.encode(msgspec.structs.replace(params, sig=None))
    return hmac.new(key, canonical, hashlib.sha256).hexdigest()


class ParamsSigner:
    """Router side: :meth:`sign` returns a copy valid for ``ttl_s`` seconds. Any thread."""

    def __init__(self, secret: str | bytes, ttl_s: float = DEFAULT_TTL_S,
                 clock: Callable[[], float] = time.time) -> None:
        if ttl_s <= 0:
            raise ConfigError(f"kv_transfer_params TTL must be > 0, got {ttl_s}")
        self._key = derive_key(secret)
        self._ttl_s = ttl_s
        self._clock = clock

    def sign(self, params: KVTransferParams) -> KVTransferParams:
        unsigned = msgspec.structs.replace(params, expires_at=round(self._clock() + self._ttl_s, 3), sig=None)
        return msgspec.structs.replace(unsigned, sig=_mac(self._key, unsigned))


class ParamsVerifier:
    """Instance side. :meth:`verify` raises :class:`KVParamsRefused`; thread-safe."""

    def __init__(self, secret: str | bytes, clock: Callable[[], float] = time.time,
                 max_remembered: int = MAX_REMEMBERED) -> None:
        self._key = derive_key(secret)
        self._clock = clock
        self._max_remembered = max_remembered
        self._lock = threading.Lock()
        # (transfer id, role) -> expires_at, in arrival order, for replay detection
        self._seen: collections.OrderedDict[tuple[str, str], float] = collections.OrderedDict()

    def verify(self, params: KVTransferParams) -> None:
        if params.sig is None or params.expires_at is None:
            raise KVParamsRefused("kv_transfer_params are not signed by the router (this instance "
                                  "requires signed parameters: a shared secret is set)",
                                  ParamsRefusal.UNSIGNED)
        # compared as bytes: compare_digest refuses str with non-ASCII characters (TypeError)
        sig = params.sig.encode("utf-8", "surrogatepass")
        if not hmac.compare_digest(sig, _mac(self._key, params).encode()):
            raise KVParamsRefused("kv_transfer_params signature does not match",
                                  ParamsRefusal.BAD_SIGNATURE)
        now = self._clock()
        if now > params.expires_at + CLOCK_SKEW_S:
            raise KVParamsRefused(f"kv_transfer_params expired {now - params.expires_at:.1f} s ago",
                                  ParamsRefusal.EXPIRED)
        self._remember(params, now)

    def _remember(self, params: KVTransferParams, now: float) -> None:
        key = (params.transfer_id, params.role.value)
        assert params.expires_at is not None
        with self._lock:
            while self._seen:  # forget what expired (arrival order ~ expiry order)
                oldest_key, expires = next(iter(self._seen.items()))
                if expires + CLOCK_SKEW_S >= now and len(self._seen) < self._max_remembered:
                    break
                del self._seen[oldest_key]
            if key in self._seen:
                raise KVParamsRefused(f"kv_transfer_params for transfer {params.transfer_id} were already "
                                      "used", ParamsRefusal.REPLAYED)
            self._seen[key] = params.expires_at


def verifier_from_secret(secret: str | bytes | None) -> ParamsVerifier | None:
    """A verifier when a secret is set, else None (no verification)."""
    return ParamsVerifier(secret) if secret else None


def verifying(
    check: Callable[[object], KVTransferParams], verifier: ParamsVerifier,
    on_refused: Callable[[KVParamsRefused], None],
) -> Callable[[object], KVTransferParams]:
    """The signature check, then ``check`` (the connector's admission check, which may act on the
    parameters: P promises D its transfer, which contacts D): nothing of a refused request reaches
    ``check``. Malformed parameters -> InvalidRequestError; a refusal is reported to
    ``on_refused`` (count, log) and re-raised."""

    def checked(raw: object) -> KVTransferParams:
        params = raw if isinstance(raw, KVTransferParams) else KVTransferParams.from_dict(raw)
        try:
            verifier.verify(params)
        except KVParamsRefused as exc:
            on_refused(exc)
            raise
        return check(params)

    return checked
