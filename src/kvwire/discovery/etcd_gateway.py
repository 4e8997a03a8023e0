"""etcd v3 through its JSON gateway (``POST /v3/...``): the few calls kvwire's discovery makes.

etcd serves every v3 RPC as JSON over HTTP on its client port (grpc-gateway; keys and values are
base64, 64-bit integers are strings). kvwire talks to it with the standard library (instances: a
blocking client on the registration thread) and aiohttp (routers: range + watch stream), so neither
side needs gRPC, protobuf or an etcd client package (decision 036). No torch.

Also here: the record an instance keeps under its key (:func:`encode_record` / :func:`decode_record`,
a JSON :class:`~kvwire.discovery.heartbeats.Heartbeat`, readable with ``etcdctl get``). With a shared
secret the record is a :class:`SignedRecord` around that JSON: ``HMAC-SHA256(k, heartbeat JSON)``
with ``k`` derived from the secret for etcd records only (:func:`record_key`), so a signature of
another kind (a ZeroMQ heartbeat, ``kv_transfer_params``) never passes as a record's (decision 125).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import http.client
import json
import logging
import ssl
from typing import Any
from urllib.parse import urlsplit

import msgspec

from kvwire.discovery.address import EtcdAuth
from kvwire.discovery.heartbeats import DISCOVERY_VERSION, MAX_FRAME_BYTES, Heartbeat, check_info
from kvwire.errors import AuthenticationError, ConfigError, KvwireError, ProtocolError

log = logging.getLogger(__name__)


class EtcdError(KvwireError):
    """etcd could not be reached, or answered an error."""


class EtcdAuthError(EtcdError):
    """etcd refused these credentials (wrong user or password), asked for credentials none were
    given for, or denied this user the prefix: a configuration error, not an outage."""


class EtcdTokenError(EtcdError):
    """etcd no longer accepts the authentication token (expired, or the auth store changed):
    authenticate again."""


# etcd's error messages (etcdserver/api/v3rpc/rpctypes) that tell an auth problem
_AUTH_FAILED = ("authentication failed", "permission denied", "user name is empty", "user name not found")
_TOKEN_INVALID = ("invalid auth token", "revision of auth store is old", "auth token")
AUTH_NOT_ENABLED = "authentication is not enabled"
AUTHENTICATE_PATH = "/v3/auth/authenticate"


def auth_error(path: str, message: str) -> EtcdError:
    """The :class:`EtcdError` subclass for an etcd error message."""
    text = f"etcd {path}: {message}"
    lowered = message.lower()
    if any(m in lowered for m in _AUTH_FAILED):
        if "user name is empty" in lowered:
            text += " (etcd's authentication is on: give etcd://USER@HOST:PORT and a password)"
        return EtcdAuthError(text)
    if any(m in lowered for m in _TOKEN_INVALID):
        return EtcdTokenError(text)
    return EtcdError(text)


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def unb64(text: str) -> bytes:
    return base64.b64decode(text)


def prefix_range_end(prefix: str) -> str:
    """The exclusive end of the key range holding every key that starts with ``prefix`` (ASCII)."""
    raw = prefix.encode()
    return (raw[:-1] + bytes([raw[-1] + 1])).decode()


def prefix_request(prefix: str) -> dict[str, Any]:
    return {"key": b64(prefix), "range_end": b64(prefix_range_end(prefix))}


_RECORD_KEY_LABEL = b"kvwire etcd record v1"


class SignedRecord(msgspec.Struct, frozen=True, kw_only=True, tag="signed_record"):
    """An etcd record signed with the shared secret: ``record`` is the heartbeat's JSON, verbatim."""

    record: str
    sig: str  # hex HMAC-SHA256(record_key(secret), record as UTF-8)


_record_encoder = msgspec.json.Encoder()
_record_decoder = msgspec.json.Decoder(Heartbeat | SignedRecord)
_heartbeat_decoder = msgspec.json.Decoder(Heartbeat)


def record_key(secret: str | bytes) -> bytes:
    """The key etcd records are signed with, derived from the shared secret (never the secret itself)."""
    raw = secret.encode() if isinstance(secret, str) else bytes(secret)
    if not raw:
        raise ConfigError("the shared secret must not be empty")
    return hmac.new(raw, _RECORD_KEY_LABEL, hashlib.sha256).digest()


def _record_mac(key: bytes, payload: bytes) -> str:
    return hmac.new(key, payload, hashlib.sha256).hexdigest()


def encode_record(hb: Heartbeat, key: bytes | None = None) -> bytes:
    """The value to put in etcd: the heartbeat's JSON, or (``key``: :func:`record_key`) a signed one."""
    payload = _record_encoder.encode(hb)
    if key is None:
        return payload
    return _record_encoder.encode(SignedRecord(record=payload.decode(), sig=_record_mac(key, payload)))


def decode_record(value: bytes, key: bytes | None = None) -> Heartbeat:
    """A record read from etcd -> :class:`Heartbeat`. Raises ``ProtocolError`` for anything else, and
    :class:`~kvwire.errors.AuthenticationError` when ``key`` is given and the record is unsigned or
    its signature is wrong (checked before the heartbeat inside is parsed). Without ``key`` a signed
    record is read without checking (a router without the secret trusts etcd's access control)."""
    if len(value) > MAX_FRAME_BYTES:
        raise ProtocolError(f"instance record of {len(value)} bytes exceeds {MAX_FRAME_BYTES}")
    try:
        outer = _record_decoder.decode(value)
        if isinstance(outer, SignedRecord):
            payload = outer.record.encode()
            expected = b"" if key is None else _record_mac(key, payload).encode()
            if key is not None and not hmac.compare_digest(outer.sig.encode(), expected):
                raise AuthenticationError("bad instance record signature")
            hb = _heartbeat_decoder.decode(payload)
        elif key is not None:
            raise AuthenticationError("unsigned instance record (the router requires a secret)")
        else:
            hb = outer
    except ProtocolError:
        raise
    except Exception as exc:  # DecodeError, ValidationError, RecursionError (nesting), ...
        raise ProtocolError(f"malformed instance record: {type(exc).__name__}: {exc}") from exc
    if hb.v != DISCOVERY_VERSION:
        raise ProtocolError(f"instance record version {hb.v} unsupported (expected {DISCOVERY_VERSION})")
    check_info(hb.info)
    return hb


def check_answer(path: str, status: int, body: bytes) -> dict[str, Any]:
    """Parse a gateway answer; raises :class:`EtcdError` for HTTP errors and gateway error bodies."""
    try:
        data = json.loads(body) if body else {}
    except (ValueError, RecursionError) as exc:
        raise EtcdError(f"etcd {path}: HTTP {status}, not JSON: {body[:200]!r}") from exc
    if status != 200 or (isinstance(data, dict) and "error" in data and "result" not in data):
        message = data.get("message") or data.get("error") if isinstance(data, dict) else body[:200].decode()
        raise auth_error(path, f"HTTP {status}: {message}")
    return data if isinstance(data, dict) else {}


def authenticate_body(auth: EtcdAuth) -> dict[str, str]:
    return {"name": auth.user, "password": auth.password}


def token_of(auth: EtcdAuth, url: str, status: int, body: bytes) -> str:
    """The token in an answer to ``/v3/auth/authenticate``; "" when etcd's authentication is off
    (the calls then go without one). Raises :class:`EtcdAuthError` naming the user when etcd
    refuses the credentials."""
    try:
        data = check_answer(AUTHENTICATE_PATH, status, body)
    except EtcdAuthError as exc:
        raise EtcdAuthError(f"etcd at {url} refused user {auth.user!r}: {exc}") from exc
    except EtcdError as exc:
        if AUTH_NOT_ENABLED in str(exc):
            log.warning("etcd at %s has authentication off; user %r is not needed", url, auth.user)
            return ""
        raise
    token = data.get("token")
    if not isinstance(token, str) or not token:
        raise EtcdError(f"etcd at {url}: {AUTHENTICATE_PATH} answered no token: {body[:200]!r}")
    return token


class EtcdHttp:
    """Blocking gateway client on one keep-alive HTTP(S) connection (one thread uses it).

    Every call has a deadline (``timeout_s``) and raises :class:`EtcdError` on any failure; the
    connection is reopened on the next call. With ``auth``, the first call authenticates
    (``/v3/auth/authenticate``) and every call carries the token; a call etcd answers "invalid
    token" (expired: etcd's ``--auth-token-ttl`` of disuse, or the auth store changed) authenticates
    again and is retried once. Wrong credentials: :class:`EtcdAuthError`.
    """

    def __init__(self, url: str, timeout_s: float, ssl_context: ssl.SSLContext | None = None,
                 auth: EtcdAuth | None = None) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or parts.hostname is None or parts.port is None:
            raise EtcdError(f"etcd URL must be http(s)://HOST:PORT, got {url!r}")
        if parts.scheme == "https" and ssl_context is None:
            ssl_context = ssl.create_default_context()
        self.url = url
        self._host, self._port = parts.hostname, parts.port
        self._timeout_s = timeout_s
        self._ssl = ssl_context if parts.scheme == "https" else None
        self._conn: http.client.HTTPConnection | None = None
        self._auth = auth
        self._token: str | None = None  # None: not authenticated yet; "": etcd's auth is off
        self.authentications = 0

    def call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return check_answer(path, 200, self._raw(path, json.dumps(body).encode()))

    def _raw(self, path: str, payload: bytes) -> bytes:
        """POST ``payload`` (authenticated when credentials are set); the answer's body."""
        if self._auth is None:
            return self._post(path, payload)
        if self._token is None:
            self._authenticate(self._auth)
        try:
            return self._post(path, payload)
        except EtcdTokenError:
            self._token = None
            self._authenticate(self._auth)
            return self._post(path, payload)

    def _authenticate(self, auth: EtcdAuth) -> None:
        self._token = None
        status, data = self._send(AUTHENTICATE_PATH, json.dumps(authenticate_body(auth)).encode())
        self._token = token_of(auth, self.url, status, data)
        self.authentications += 1

    def _post(self, path: str, payload: bytes) -> bytes:
        """POST ``payload``; the answer's body (HTTP errors raised as :class:`EtcdError`)."""
        status, data = self._send(path, payload)
        if status != 200:
            check_answer(path, status, data)  # raises with etcd's message
        return data

    def _send(self, path: str, payload: bytes) -> tuple[int, bytes]:
        """POST once (once more on a fresh connection if a kept-alive one fails); status and body."""
        reused = self._conn is not None
        try:
            status, data = self._request(path, payload)
        except (OSError, http.client.HTTPException) as exc:
            self.close()
            if not reused:
                raise EtcdError(f"etcd at {self.url} unreachable ({path}): {exc}") from exc
            try:  # the kept-alive connection may have been closed by a restarted etcd: once more, fresh
                status, data = self._request(path, payload)
            except (OSError, http.client.HTTPException) as exc2:
                self.close()
                raise EtcdError(f"etcd at {self.url} unreachable ({path}): {exc2}") from exc2
        return status, data

    def _request(self, path: str, payload: bytes) -> tuple[int, bytes]:
        if self._conn is None:
            if self._ssl is not None:
                self._conn = http.client.HTTPSConnection(self._host, self._port, timeout=self._timeout_s,
                                                         context=self._ssl)
            else:
                self._conn = http.client.HTTPConnection(self._host, self._port, timeout=self._timeout_s)
        headers = {"Content-Type": "application/json"}
        if self._token:
            headers["Authorization"] = self._token
        self._conn.request("POST", path, payload, headers)
        resp = self._conn.getresponse()
        return resp.status, resp.read()

    def grant(self, ttl_s: int) -> int:
        """A new lease of ``ttl_s`` seconds; returns its id."""
        return int(self.call("/v3/lease/grant", {"TTL": ttl_s})["ID"])

    def keepalive(self, lease: int) -> int:
        """Renew ``lease``; returns its TTL, 0 when etcd no longer knows it (expired or revoked)."""
        result = self.call("/v3/lease/keepalive", {"ID": str(lease)}).get("result", {})
        return int(result.get("TTL", 0))

    def put(self, key: str, value: bytes, lease: int) -> None:
        body = {"key": b64(key), "value": base64.b64encode(value).decode(), "lease": str(lease)}
        self.call("/v3/kv/put", body)

    def keepalive_many(self, leases: list[int]) -> list[int]:
        """Renew several leases in one request (the gateway streams one answer per lease, in order);
        their TTLs, 0 for a lease etcd no longer knows. For processes holding many leases (the
        discovery benchmark's simulator)."""
        body = "\n".join(json.dumps({"ID": str(lease)}) for lease in leases).encode()
        data = self._raw("/v3/lease/keepalive", body)
        answers = [json.loads(line) for line in data.splitlines() if line.strip()]
        ttls = [int(answer.get("result", {}).get("TTL", 0)) for answer in answers]
        if len(ttls) != len(leases):
            raise EtcdError(f"etcd keep-alive: {len(ttls)} answers for {len(leases)} leases")
        return ttls

    def put_many(self, items: list[tuple[str, bytes, int]]) -> None:
        """Put several ``(key, value, lease)`` in one transaction (at most 128: etcd's default limit)."""
        ops = [
            {"request_put": {"key": b64(key), "value": base64.b64encode(value).decode(), "lease": str(lease)}}
            for key, value, lease in items
        ]
        self.call("/v3/kv/txn", {"success": ops})

    def revoke(self, lease: int) -> None:
        """Drop ``lease`` and every key bound to it (watchers see the deletions at once)."""
        self.call("/v3/lease/revoke", {"ID": str(lease)})

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
